"""How the decoder multiplies activations by its weights: decided by each weight's pytree type,
as jax-llm-examples' `QuantArray` does, so a compiled step carries its choice in its arguments'
structure and nothing is read from a trace-time setting.

  a plain jax.Array        XLA's dot
  CpuWeight                a Linear kernel packed in strips for the native kernel
                           (`pallas_kernels.cpu_matmul`, backend "cpu"): bfloat16 weights
                           streamed ~2x faster than from the [K, N] layout at one row, and faster
                           than XLA:CPU's GEMM at every row count measured (to 512).
                           The LM head [N, K] (the embedding when tied) is packed the same way,
                           as the [K, N] kernel it multiplies by; embedding lookups read its
                           columns

A quantized weight type belongs here too, beside them. `place(params, backend)` gives the
weights of a parameter tree the type of a --matmul-backend.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

BACKENDS = ("xla", "cpu")


@struct.dataclass
class CpuWeight:
    """A bfloat16 Linear kernel [K, N] packed for the native CPU kernel: `cpu_matmul.pack`."""

    value: Array  # [ceil(N / 32), K, 32]
    n: int = struct.field(pytree_node=False)  # the kernel's N (the strips pad it to a multiple of 32)

    @classmethod
    def pack(cls, kernel: Array, transposed: bool = False) -> CpuWeight:
        """`kernel` [K, N], or [N, K] with `transposed` (an LM head: it multiplies as its transpose)."""
        return cls(_pack(kernel, transposed), int(kernel.shape[0 if transposed else 1]))


Weight = Array | CpuWeight


@functools.partial(jax.jit, static_argnums=1)
def _pack(kernel: Array, transposed: bool) -> Array:
    from pallas_kernels import cpu_matmul

    return cpu_matmul.pack(kernel.T if transposed else kernel)


def linear(x: Array, w: Weight) -> Array:
    """x [..., K] @ w [K, N] -> [..., N]."""
    if isinstance(w, CpuWeight):
        from pallas_kernels import cpu_matmul

        return cpu_matmul.matmul(x, w.value, w.n)
    return x @ w


def head(x: Array, w: Weight) -> Array:
    """x [..., K] @ w.T for w [N, K] (HF's head / embedding orientation) -> [..., N]."""
    if isinstance(w, CpuWeight):  # packed as the [K, N] transpose (place)
        return linear(x, w)
    return jnp.einsum("...h,vh->...v", x, w)


def rows(w: Weight, ids: Array) -> Array:
    """Rows `ids` of an embedding [N, K] (a lookup) -> [..., K]."""
    if isinstance(w, CpuWeight):  # packed as the [K, N] transpose: row i is column i, in strip i // 32
        from pallas_kernels import cpu_matmul

        return w.value[ids // cpu_matmul.STRIP, :, ids % cpu_matmul.STRIP]
    return jnp.take(w, ids, axis=0)


def place(params: Any, backend: str, head_path: tuple[str, ...] | None = None, *, consume: bool = False) -> Any:
    """`params` (an nnx.State) with every Linear kernel (and the LM head at `head_path`: the
    embedding when it is tied) typed for `backend`. The "cpu" backend repacks the Linear kernels;
    with `consume` each original buffer is freed as soon as its packed copy exists, so start-up
    holds one extra weight at a time, not a second model (the caller's arrays are then gone)."""
    if backend == "xla":
        return params
    if backend != "cpu":
        raise ValueError(f"unknown matmul backend {backend!r}; expected one of {BACKENDS}")

    def wrap(path: tuple, leaf: Any) -> Any:
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))  # the parameter's names
        if keys == head_path or keys[-1] == "kernel":
            # The head [N, K] multiplies as its transpose, so it packs as that [K, N] kernel.
            packed = CpuWeight.pack(leaf, transposed=keys == head_path)
            if consume:
                jax.block_until_ready(packed.value)
                leaf.delete()
            return packed
        return leaf

    return jax.tree_util.tree_map_with_path(wrap, params)


def describe_backend(name: str) -> str:
    """One line for the start-up log."""
    if name == "cpu":
        return "cpu (native kernel, pallas_kernels/cpu_matmul.cc: bfloat16 weights packed in strips)"
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
