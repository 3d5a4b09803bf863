"""How the decoder multiplies activations by its weights: decided by each weight's pytree type,
as jax-llm-examples' `QuantArray` does, so a compiled step carries its choice in its arguments'
structure and nothing is read from a trace-time setting.

  a plain jax.Array        XLA's dot
  CpuWeight                the native small-batch kernel (`pallas_kernels.cpu_matmul`, backend
                           "cpu"): bfloat16 weights streamed much faster than XLA:CPU's dot at
                           decode batch sizes; XLA's dot where the kernel does not cover the
                           product (prefill-sized rows)

A quantized weight type belongs here too, beside them. `place(params, backend)` gives the
weights of a parameter tree the type of a --matmul-backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

BACKENDS = ("xla", "cpu")


@struct.dataclass
class CpuWeight:
    """A bfloat16 weight multiplied by the native CPU kernel where it covers the product."""

    value: Array


Weight = Array | CpuWeight


def linear(x: Array, w: Weight) -> Array:
    """x [..., K] @ w [K, N] -> [..., N]."""
    if isinstance(w, CpuWeight):
        from pallas_kernels import cpu_matmul

        return cpu_matmul.matmul(x, w.value)
    return x @ w


def head(x: Array, w: Weight) -> Array:
    """x [..., K] @ w.T for w [N, K] (HF's head / embedding orientation) -> [..., N]."""
    if isinstance(w, CpuWeight):
        from pallas_kernels import cpu_matmul

        return cpu_matmul.matmul_transposed(x, w.value)
    return jnp.einsum("...h,vh->...v", x, w)


def array(w: Weight) -> Array:
    """The weight's values as one array (an embedding lookup reads rows of it)."""
    return w.value if isinstance(w, CpuWeight) else w


def place(params: Any, backend: str, head_path: tuple[str, ...] | None = None) -> Any:
    """`params` (an nnx.State) with every Linear kernel (and the LM head at `head_path`: the
    embedding when it is tied) typed for `backend`."""
    if backend == "xla":
        return params
    if backend != "cpu":
        raise ValueError(f"unknown matmul backend {backend!r}; expected one of {BACKENDS}")

    def wrap(path: tuple, leaf: Any) -> Any:
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))  # the parameter's names
        if keys[-1] == "kernel" or keys == head_path:
            return CpuWeight(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(wrap, params)


def describe_backend(name: str) -> str:
    """One line for the start-up log."""
    if name == "cpu":
        from pallas_kernels import cpu_matmul

        return (f"cpu (native kernel, pallas_kernels/cpu_matmul.cc: bfloat16, up to {cpu_matmul.MAX_ROWS} rows; "
                "XLA's dot above)")
    return "xla (XLA's dot)"


def resolve_backend(name: str, dtype: object, platform: str | None = None, tensor_parallel: int = 1) -> str:
    """The concrete backend ("xla" or "cpu") of a --matmul-backend choice for a model of `dtype` on
    `platform` (default: jax's default backend). "cpu" is built here, so a missing compiler or
    instruction set fails at start-up, not at the first step."""
    platform = platform or jax.default_backend()
    if name == "xla":
        return name
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"--matmul-backend cpu runs on the CPU only, not on {platform}")
        if tensor_parallel > 1:
            raise ValueError(f"--matmul-backend cpu does not shard over devices; use xla with "
                             f"--tensor-parallel-size {tensor_parallel}")
        if jnp.dtype(dtype) != jnp.bfloat16:
            raise ValueError(f"--matmul-backend cpu multiplies bfloat16 weights; this model runs in "
                             f"{jnp.dtype(dtype).name} (use --dtype bfloat16, or xla)")
        from pallas_kernels import cpu_matmul

        if not cpu_matmul.ensure_built():
            raise ValueError("--matmul-backend cpu needs AVX512-BF16 (Zen 4, Sapphire Rapids or later); "
                             "this CPU lacks it")
        return name
    if name == "auto":
        # The kernel computes bfloat16 only, and (like the CPU attention kernel) has no sharding rule.
        if platform != "cpu" or tensor_parallel > 1 or jnp.dtype(dtype) != jnp.bfloat16:
            return "xla"
        from pallas_kernels import cpu_matmul

        return "cpu" if cpu_matmul.available() else "xla"
    raise ValueError(f"matmul backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
