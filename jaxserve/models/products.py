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
  Int8Weight               --quantization int8 on XLA (GPU, TPU, or the CPU without the kernel):
                           int8 values and a float32 scale per output channel; the convert
                           feeds the dot, so a step reads one byte per weight
  CpuInt8Weight            --quantization int8 with the native kernel: the int8 values packed in
                           strips as CpuWeight's, and the scales

Quantization rule (int8): every Linear kernel, and the LM head (the embedding when tied), per
output channel (a kernel's column, a head's vocabulary row), symmetric, scale = max |w| / 127. An
embedding table that is not the head stays in the model's dtype: a step looks up a few of its
rows, so its bytes do not count; a tied one is looked up from the int8 head, dequantized.
`place(params, backend, quantization=...)` gives the weights of a parameter tree their type.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

BACKENDS = ("xla", "cpu")
QUANTIZATIONS = ("none", "int8")


@struct.dataclass
class CpuWeight:
    """A bfloat16 Linear kernel [K, N] packed for the native CPU kernel: `cpu_matmul.pack`."""

    value: Array  # [ceil(N / 32), K, 32]
    n: int = struct.field(pytree_node=False)  # the kernel's N (the strips pad it to a multiple of 32)

    @classmethod
    def pack(cls, kernel: Array, transposed: bool = False) -> CpuWeight:
        """`kernel` [K, N], or [N, K] with `transposed` (an LM head: it multiplies as its transpose)."""
        return cls(_pack(kernel, transposed), int(kernel.shape[0 if transposed else 1]))


@struct.dataclass
class Int8Weight:
    """A weight quantized per output channel: w ~= q * scale along the output axis, which is the
    last axis of a Linear kernel [K, N] and the first of a head [N, K] (`head=True`)."""

    q: Array  # int8, the weight's shape
    scale: Array  # [N] float32
    head: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def quantize(cls, w: Array, head: bool = False) -> Int8Weight:
        q, scale = _quantize(w, head)
        return cls(q, scale, head)


@struct.dataclass
class CpuInt8Weight:
    """An int8 Linear kernel [K, N] packed for the native kernel, with its per-column scales."""

    value: Array  # [ceil(N / 32), K, 32] int8
    scale: Array  # [N] float32
    n: int = struct.field(pytree_node=False)

    @classmethod
    def quantize(cls, kernel: Array, transposed: bool = False) -> CpuInt8Weight:
        """`kernel` [K, N], or [N, K] with `transposed` (an LM head), quantized per output channel."""
        q, scale = _quantize(kernel.T if transposed else kernel, False)
        return cls(_pack(q, False), scale, int(q.shape[1]))


Weight = Array | CpuWeight | Int8Weight | CpuInt8Weight


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w: Array, head: bool) -> tuple[Array, Array]:
    from pallas_kernels import cpu_matmul

    q, scale = cpu_matmul.quantize_int8(w.T if head else w)
    return (q.T if head else q), scale


@functools.partial(jax.jit, static_argnums=1)
def _pack(kernel: Array, transposed: bool) -> Array:
    from pallas_kernels import cpu_matmul

    return cpu_matmul.pack(kernel.T if transposed else kernel)


def linear(x: Array, w: Weight) -> Array:
    """x [..., K] @ w [K, N] -> [..., N]."""
    if isinstance(w, CpuWeight):
        from pallas_kernels import cpu_matmul

        return cpu_matmul.matmul(x, w.value, w.n)
    if isinstance(w, CpuInt8Weight):
        from pallas_kernels import cpu_matmul

        return cpu_matmul.matmul_int8(x, w.value, w.scale, w.n)
    if isinstance(w, Int8Weight):
        return _int8_dot("...k,kn->...n", x, w)
    return x @ w


def head(x: Array, w: Weight) -> Array:
    """x [..., K] @ w.T for w [N, K] (HF's head / embedding orientation) -> [..., N]."""
    if isinstance(w, (CpuWeight, CpuInt8Weight)):  # packed as the [K, N] transpose (place)
        return linear(x, w)
    if isinstance(w, Int8Weight):
        return _int8_dot("...h,vh->...v", x, w)
    return jnp.einsum("...h,vh->...v", x, w)


def _int8_dot(spec: str, x: Array, w: Int8Weight) -> Array:
    """x times an Int8Weight on XLA: the int8 -> activation-dtype convert feeds the dot (XLA fuses
    it into the operand read); the scale multiplies the float32 result, once per output."""
    out = jnp.einsum(spec, x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (out * w.scale).astype(x.dtype)


def rows(w: Weight, ids: Array, dtype: Any = None) -> Array:
    """Rows `ids` of an embedding [N, K] (a lookup) -> [..., K]; a quantized table's rows come
    back dequantized, in `dtype` (the model's)."""
    if isinstance(w, CpuWeight):  # packed as the [K, N] transpose: row i is column i, in strip i // 32
        from pallas_kernels import cpu_matmul

        return w.value[ids // cpu_matmul.STRIP, :, ids % cpu_matmul.STRIP]
    if isinstance(w, CpuInt8Weight):
        from pallas_kernels import cpu_matmul

        q = w.value[ids // cpu_matmul.STRIP, :, ids % cpu_matmul.STRIP]
        return (q.astype(jnp.float32) * w.scale[ids][..., None]).astype(dtype)
    if isinstance(w, Int8Weight):
        return (jnp.take(w.q, ids, axis=0).astype(jnp.float32) * w.scale[ids][..., None]).astype(dtype)
    return jnp.take(w, ids, axis=0)


def place(params: Any, backend: str, head_path: tuple[str, ...] | None = None, *, quantization: str = "none",
          consume: bool = False) -> Any:
    """`params` (an nnx.State) with every Linear kernel (and the LM head at `head_path`: the
    embedding when it is tied) typed for `backend` and `quantization`. The "cpu" backend repacks
    the Linear kernels; int8 quantizes them (the module doc's rule). With `consume` each original
    buffer is freed as soon as its new form exists, so start-up holds one extra weight at a time,
    not a second model (the caller's arrays are then gone)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown matmul backend {backend!r}; expected one of {BACKENDS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")
    if backend == "xla" and quantization == "none":
        return params

    def wrap(path: tuple, leaf: Any) -> Any:
        kind = _product_weight(path, head_path)
        if kind is None:
            return leaf
        is_head = kind == "head"
        if backend == "cpu":
            # The head [N, K] multiplies as its transpose, so it packs as that [K, N] kernel.
            new: Any = (CpuWeight.pack(leaf, transposed=is_head) if quantization == "none"
                        else CpuInt8Weight.quantize(leaf, transposed=is_head))
        else:
            new = Int8Weight.quantize(leaf, head=is_head)
        if consume:
            jax.block_until_ready(new)
            leaf.delete()
        return new

    return jax.tree_util.tree_map_with_path(wrap, params)


def _product_weight(path: tuple, head_path: tuple[str, ...] | None) -> str | None:
    """"head" for the LM head, "kernel" for a Linear kernel, None for a parameter that multiplies
    nothing (norms, biases, an untied embedding)."""
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))  # the parameter's names
    if keys == head_path:
        return "head"
    return "kernel" if keys[-1] == "kernel" else None


def abstract_place(params: Any, head_path: tuple[str, ...] | None, quantization: str) -> Any:
    """`place` on the XLA backend for a tree of sharded ShapeDtypeStructs (jaxserve.plan): an int8
    weight keeps its weight's sharding, and its scales follow the output axis's."""
    if quantization == "none":
        return params
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")

    def wrap(path: tuple, leaf: Any) -> Any:
        kind = _product_weight(path, head_path)
        if kind is None:
            return leaf
        is_head = kind == "head"
        axis = 0 if is_head else 1
        spec = tuple(leaf.sharding.spec) + (None,) * (2 - len(leaf.sharding.spec))
        scale_sharding = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec(spec[axis]))
        return Int8Weight(jax.ShapeDtypeStruct(leaf.shape, jnp.int8, sharding=leaf.sharding),
                          jax.ShapeDtypeStruct((leaf.shape[axis],), jnp.float32, sharding=scale_sharding), is_head)

    return jax.tree_util.tree_map_with_path(wrap, params)


def resolve_quantization(name: str) -> str:
    """--quantization: none or int8 as asked; auto is none (a GGUF's 4-bit blocks are dequantized
    until a 4-bit kernel exists: auto never changes what the checkpoint's values are)."""
    if name == "auto":
        return "none"
    if name not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of auto, {', '.join(QUANTIZATIONS)}; got {name!r}")
    return name


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
