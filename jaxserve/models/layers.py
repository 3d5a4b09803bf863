"""Building blocks every model family shares: parameters, Linear, RMSNorm, and the layer loop.

Layers keep one parameter buffer each (a model's `layers` is an `nnx.List`), and `run_layers`
runs them as an unrolled loop inside the caller's jit, so every weight is read in place. The
alternative, weights stacked on a leading [num_layers] axis under `lax.scan`, made XLA on CPUs
and GPUs copy each layer's weights out of the stack on every step (on an H100 the Llama-3-8B
decode step ran at 3.3x its memory floor, its scratch exactly one layer's weights); every JAX
peer (tpu-inference, sglang-jax, MaxText for inference) keeps per-layer buffers for that reason.

Unrolling costs compile time: XLA compiles every layer. `run_layers` keeps the part JAX does per
layer to once per shape: each layer is called through one nested `jax.jit` whose arguments are
the layer's parameters, so JAX traces and lowers the layer body once per step shape and the
module calls it L times; XLA inlines the calls and optimises the unrolled whole (measured on
SmolLM2's 30 layers: cold compile 1.8x the scan's, warm start-up from the persistent cache 2.0x
instead of 3.0x with a plain Python loop; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import products

Array = jax.Array
Carry = TypeVar("Carry")


def zeros_param(*shape: int, dtype: Any) -> nnx.Param:
    # Weights always come from a checkpoint, so zeros is as good an initial value as any, and the
    # abstract (eval_shape) construction used by the loaders allocates nothing.
    return nnx.Param(jnp.zeros(shape, dtype))


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, bias: bool, dtype: Any):
        self.kernel = zeros_param(din, dout, dtype=dtype)  # [din, dout]
        self.bias = zeros_param(dout, dtype=dtype) if bias else None

    def __call__(self, x: Array, lora_mask: Array | None = None) -> Array:
        """lora_mask: each token's LoRA adapter columns (jaxserve.models.lora.token_mask), for a
        Linear that adapters target (`lora_a` / `lora_b`, set by attach_adapters); None: the base
        product only."""
        # The kernel's type picks the product (jaxserve.models.products): dense, or the CPU kernel's.
        y = products.linear(x, self.kernel.get_value())
        if self.bias is not None:
            y = y + self.bias[...]
        lora_a = getattr(self, "lora_a", None)
        if lora_a is not None and lora_mask is not None:
            from jaxserve.models import lora

            y = y + lora.delta(x, lora_a[...], self.lora_b[...], lora_mask)
        return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, offset: float, dtype: Any):
        self.weight = zeros_param(dim, dtype=dtype)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: Array) -> Array:
        # Normalise in float32 as HF does; Gemma scales by (1 + w) in float32, Llama casts back
        # before scaling by w. Matching the order matters for bfloat16 parity.
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * h.astype(x.dtype)


def activation(name: str) -> Callable[[Array], Array]:
    """An MLP's activation by its HF name (silu, gelu_pytorch_tanh, gelu)."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


LayerBody = Callable[[Any, Any, Any, Any], Any]  # (layer module, carry, shared, per_layer) -> carry


def run_layers(layers: Sequence[nnx.Module], body: LayerBody, carry: Carry, shared: Any,
               per_layer: Sequence[Any]) -> Carry:
    """`carry = body(layer, carry, shared, per_layer[i])` for every layer, unrolled, each layer's
    parameters read in place.

    `body` must be a module-level function (it keys JAX's trace cache); `shared` and `per_layer`
    entries are pytrees of arrays (anything static belongs in `body` or the layer's module). The
    weights' pytree types (jaxserve.models.products) are part of the key, so a layer traced with
    one kind of product is never reused for another."""
    if len(per_layer) != len(layers):
        raise ValueError(f"{len(per_layer)} per-layer inputs for {len(layers)} layers")
    for layer, extra in zip(layers, per_layer):
        graphdef, state = nnx.split(layer)
        carry = _call_layer(state, carry, shared, extra, body=body, graphdef=graphdef)
    return carry


@functools.partial(jax.jit, static_argnames=("body", "graphdef"))
def _call_layer(state: nnx.State, carry: Any, shared: Any, extra: Any, *, body: LayerBody,
                graphdef: nnx.GraphDef) -> Any:
    return body(nnx.merge(graphdef, state), carry, shared, extra)
