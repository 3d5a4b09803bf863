"""LoRA adapters served beside the base model, any mix of them in one batch (multi-LoRA, as
vLLM's punica kernels and SGLang's S-LoRA batching do).

The model is given S adapter slots of rank r (`add_lora_slots`): a targeted projection's Linear
holds `lora_a` [in, S * r] and `lora_b` [S * r, out], the slots' factors side by side, each
adapter padded with zeros to the rank r, its scale folded into b. The runner writes an adapter
into a free slot when it is loaded (`write_slot`; jaxserve.engine.lora_slots keeps which).
A step knows each token's slot (-1: the base model) and computes, for every projection an
adapter targets,

    y = x @ W + ((x @ lora_a) * mask) @ lora_b,     mask [.., S * r] = the token's slot's r columns

so one dense product of S * r columns serves every adapter in the batch with static shapes and no
gathers: the other slots' columns are multiplied by exact zeros. It costs S * r * (in + out)
multiply-adds per token per projection, small beside the base product for the ranks and adapter
counts served (vLLM's defaults: rank 16, one adapter per batch). Under tensor parallelism the
factors split with their projection (jaxserve.parallel.rules): `lora_b` by the output columns of
q/k/v/gate/up, `lora_a` by the input rows of o/down, and GSPMD adds the small all-reduce of the
[.., S * r] product.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.weights.lora_adapter import TARGETS

Array = jax.Array


def target_shapes(decoder: Any) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) in `decoder`. Raises ValueError for a mixture of
    experts, whose experts take no adapter slots (yet)."""
    cfg = decoder.cfg
    if getattr(cfg, "moe", None) is not None:
        raise ValueError(f"LoRA adapters are not supported for {cfg.architecture} (a mixture of experts) yet: "
                         "its experts take no adapter slots")
    layer = decoder.layers[0]
    return {proj: tuple(getattr(getattr(layer, part), proj).kernel.get_value().shape)  # type: ignore[misc]
            for proj, (part, _) in TARGETS.items()}


def slot_targets(decoder: Any) -> tuple[str, ...]:
    """The projections that have adapter slots (PEFT module names)."""
    layer = decoder.layers[0]
    return tuple(proj for proj, (part, _) in TARGETS.items()
                 if getattr(getattr(getattr(layer, part), proj), "lora_a", None) is not None)


def add_lora_slots(decoder: Any, num_slots: int, rank: int, targets: Iterable[str], abstract: bool = False,
                   dtype: Any = None) -> None:
    """Give every layer's `targets` projections `num_slots` empty adapter slots of rank `rank`
    (zero factors, under tensor parallelism on the parameters' mesh). Adapters are written into
    them by the runner (`write_slot`). abstract: ShapeDtypeStructs instead of arrays, for a model
    built by nnx.eval_shape (jaxserve.plan). dtype: the factors' (`factor_dtype` by default)."""
    from jaxserve.parallel import ShardingPlan, mesh_of

    if num_slots < 1 or rank < 1:
        raise ValueError(f"LoRA slots need num_slots >= 1 and rank >= 1, got {num_slots} and {rank}")
    cfg = decoder.cfg
    dtype = dtype or factor_dtype(decoder.dtype, jax.devices()[0].platform)
    mesh = mesh_of(nnx.state(decoder))
    plan = ShardingPlan(mesh, cfg) if mesh is not None else None
    shapes = target_shapes(decoder)

    def zeros(path: tuple, shape: tuple[int, int]) -> nnx.Param:
        if abstract:
            return nnx.Param(jax.ShapeDtypeStruct(shape, dtype))
        sharding = plan.param_sharding(path, shape) if plan is not None else None
        return nnx.Param(jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)())

    for layer in range(cfg.num_layers):
        for proj in sorted(set(targets)):
            part, _ = TARGETS[proj]
            d_in, d_out = shapes[proj]
            linear = getattr(getattr(decoder.layers[layer], part), proj)
            linear.lora_a = zeros(("layers", layer, part, proj, "lora_a"), (d_in, num_slots * rank))
            linear.lora_b = zeros(("layers", layer, part, proj, "lora_b"), (num_slots * rank, d_out))
    decoder.lora_slots = num_slots
    decoder.lora_rank = rank


def factor_dtype(model_dtype: Any, platform: str) -> Any:
    """The factors' dtype: the model's, except float32 on the CPU, where XLA multiplies a
    bfloat16 row by a small matrix in a plain loop. SmolLM2's 30 layers of factors, one row
    (benchmarks/RESULTS.md): 4.8 ms in bfloat16 against 2.0 in float32 at one slot of rank 16,
    39 against 5.4 ms at four."""
    return jnp.float32 if platform == "cpu" else model_dtype


def slot_leaves(params: Any) -> dict[tuple[int, str, str], int]:
    """Where each LoRA factor is among `params`' leaves (jax.tree order, the steps' flat
    parameters): (layer, projection, "lora_a" | "lora_b") -> leaf index."""
    out = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if len(keys) >= 5 and keys[0] == "layers" and keys[-1] in ("lora_a", "lora_b"):
            out[(int(keys[1]), str(keys[3]), str(keys[-1]))] = i
    return out


def write_slot(leaves: list[Any], where: dict[tuple[int, str, str], int], slot: int, rank: int,
               factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]) -> None:
    """Write one adapter's factors (jaxserve.weights.lora_adapter.LoraAdapter.factors) into `slot`
    of the parameters' `leaves`, in place of the old arrays: its rank's columns of every a and
    rows of every b, zeros past its rank and on projections it does not adapt. New arrays, not
    donated ones: a step already dispatched still reads the old. All leaves in one jitted call:
    one dispatch per adapter, not one per factor (SmolLM2's 420 factors on this CPU: ~30 ms
    against ~45 ms one by one)."""
    indices, blocks, axes = [], [], []
    for (layer, proj, factor), index in where.items():
        old = leaves[index]
        axis = 1 if factor == "lora_a" else 0  # the rank's axis: a's columns, b's rows
        block = np.zeros(old.shape[:axis] + (rank,) + old.shape[axis + 1:], np.float32)
        value = factors.get((layer, proj), (None, None))[1 - axis]
        if value is not None:
            block[(slice(None),) * axis + (slice(0, value.shape[axis]),)] = value
        # Host data (every process of a multi-host job passes the same), not an array on one
        # device beside the global parameter.
        indices.append(index)
        blocks.append(np.asarray(block, old.dtype))
        axes.append(axis)
    writer = _writer(tuple(leaves[i].sharding for i in indices), tuple(axes))
    for index, new in zip(indices, writer(tuple(leaves[i] for i in indices), tuple(blocks), np.int32(slot * rank))):
        leaves[index] = new


@functools.lru_cache(maxsize=None)
def _writer(shardings: tuple[Any, ...], axes: tuple[int, ...]) -> Any:
    """A jitted write of one block into each array along its axis at `start`, keeping each
    array's own sharding (one program per model: its factors' shardings and axes)."""
    def write(arrays: tuple[Array, ...], blocks: tuple[Array, ...], start: Array) -> tuple[Array, ...]:
        return tuple(jax.lax.dynamic_update_slice(array, block, (0, start) if axis == 1 else (start, 0))
                     for array, block, axis in zip(arrays, blocks, axes))

    return jax.jit(write, out_shardings=shardings)


def token_mask(slots: Array, num_adapters: int, rank: int, dtype: Any) -> Array:
    """[..] adapter slots (-1: none) -> [.., S * rank] in `dtype`: ones on the slot's columns."""
    columns = jnp.arange(num_adapters * rank) // rank
    return (slots[..., None] == columns).astype(dtype)


def delta(x: Array, a: Array, b: Array, mask: Array) -> Array:
    """The adapters' addition to `x @ W`: ((x @ a) * mask) @ b, in the factors' dtype
    (`factor_dtype`), accumulated in float32."""
    h = jnp.einsum("...k,kr->...r", x.astype(a.dtype), a, preferred_element_type=jnp.float32)
    h = (h * mask.astype(jnp.float32)).astype(a.dtype)
    return jnp.einsum("...r,rn->...n", h, b, preferred_element_type=jnp.float32).astype(x.dtype)
