"""Abstract TPU chips for deviceless compilation through the real TPU compiler (libtpu).

`get_topology_desc` gives the devices of a TPU slice without a TPU; jitting under
`use_abstract_mesh` and calling `.lower(...).compile()` then runs XLA:TPU and Mosaic exactly as on
the chip, and `memory_analysis()` / `cost_analysis()` describe the program. Needs the `libtpu`
wheel (the `test` extra installs it on Linux x86_64); without it the tests here are skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

# libtpu takes /tmp/libtpu_lockfile so that two processes never drive one TPU; there is no TPU
# here, and a second test run (or anyone compiling for TPU) on the machine must not fail on it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Chip:
    """One abstract TPU chip: a one-device mesh on it and the figures the tests budget against."""

    name: str  # topology name, e.g. "v5e:2x2"
    mesh: object  # jax.sharding.Mesh over one abstract device, axis "model"
    hbm_bytes: int  # what the compiler lets a program use (it keeps a little for itself)
    vmem_bytes: int


# What XLA:TPU reports as available HBM in its out-of-memory errors (16 GiB / 32 GiB chips), and
# each chip's VMEM (128 MiB on both).
CHIP_MEMORY = {
    "TPU v5 lite": (int(15.75 * GiB), 128 * MiB),
    "TPU v6 lite": (int(31.24 * GiB), 128 * MiB),
}


LIBTPU_MISSING = (
    "libtpu is not installed (the `test` extra installs it on Linux x86_64; the lent GPU machine has "
    "none): the deviceless TPU compile checks need the TPU compiler"
)


@pytest.fixture(scope="session")
def tpu_chip():
    """`tpu_chip("v5e:2x2")` -> Chip: one device of that abstract slice (single chip: the kernels
    are per chip). Topologies are built once per session."""
    pytest.importorskip("libtpu", reason=LIBTPU_MISSING)
    import jax
    import numpy as np
    from jax.experimental import topologies

    chips: dict[str, Chip] = {}

    def get(name: str) -> Chip:
        if name not in chips:
            topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
            device = topology.devices[0]
            hbm, vmem = CHIP_MEMORY[device.device_kind]
            chips[name] = Chip(name, jax.sharding.Mesh(np.array([device]), ("model",)), hbm, vmem)
        return chips[name]

    return get
