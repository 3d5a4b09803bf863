"""LoRA adapters served beside the base model, any mix of them in one batch (multi-LoRA, as
vLLM's punica kernels and SGLang's S-LoRA batching do).

Every adapter the server loads has a slot: a targeted projection's Linear holds `lora_a`
[in, S * r] and `lora_b` [S * r, out], the S adapters' factors side by side, each padded with
zeros to the rank r (jaxserve.weights.lora_adapter.stack_adapters), the scale folded into b.
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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.weights.lora_adapter import TARGETS, LoraAdapter, stack_adapters

Array = jax.Array


def target_shapes(decoder: Any) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) in `decoder`."""
    layer = decoder.layers[0]
    return {proj: tuple(getattr(getattr(layer, part), proj).kernel.get_value().shape)  # type: ignore[misc]
            for proj, (part, _) in TARGETS.items()}


def attach_adapters(decoder: Any, adapters: list[LoraAdapter], rank: int) -> None:
    """Give `decoder`'s projections the adapters' stacked factors, in its dtype and (under tensor
    parallelism) its parameters' mesh; `decoder.lora_names` then names the slots in order."""
    from jaxserve.parallel import ShardingPlan, mesh_of

    if not adapters:
        return
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA adapter names must be unique, got {names}")
    cfg = decoder.cfg
    mesh = mesh_of(nnx.state(decoder))
    plan = ShardingPlan(mesh, cfg) if mesh is not None else None
    stacked = stack_adapters(adapters, rank, cfg.num_layers, target_shapes(decoder))

    def place(path: tuple, value: np.ndarray) -> nnx.Param:
        array = jnp.asarray(value, decoder.dtype)
        if plan is not None:
            array = jax.device_put(array, plan.param_sharding(path, value.shape))
        return nnx.Param(array)

    for (layer, proj), (a, b) in stacked.items():
        part, _ = TARGETS[proj]
        linear = getattr(getattr(decoder.layers[layer], part), proj)
        linear.lora_a = place(("layers", layer, part, proj, "lora_a"), a)
        linear.lora_b = place(("layers", layer, part, proj, "lora_b"), b)
    decoder.lora_names = tuple(names)
    decoder.lora_rank = rank


def token_mask(slots: Array, num_adapters: int, rank: int, dtype: Any) -> Array:
    """[..] adapter slots (-1: none) -> [.., S * rank] in `dtype`: ones on the slot's columns."""
    columns = jnp.arange(num_adapters * rank) // rank
    return (slots[..., None] == columns).astype(dtype)


def delta(x: Array, a: Array, b: Array, mask: Array) -> Array:
    """The adapters' addition to `x @ W`: ((x @ a) * mask) @ b, accumulated in float32."""
    h = jnp.einsum("...k,kr->...r", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    h = (h * mask.astype(jnp.float32)).astype(x.dtype)
    return jnp.einsum("...r,rn->...n", h, b.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
