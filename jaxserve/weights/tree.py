"""A model's parameters as the loaders see them: a plain dict tree (`nnx.to_pure_dict`) of leaves
under paths such as ("layers", 3, "mlp", "up_proj", "kernel"), each filled from one checkpoint
tensor, shard by shard, straight from the memory-mapped file (no full copy on one device first).

Shared by the causal-LM loader, the classifier loader, the random-weight builder and the orbax
cache, so every kind of model is read, checked and placed by the same code.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.weights.safetensors_dir import WeightsError
from jaxserve.weights.source import ModelSource

ParamPath = tuple[str | int, ...]  # dict keys from the root; list entries (layers) are ints
ShardingFn = Callable[[ParamPath, tuple[int, ...]], jax.sharding.Sharding]
# parameter path -> (checkpoint tensor name, transposed: the checkpoint stores it [.., out, in])
NameFn = Callable[[ParamPath], tuple[str, bool]]


def leaf_paths(tree: Any, prefix: ParamPath = ()) -> list[tuple[ParamPath, Any]]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in leaf_paths(v, (*prefix, k))]
    return [(prefix, tree)]


def set_leaf(tree: dict, path: ParamPath, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def path_name(path: ParamPath) -> str:
    return ".".join(map(str, path))


def transpose_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A kernel's shape as the checkpoint stores it: the last two axes swapped ([in, out] of a
    Linear, [experts, in, out] of stacked experts, stored [out, in] / [experts, out, in])."""
    return (*shape[:-2], shape[-1], shape[-2])


def single_device_sharding(path: ParamPath, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def abstract(build: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State, dict]:
    """Graph definition, abstract state, and the parameter tree as a plain dict of ShapeDtypeStructs
    of the module `build` makes (nothing is allocated)."""
    graphdef, state = nnx.split(nnx.eval_shape(build))
    return graphdef, state, nnx.to_pure_dict(state)


def merge(graphdef: nnx.GraphDef, state: nnx.State, tree: dict) -> Any:
    """Fill the abstract `state` with the arrays of `tree` (same structure) and build the module."""
    nnx.replace_by_pure_dict(state, tree)
    return nnx.merge(graphdef, state)


def tensor_names(source: ModelSource, leaves: Iterable[tuple[ParamPath, Any]], name_of: NameFn,
                 alias: Callable[[str], str] = lambda name: name,
                 ignored: Callable[[str], bool] = lambda name: False) -> dict[ParamPath, tuple[str, bool]]:
    """The checkpoint tensor (name, transposed) of every leaf, checked: each exists (under its own
    name or the one `alias` finds) with the shape the config implies, and the checkpoint holds
    nothing the model does not use (except what `ignored` allows). Raises WeightsError naming the
    tensor."""
    names: dict[ParamPath, tuple[str, bool]] = {}
    for path, spec in leaves:
        wanted, transposed = name_of(path)
        name = alias(wanted)
        if name not in source.tensors:
            raise WeightsError(f"{source.path}: tensor {wanted} is missing from the checkpoint")
        shape = tuple(spec.shape)
        want = transpose_shape(shape) if transposed else shape
        got = source.tensors[name][1]
        if got != want:
            raise WeightsError(f"{source.path}: tensor {name} has shape {got}, the config implies {want}")
        names[path] = (name, transposed)
    used = {name for name, _ in names.values()}
    extra = sorted(n for n in set(source.tensors) - used if not ignored(n))
    if extra:
        more = " ..." if len(extra) > 5 else ""
        raise WeightsError(f"{source.path}: tensors the model does not use: {extra[:5]}{more}")
    return names


def array_from_tensor(source: ModelSource, name: str, transposed: bool, spec: Any, dtype: Any,
                      sharding: jax.sharding.Sharding) -> jax.Array:
    """One parameter placed with `sharding`: each device's shard is read from the source on its own."""

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        w = source.tensors[name][0]()
        if not transposed:
            return np.asarray(w[index], dtype=dtype)
        # Read the shard in the stored orientation (only its own rows and columns), then turn it.
        stored = (*index[:-2], index[-1], index[-2])
        return np.asarray(np.swapaxes(np.asarray(w[stored]), -1, -2), dtype=dtype)

    return jax.make_array_from_callback(tuple(spec.shape), sharding, shard)


def fill_from_source(graphdef: nnx.GraphDef, state: nnx.State, tree: dict, source: ModelSource,
                     names: dict[ParamPath, tuple[str, bool]], dtype: Any, sharding: ShardingFn,
                     skip: Callable[[str], bool] = lambda name: False) -> Any:
    """Read every leaf of `tree` from its checkpoint tensor (with a progress bar) and build the
    module. Tensors `skip` names stay abstract (a ShapeDtypeStruct with the leaf's sharding): their
    weights come in another form (a GGUF's blocks, jaxserve.models.products.place)."""
    leaves = []
    for path, spec in leaf_paths(tree):
        if skip(names[path][0]):
            set_leaf(tree, path, jax.ShapeDtypeStruct(tuple(spec.shape), dtype, sharding=sharding(path, tuple(spec.shape))))
        else:
            leaves.append((path, spec))
    total = sum(int(np.prod(s.shape)) * jnp.dtype(dtype).itemsize for _, s in leaves)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {source.path.name}", leave=False,
              disable=None) as bar:
        for path, spec in leaves:
            name, transposed = names[path]
            arr = array_from_tensor(source, name, transposed, spec, dtype, sharding(path, tuple(spec.shape)))
            set_leaf(tree, path, arr)
            bar.update(arr.nbytes)
            bar.set_postfix_str(path_name(path))
    return merge(graphdef, state, tree)
