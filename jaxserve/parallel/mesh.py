"""The device mesh of tensor parallelism: N local devices on one "model" axis.

Every size, 1 included, builds a mesh, so one code path (sharding annotations, GSPMD) serves
every tensor-parallel size: what runs on one chip is what runs on eight. `make_mesh(1,
sharded=False)` gives no mesh at all (parameters on one device with a `SingleDeviceSharding`, the
plain unannotated step); it exists so `benchmarks/engine.py --layouts` can show the mesh costs
nothing at size 1.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

MODEL_AXIS = "model"


def check_tensor_parallel_size(size: int, local_devices: int) -> None:
    """Raise ValueError naming the numbers when `size` devices cannot be had on this host."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size > local_devices:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} devices, but this host has only "
                         f"{local_devices} {jax.default_backend()} device{'s' if local_devices != 1 else ''}")


def make_mesh(tensor_parallel_size: int, sharded: bool = True) -> Mesh | None:
    """A 1-D mesh over the first `tensor_parallel_size` local devices; None only for
    `sharded=False` at size 1 (the unannotated single-device baseline)."""
    if jax.process_count() > 1:
        # Multi-host: one mesh over every process's devices, each process owning its own shards.
        devices = jax.devices()
        if tensor_parallel_size != len(devices):
            raise ValueError(f"--tensor-parallel-size {tensor_parallel_size}: under jax.distributed the mesh spans "
                             f"all {len(devices)} devices of the {jax.process_count()} processes; pass "
                             f"--tensor-parallel-size {len(devices)}")
        return Mesh(np.asarray(devices), (MODEL_AXIS,))
    devices = jax.local_devices()
    check_tensor_parallel_size(tensor_parallel_size, len(devices))
    if not sharded:
        if tensor_parallel_size != 1:
            raise ValueError(f"an unsharded run needs --tensor-parallel-size 1, got {tensor_parallel_size}")
        return None
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh a pytree of arrays is laid out on (None when it has no mesh: the unsharded
    baseline). The runner reads the layout from the loaded parameters, so the engine needs no
    separate parallel flag."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None
