"""The device mesh of tensor parallelism: N local devices on one "model" axis.

A tensor-parallel size of 1 builds no mesh at all: parameters stay on one device with a
`SingleDeviceSharding` and the runner compiles exactly the unsharded step it always did.
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


def make_mesh(tensor_parallel_size: int) -> Mesh | None:
    """A 1-D mesh over the first `tensor_parallel_size` local devices, or None for size 1."""
    devices = jax.local_devices()
    check_tensor_parallel_size(tensor_parallel_size, len(devices))
    if tensor_parallel_size == 1:
        return None
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh a pytree of arrays is laid out on (None when it lives on one device). The runner
    reads the layout from the loaded parameters, so the engine needs no separate parallel flag."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None
