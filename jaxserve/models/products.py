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
  GroupWeight              block-quantized (groups of G rows along K, each with a scale and, for
                           4-bit values, a minimum) on XLA: --quantization int4, and a GGUF's
                           blocks kept as they are (--quantization gguf on GPU / TPU)
  CpuGroupWeight           the same with the native kernel (`pallas_kernels.cpu_qmatmul`), the
                           values and scales packed in strips
  ExpertInt8Weight         a mixture of experts' stacked kernels under --quantization int8
                           (jaxserve.models.moe's grouped products read them; on any backend)

Quantization rule (int8): every Linear kernel, and the LM head (the embedding when tied), per
output channel (a kernel's column, a head's vocabulary row), symmetric, scale = max |w| / 127. An
embedding table that is not the head stays in the model's dtype: a step looks up a few of its
rows, so its bytes do not count; a tied one is looked up from the int8 head, dequantized. A
mixture of experts' stacked kernels per expert and output channel (ExpertInt8Weight).

Quantization rule (int4): every Linear kernel to 4-bit values in groups of `group` rows (32, 64 or
128) along K, asymmetric (w ~= q * d + mn, q in 0..15, d and mn float16 per group and column);
the LM head as int8 (per output channel, as above): the head is the product most sensitive to its
weights' precision, and llama.cpp's 4-bit files keep it at 8 (Q8_0) or 6 bits for the same reason.

GGUF blocks ("gguf": --quantization gguf, and auto on the CPU with the native kernel): each Linear
kernel and the head take the file's own blocks where a kernel reads that format (Q4_0 and Q4_1 as
4-bit groups of 32, Q4_0's minimum being -8 d; Q8_0 as 8-bit groups of 32; Q4_K as 4-bit groups of
32 and Q6_K as 8-bit groups of 16, both with float32 scales), losslessly; float tensors stay float.
Other block types run dequantized under auto and are refused under gguf
(jaxserve.weights.loader.stored_blocks).

`place(params, backend, quantization=...)` gives the weights of a parameter tree their type.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jax.Array

BACKENDS = ("xla", "cpu")
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
GROUP_SIZES = (32, 64, 128)  # --quantization-group-size: int4's rows per group


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
class ExpertInt8Weight:
    """A mixture of experts' stacked kernels [experts, K, N] (jaxserve.models.moe) under
    --quantization int8: int8 values and a float32 scale per expert and output channel, w ~=
    q * scale[expert, column]. The grouped products read the int8 values (XLA:TPU's ragged dot
    and the GPU kernel take them as they are) and scale each row's result by its expert's
    scales."""

    q: Array  # int8 [experts, K, N]
    scale: Array  # float32 [experts, N]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @classmethod
    def quantize(cls, w: Array) -> ExpertInt8Weight:
        return cls(*_quantize_experts(w))


@jax.jit
def _quantize_experts(w: Array) -> tuple[Array, Array]:
    """Symmetric int8 per expert and output channel: scale = max |w| over K / 127."""
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=1) / 127.0  # [experts, N]
    safe = jnp.where(scale == 0, 1.0, scale)
    return jnp.clip(jnp.round(w / safe[:, None, :]), -127, 127).astype(jnp.int8), scale


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


@struct.dataclass
class Blocks:
    """A weight [K, N] in groups of G rows along K on the host, as a checkpoint or `quantize`
    gives it: values q [K, N] (uint8 0..15 for 4 bits, int8 for 8), scales d [K / G, N] float16
    (float32 for GGUF K-quants), minima mn [K / G, N] likewise for 4 bits (None for 8: symmetric).
    Not a step's weight: `GroupWeight.of` / `CpuGroupWeight.of` place it."""

    q: Any
    d: Any
    mn: Any
    bits: int = struct.field(pytree_node=False)

    @classmethod
    def quantize_int4(cls, kernel: Array, group: int) -> Blocks:
        q, d, mn = _quantize_q4(kernel, group)
        return cls(q, d, mn, 4)


@struct.dataclass
class GroupWeight:
    """Blocks on XLA: the values as uint4 (4 bits) or int8, the [K, N] orientation also for a head
    (whose weight is [N, K]: it is stored transposed)."""

    q: Array  # [K, N] uint4 | int8
    d: Array  # [K / G, N] float16 | float32
    mn: Array | None  # [K / G, N] as d, 4 bits only

    @classmethod
    def of(cls, b: Blocks, sharding: Any = None) -> GroupWeight:
        """`b` on the devices of `sharding` (the [K, N] weight's: TP splits the values and their
        scales together; scales with fewer groups than shards along K stay whole on that axis)."""
        def put(a: Any, dtype: Any) -> Array:
            a = jnp.asarray(a).astype(dtype)
            return a if sharding is None else jax.device_put(a, _divisible(sharding, a.shape))

        scale = jnp.float32 if jnp.asarray(b.d).dtype == jnp.float32 else jnp.float16
        return cls(put(b.q, jnp.uint4 if b.bits == 4 else jnp.int8), put(b.d, scale),
                   None if b.mn is None else put(b.mn, scale))


@struct.dataclass
class CpuGroupWeight:
    """Blocks packed for the native kernel: `cpu_qmatmul.pack_q4` / `pack_q8` and `pack_scales`."""

    value: Array  # [ceil(N / 32), K / 2, 32] uint8 (4 bits) | [ceil(N / 32), K, 32] int8
    scales: Array  # [ceil(N / 32), K / G, R, 32] float16 | float32
    n: int = struct.field(pytree_node=False)

    @classmethod
    def of(cls, b: Blocks) -> CpuGroupWeight:
        value, scales = _pack_blocks(jnp.asarray(b.q), jnp.asarray(b.d), None if b.mn is None else jnp.asarray(b.mn))
        return cls(value, scales, int(b.q.shape[1]))


Weight = Array | CpuWeight | Int8Weight | CpuInt8Weight | GroupWeight | CpuGroupWeight


@functools.partial(jax.jit, static_argnums=1)
def _quantize_q4(kernel: Array, group: int) -> tuple[Array, Array, Array]:
    from pallas_kernels import cpu_qmatmul

    return cpu_qmatmul.quantize_q4(kernel, group)


@jax.jit
def _pack_blocks(q: Array, d: Array, mn: Array | None) -> tuple[Array, Array]:
    from pallas_kernels import cpu_qmatmul

    value = cpu_qmatmul.pack_q8(q) if mn is None else cpu_qmatmul.pack_q4(q)
    return value, cpu_qmatmul.pack_scales(d, mn)


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
    if isinstance(w, CpuGroupWeight):
        from pallas_kernels import cpu_qmatmul

        if w.value.dtype == jnp.uint8:
            return cpu_qmatmul.matmul_q4(x, w.value, w.scales, w.n)
        return cpu_qmatmul.matmul_q8(x, w.value, w.scales, w.n)
    if isinstance(w, GroupWeight):
        return _group_dot(x, w)
    return x @ w


def _group_dot(x: Array, w: GroupWeight) -> Array:
    """x times a GroupWeight on XLA: the weight dequantized in x's dtype as [groups, G, N] feeds a dot
    contracting both of its first axes (float32 sums, one rounding). A correctness path, not a fast
    one: the deviceless TPU compile still writes the dequantized weight out (Llama-3-8B decode on
    v6e: 42.8 GB a step, 59.5 with a reshape to [K, N] in between; bf16 16.5), so the server keeps
    blocks on XLA only when asked (--quantization int4 / gguf), with a warning."""
    groups = w.d.shape[0]
    k, n = w.q.shape
    q = w.q.reshape(groups, k // groups, n)
    weight = q.astype(x.dtype) * w.d.astype(x.dtype)[:, None]
    if w.mn is not None:
        weight = weight + w.mn.astype(x.dtype)[:, None]
    xg = x.reshape(*x.shape[:-1], groups, k // groups)
    return jnp.einsum("...gk,gkn->...n", xg, weight, preferred_element_type=jnp.float32).astype(x.dtype)


def head(x: Array, w: Weight) -> Array:
    """x [..., K] @ w.T for w [N, K] (HF's head / embedding orientation) -> [..., N]."""
    if isinstance(w, (CpuWeight, CpuInt8Weight, CpuGroupWeight, GroupWeight)):  # as the [K, N] transpose (place)
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
    if isinstance(w, CpuGroupWeight):
        from pallas_kernels import cpu_qmatmul

        if w.value.dtype == jnp.uint8:
            q = cpu_qmatmul.row_values_q4(w.value, ids)
        else:
            q = w.value[ids // cpu_qmatmul.STRIP, :, ids % cpu_qmatmul.STRIP]
        d, mn = cpu_qmatmul.row_scales(w.scales, ids)
        return _dequantized_rows(q, d, mn).astype(dtype)
    if isinstance(w, GroupWeight):  # [K, N]: row i of the head is column i
        q = jnp.take(w.q, ids, axis=1)  # [K, ...]
        q = jnp.moveaxis(q, 0, -1)
        d = jnp.moveaxis(jnp.take(w.d, ids, axis=1), 0, -1)
        mn = None if w.mn is None else jnp.moveaxis(jnp.take(w.mn, ids, axis=1), 0, -1)
        return _dequantized_rows(q, d, mn).astype(dtype)
    return jnp.take(w, ids, axis=0)


def _dequantized_rows(q: Array, d: Array, mn: Array | None) -> Array:
    """Rows q [..., K] with group scales d (and minima mn) [..., K / G] -> float32 [..., K]."""
    groups = d.shape[-1]
    g = q.astype(jnp.float32).reshape(*q.shape[:-1], groups, -1) * d.astype(jnp.float32)[..., None]
    if mn is not None:
        g = g + mn.astype(jnp.float32)[..., None]
    return g.reshape(q.shape)


def place(params: Any, backend: str, head_path: tuple[str, ...] | None = None, *, quantization: str = "none",
          group: int = 32, blocks: Callable[[tuple], Blocks | None] | None = None, consume: bool = False) -> Any:
    """`params` (an nnx.State) with every Linear kernel (and the LM head at `head_path`: the
    embedding when it is tied) typed for `backend` and `quantization`. The "cpu" backend repacks
    the Linear kernels; int8 and int4 (in groups of `group` rows) quantize them, and "gguf" takes
    each one's stored blocks from `blocks` (a parameter path such as ("layers", 0, "mlp",
    "down_proj", "kernel") -> its Blocks in the [K, N] orientation, None for a float tensor), by the
    module doc's rules. With `consume` each original buffer is freed as soon as its new form
    exists, so start-up holds one extra weight at a time, not a second model (the caller's arrays
    are then gone)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown matmul backend {backend!r}; expected one of {BACKENDS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")
    if quantization == "gguf" and blocks is None:
        raise ValueError("quantization gguf needs the checkpoint's blocks")
    if backend == "xla" and quantization == "none":
        return params

    def wrap(path: tuple, leaf: Any) -> Any:
        kind = _product_weight(path, head_path)
        if kind is None and quantization == "int8" and _expert_kernel(path):
            new = ExpertInt8Weight.quantize(leaf)
            if consume:
                jax.block_until_ready(new)
                leaf.delete()
            return new
        if kind is None:
            return leaf
        is_head = kind == "head"
        stored = None
        if quantization == "gguf":
            stored = blocks(_keys(path))  # type: ignore[misc]
        elif quantization == "int4" and not is_head:
            _check_whole_groups(path, leaf.shape[0], group)
            stored = Blocks.quantize_int4(leaf, group)
        if stored is not None:
            new: Any = CpuGroupWeight.of(stored) if backend == "cpu" else GroupWeight.of(stored, _kn_sharding(leaf, is_head))
        else:
            int8 = quantization == "int8" or (quantization == "int4" and is_head)
            if backend == "cpu":
                # The head [N, K] multiplies as its transpose, so it packs as that [K, N] kernel.
                new = CpuInt8Weight.quantize(leaf, transposed=is_head) if int8 else CpuWeight.pack(leaf, transposed=is_head)
            else:
                new = Int8Weight.quantize(leaf, head=is_head) if int8 else leaf
        if consume and new is not leaf and isinstance(leaf, jax.Array):  # not an abstract leaf (kept blocks)
            jax.block_until_ready(new)
            leaf.delete()
        return new

    return jax.tree_util.tree_map_with_path(wrap, params)


def _expert_kernel(path: tuple) -> bool:
    """Whether a parameter is a mixture of experts' stacked kernel [experts, K, N]."""
    keys = _keys(path)
    return keys[-1] == "kernel" and "experts" in keys


def _keys(path: tuple) -> tuple:
    """A parameter's path as names and layer indices (the loader's ParamPath)."""
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _check_whole_groups(path: tuple, k: int, group: int) -> None:
    """int4 needs a kernel's K input features to be whole groups; the error names the kernel."""
    if k % group:
        raise ValueError(f"--quantization int4: {'.'.join(map(str, _keys(path)))} has {k} input features, not a "
                         f"whole number of groups of {group} (--quantization-group-size)")


def _kn_sharding(leaf: Any, is_head: bool) -> Any:
    """The sharding of a weight's [K, N] form: the kernel's own, or a head [N, K]'s transposed."""
    sharding = leaf.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding) or not is_head:
        return sharding
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[1], spec[0]))


def _divisible(sharding: Any, shape: tuple[int, ...]) -> Any:
    """`sharding` without the mesh axes that do not divide their dimension of `shape`."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))

    def size(axes: Any) -> int:
        names = axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([mesh.shape[a] for a in names if a is not None]))

    kept = tuple(a if a is None or dim % size(a) == 0 else None for a, dim in zip(spec, shape))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*kept))


def _product_weight(path: tuple, head_path: tuple[str, ...] | None) -> str | None:
    """"head" for the LM head, "kernel" for a Linear kernel, None for a parameter that multiplies
    nothing (norms, biases, an untied embedding) or not as a Linear: a mixture of experts' stacked
    kernels (jaxserve.models.moe, ExpertInt8Weight under int8) and its routers, which stay in the
    model's dtype (as vLLM keeps them: a router's logits pick the experts, and a quantized router
    picks others; its [hidden, experts] weights are a sliver of the step's bytes)."""
    keys = _keys(path)
    if keys == head_path:
        return "head"
    router = len(keys) >= 3 and keys[-3] == "mlp" and keys[-2] in ("gate", "shared_expert_gate")
    return "kernel" if keys[-1] == "kernel" and "experts" not in keys and not router else None


def abstract_place(params: Any, head_path: tuple[str, ...] | None, quantization: str, group: int = 32) -> Any:
    """`place` on the XLA backend for a tree of sharded ShapeDtypeStructs (jaxserve.plan): an int8
    weight keeps its weight's sharding, and its scales follow the output axis's; an int4 weight
    (GroupWeight, [K, N]) keeps the kernel's sharding, its group scales and minima too."""
    if quantization == "none":
        return params
    if quantization not in ("int8", "int4"):
        raise ValueError(f"abstract_place: quantization must be none, int8 or int4, not {quantization!r}")

    def wrap(path: tuple, leaf: Any) -> Any:
        kind = _product_weight(path, head_path)
        if kind is None and quantization == "int8" and _expert_kernel(path):
            spec = tuple(leaf.sharding.spec) + (None,) * (3 - len(leaf.sharding.spec))
            scales = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec(spec[0], spec[2]))
            return ExpertInt8Weight(jax.ShapeDtypeStruct(leaf.shape, jnp.int8, sharding=leaf.sharding),
                                    jax.ShapeDtypeStruct((leaf.shape[0], leaf.shape[2]), jnp.float32, sharding=scales))
        if kind is None:
            return leaf
        is_head = kind == "head"
        spec = tuple(leaf.sharding.spec) + (None,) * (2 - len(leaf.sharding.spec))
        named = functools.partial(jax.sharding.NamedSharding, leaf.sharding.mesh)
        if quantization == "int4" and not is_head:
            k, n = leaf.shape
            _check_whole_groups(path, k, group)
            scales = jax.ShapeDtypeStruct((k // group, n), jnp.float16, sharding=_divisible(leaf.sharding, (k // group, n)))
            return GroupWeight(jax.ShapeDtypeStruct(leaf.shape, jnp.uint4, sharding=leaf.sharding), scales, scales)
        axis = 0 if is_head else 1
        scale_sharding = named(jax.sharding.PartitionSpec(spec[axis]))
        return Int8Weight(jax.ShapeDtypeStruct(leaf.shape, jnp.int8, sharding=leaf.sharding),
                          jax.ShapeDtypeStruct((leaf.shape[axis],), jnp.float32, sharding=scale_sharding), is_head)

    return jax.tree_util.tree_map_with_path(wrap, params)


def resolve_quantization(name: str, gguf_blocks: bool = False) -> str:
    """--quantization: none, int8 or int4 as asked; auto and gguf keep a GGUF's blocks where the
    loader kept them (`gguf_blocks`), else none (a float GGUF, or auto where no kernel reads them)."""
    if name in ("auto", "gguf"):
        return "gguf" if gguf_blocks else "none"
    if name not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of auto, {', '.join(QUANTIZATIONS)}; got {name!r}")
    return name


def check_quantization_for(cfg: Any, quantization: str) -> None:
    """Refuse --quantization int4 for a mixture-of-experts model: its experts (nearly all of its
    weights) have no 4-bit form yet, and quantizing only the rest would be a quiet half. int8
    quantizes the experts too (ExpertInt8Weight)."""
    if getattr(cfg, "moe", None) is not None and quantization == "int4":
        raise ValueError(f"--quantization int4 is not supported for {cfg.architecture} (a mixture of experts): "
                         "its experts have no 4-bit form yet; pass --quantization int8 (experts included) or none")


def check_group_size(group: int) -> None:
    """--quantization-group-size: one of GROUP_SIZES."""
    if group not in GROUP_SIZES:
        raise ValueError(f"--quantization-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group!r}")


def check_int4_shapes(cfg: Any, group: int) -> None:
    """int4 needs every Linear kernel's input features (hidden size, attention width, MLP width) to
    be whole groups: checked from the config before any weight is repacked."""
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_heads x head_dim": cfg.num_heads * cfg.head_dim}
    bad = {k: v for k, v in widths.items() if v % group}
    if bad:
        raise ValueError(f"--quantization int4: {', '.join(f'{k} {v}' for k, v in bad.items())} is no whole number "
                         f"of groups of {group}; pass a --quantization-group-size that divides it "
                         f"({', '.join(str(g) for g in GROUP_SIZES if all(v % g == 0 for v in widths.values())) or 'none does'})")


def bfloat16_runs_fast(matmul_backend: str, tensor_parallel: int = 1, platform: str | None = None) -> bool:
    """Whether a generation model's steps run fast in bfloat16 on this CPU (what --dtype auto
    decides there): its products go to the native kernel (one device, --matmul-backend auto or
    cpu, the kernel built for AVX512-BF16 or AVX2 + FMA), or the CPU has bfloat16 dot instructions
    that XLA's own products use. Elsewhere (AVX2 with --matmul-backend xla, say) XLA:CPU emulates
    bfloat16 products, slower than float32. True off the CPU (resolve_dtype ignores it there)."""
    from jaxserve.weights.loader import cpu_has_native_bf16

    platform = platform or jax.default_backend()
    if platform != "cpu" or cpu_has_native_bf16():
        return True
    # Where auto would run a bfloat16 model's products on the kernel, cpu would too (it refuses
    # the other cases at start-up); xla never does.
    return matmul_backend != "xla" and resolve_backend("auto", jnp.bfloat16, platform, tensor_parallel) == "cpu"


def keeps_gguf_blocks(matmul_backend: str, tensor_parallel: int = 1, platform: str | None = None) -> bool:
    """Whether --quantization auto keeps a GGUF's blocks for this run: where the native CPU kernel
    reads them (one device, --matmul-backend auto or cpu; the loader also wants the model in
    bfloat16, once --dtype is resolved: jaxserve.weights.loader.load_model). XLA's dot on GPUs
    and TPUs has no fused block-dequantizing product yet (the deviceless TPU compile of Llama-3-8B
    writes the dequantized weights out: 2.6x the bfloat16 step's bytes, benchmarks/RESULTS.md), so
    there auto dequantizes the blocks at load, as --quantization none does."""
    platform = platform or jax.default_backend()
    if platform != "cpu" or tensor_parallel > 1 or matmul_backend == "xla":
        return False
    from pallas_kernels import cpu_qmatmul

    return cpu_qmatmul.available()


def describe_quantization(name: str, group: int) -> str:
    """The start-up log's words for a resolved quantization ("" for none)."""
    return {"none": "", "int8": ", weights quantized to int8 per output channel",
            "int4": f", Linear weights quantized to 4 bits in groups of {group} (the LM head to int8)",
            "gguf": ", the GGUF's quantized blocks kept as they are (Q4_0/Q4_1/Q4_K 4-bit, Q6_K/Q8_0 8-bit)"}[name]


def describe_backend(name: str) -> str:
    """One line for the start-up log."""
    if name == "cpu":
        from pallas_kernels import cpu_matmul

        return (f"cpu (native kernel, pallas_kernels/cpu_matmul.cc on {cpu_matmul.isa()}: bfloat16 weights "
                "packed in strips)")
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
            raise ValueError(f"--matmul-backend cpu needs {cpu_matmul.NEEDS}; this CPU lacks them")
        return name
    if name == "auto":
        # The kernel computes bfloat16 only, and (like the CPU attention kernel) has no sharding rule.
        if platform != "cpu" or tensor_parallel > 1 or jnp.dtype(dtype) != jnp.bfloat16:
            return "xla"
        from pallas_kernels import cpu_matmul

        return "cpu" if cpu_matmul.available() else "xla"
    raise ValueError(f"matmul backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
