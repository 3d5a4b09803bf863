"""Helpers shared by the attention references, kernels and validators.

The KV cache layout (fixed; the engine follows it): separate K and V arrays, each
`[num_kv_heads, num_pages, page_size, head_dim]` per layer. The engine stacks the layers into one
`[num_layers, num_kv_heads, num_pages, page_size, head_dim]` array per K and V, and every reference,
kernel and validator accepts that stack plus a `layer` index (traced int32 scalar) and reads the
pages of that layer in place. Token t of a sequence lives in page `page_tables[b, t // page_size]`,
slot `t % page_size`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity" for kernels that must not produce inf - inf = NaN in their running max.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Bytes of live intermediates (keys, values, logits) one chunk of the pure-jnp references may use.
CHUNK_BYTES = 32 * 1024 * 1024


def target_platform() -> str:
    """The platform a kernel is being compiled for: the abstract mesh's devices when one is in
    effect (ahead-of-time compiles for hardware that is not here: abstract TPU or GPU devices
    under `jax.sharding.use_abstract_mesh`), else jax's default backend. "gpu" for CUDA and ROCm."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def concrete_or_none(x: Any) -> np.ndarray | None:
    """`x` as a NumPy array when its value is known now (not a tracer), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def visible(key_pos: jax.Array, q_pos: jax.Array, kv_len: jax.Array, window: jax.Array | int) -> jax.Array:
    """Whether a query at `q_pos` may attend to a key at `key_pos` (all broadcastable int32).

    A key is visible iff it was written (key_pos < kv_len), is causal (key_pos <= q_pos) and lies in
    the sliding window when there is one (window == 0 means none; it may be a traced scalar, since the
    engine scans over layers with a per-layer window array).
    """
    window = jnp.asarray(window, jnp.int32)
    in_window = (window <= 0) | (q_pos - key_pos < window)
    return (key_pos < kv_len) & (key_pos <= q_pos) & in_window


def apply_softcap(s: jax.Array, softcap: float | None) -> jax.Array:
    if softcap is None:
        return s
    return jnp.tanh(s / softcap) * softcap


def dot_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """The kernels' matmul precision for inputs of `dtype`."""
    # float32 inputs are for exactness (tests, parity runs): no TF32. bf16 uses the tensor cores as is.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


# The online (flash) softmax of the Pallas kernels, over one block of keys at a time. A carry is
# (acc [rows, head_dim], m, l) in float32: the unnormalised output, the running max and the running
# sum of the rows. The GPU (Triton) kernels keep m and l as vectors [rows]; the TPU (Mosaic) kernels
# pass keepdims=True and keep them as [rows, 1], because Mosaic lays out 2D arrays natively and
# every broadcast then stays 2D. The running max starts at the finite MASK_VALUE, not -inf, so a row
# that has seen nothing yet gets alpha = exp(0), never exp(-inf - -inf) = NaN.


def online_softmax_init(rows: int, head_dim: int, *, keepdims: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The carry before the first block: nothing seen."""
    stat = (rows, 1) if keepdims else (rows,)
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full(stat, MASK_VALUE, jnp.float32),
        jnp.zeros(stat, jnp.float32),
    )


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    s: jax.Array,  # [rows, block_k] float32 logits (scaled, soft-capped)
    mask: jax.Array,  # [rows, block_k] bool: which logits are visible
    v: jax.Array,  # [block_k, head_dim] this block's values
    v_ok: jax.Array,  # bool, broadcastable to v: which value slots were written
    *,
    precision: jax.lax.Precision,
    keepdims: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Folds one block of keys into the carry (exact: the final result equals a dense softmax).

    Masked logits go through `where`, never a multiply; unwritten value slots (which may hold NaN)
    are zeroed before the product, because a zero probability times NaN is still NaN.
    """
    acc, m, l = carry
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=keepdims))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - (m_new if keepdims else m_new[:, None])), 0.0)
    v = jnp.where(jnp.broadcast_to(v_ok, v.shape), v, jnp.zeros((), v.dtype))
    pv = jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    return acc * (alpha if keepdims else alpha[:, None]) + pv, m_new, l * alpha + jnp.sum(p, axis=1, keepdims=keepdims)


def online_softmax_result(acc: jax.Array, l: jax.Array, *, keepdims: bool = False) -> jax.Array:
    """The normalised float32 output of a final carry; a row that saw nothing gives 0."""
    denom = jnp.where(l == 0.0, 1.0, l)
    return acc / (denom if keepdims else denom[:, None])


def attend_items(
    q: jax.Array,  # [items, rows, kv_heads, group, head_dim]
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim (layers iff `layer`)
    v_pages: jax.Array,
    pages: jax.Array,  # [items, max_pages_per_seq] int32: each item's page-table row
    kv_len: jax.Array,  # [items] int32 (0 for items that do nothing)
    q_pos: jax.Array,  # [items, rows] int32
    row_ok: jax.Array,  # [items, rows] bool
    *,
    scale: float,
    softcap: float | None,
    window: jax.Array | int,
    chunk_pages: int,
    layer: jax.Array | None = None,
) -> jax.Array:  # [items, rows, kv_heads, group, head_dim] float32
    """Attention of work items over the paged cache, in pure jnp: the engine of both references.

    An item is `rows` queries of one sequence (decode: one row per sequence). The keys are read in
    chunks of `chunk_pages` pages with an exact online softmax, and only as many chunks as the
    longest live item needs (a traced trip count), so a step costs what the batch's contexts need,
    not what `max_pages_per_seq` allows, and memory stays at one chunk per item.

    Masked logits go through `where`, never a multiply, so NaN in unused pages cannot leak; values
    past `kv_len` are zeroed before the product (0 * NaN is NaN). A row that sees nothing returns 0.

    Layout, for XLA:CPU (where this is the serving path): both products run with (kv_head, item)
    as the leading batch dimensions of both operands, which is how the gathered pages come out, so
    XLA transposes no keys; keys and values are widened to float32 as they are gathered, because
    XLA:CPU's bfloat16 products of a few rows fall to a slow loop. Together this made the decode
    step's attention ~2.5x faster on the CPU than (item, row)-major bfloat16 einsums.
    """
    items, rows, kv_heads, group, head_dim = q.shape
    page_size = k_pages.shape[-2]
    max_pages = pages.shape[1]
    chunk_pages = max(1, min(chunk_pages, max_pages))
    num_chunks = -(-max_pages // chunk_pages)
    if num_chunks * chunk_pages != max_pages:  # pad so every chunk is a full slice; padded keys are masked
        pages = jnp.pad(pages, ((0, 0), (0, num_chunks * chunk_pages - max_pages)))
    chunk = chunk_pages * page_size
    window = jnp.asarray(window, jnp.int32)
    row_ok = row_ok & (kv_len[:, None] > 0)
    precision = dot_precision(q.dtype)  # widened bfloat16 values are exact in one bfloat16 pass
    # [kv_heads, items, rows * group, head_dim]: a row's group of q heads shares the row's mask.
    qk = q.astype(jnp.float32).transpose(2, 0, 1, 3, 4).reshape(kv_heads, items, rows * group, head_dim)

    def step(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        acc, m, l = carry
        idx = jax.lax.dynamic_slice_in_dim(pages, c * chunk_pages, chunk_pages, axis=1)
        k = gather_pages(k_pages, idx, layer).reshape(kv_heads, items, chunk, head_dim).astype(jnp.float32)
        v = gather_pages(v_pages, idx, layer).reshape(kv_heads, items, chunk, head_dim).astype(jnp.float32)
        key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        s = jnp.einsum("kiqd,kijd->kiqj", qk, k, precision=precision) * scale
        s = apply_softcap(s.reshape(kv_heads, items, rows, group, chunk), softcap)
        mask = visible(key_pos[None, None, :], q_pos[:, :, None], kv_len[:, None, None], window)
        mask = (mask & row_ok[:, :, None])[None, :, :, None, :]  # [1, items, rows, 1, chunk]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen (m = -inf)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        v = jnp.where((key_pos[None, :] < kv_len[:, None])[None, :, :, None], v, 0.0)
        pv = jnp.einsum("kiqj,kijd->kiqd", p.reshape(kv_heads, items, rows * group, chunk), v, precision=precision)
        pv = pv.reshape(kv_heads, items, rows, group, head_dim)
        return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

    shape = (kv_heads, items, rows, group)
    carry = (
        jnp.zeros(shape + (head_dim,), jnp.float32),
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )
    if num_chunks == 1:
        acc, _, l = step(jnp.int32(0), carry)
    else:
        needed = jnp.max(jnp.where(jnp.any(row_ok, axis=1), kv_len, 0))
        acc, _, l = jax.lax.fori_loop(0, (needed + chunk - 1) // chunk, step, carry)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    return out.transpose(1, 2, 0, 3, 4)  # [items, rows, kv_heads, group, head_dim]


def gather_pages(pages: jax.Array, idx: jax.Array, layer: jax.Array | None) -> jax.Array:
    """Pages `idx` [items, n] of one layer -> [kv_heads, items, n, page_size, head_dim].

    With `layer`, `pages` is the whole stacked cache [layers, kv_heads, num_pages, page_size,
    head_dim] and the layer index goes into the same gather: slicing the layer out first would copy
    that layer's entire cache on every call, which costs more than the attention itself.

    An 8-bit float cache is gathered as its bytes on the CPU: XLA:CPU has no float8 gather, and
    its float normalization widened the whole cache to float16 to gather a few pages of it.
    """
    if is_8bit_float(pages.dtype):
        def as_bytes(pages: jax.Array, idx: jax.Array) -> jax.Array:
            raw = gather_pages(jax.lax.bitcast_convert_type(pages, jnp.uint8), idx, layer)
            return jax.lax.bitcast_convert_type(raw, pages.dtype)

        return jax.lax.platform_dependent(pages, idx, cpu=as_bytes, default=lambda p, i: _gather(p, i, layer))
    return _gather(pages, idx, layer)


def _gather(pages: jax.Array, idx: jax.Array, layer: jax.Array | None) -> jax.Array:
    if layer is None:
        return jnp.take(pages, idx, axis=1, mode="clip")
    # Advanced indices (layer, idx) around a slice put the index dims first: [items, n, kv_heads, ...].
    return jnp.moveaxis(pages[layer, :, idx], 2, 0)


def select_kernel(
    backend: str, reference: Callable[..., jax.Array], pallas: dict[str, tuple[str, str]]
) -> Callable[..., jax.Array]:
    """The attention function of `backend`: `reference` for "reference", else the Pallas kernel that
    `pallas[backend]` names as (module, function). The module is imported only now, so the CPU
    serving path never imports Pallas."""
    if backend == "reference":
        return reference
    if backend not in pallas:
        raise ValueError(f"backend must be 'reference', 'pallas_gpu', 'pallas_tpu' or 'cpu', got {backend!r}")
    module, name = pallas[backend]
    return getattr(importlib.import_module(module), name)


def chunk_pages_for(items: int, rows: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int) -> int:
    """Pages per chunk so one chunk's keys, values and logits take about CHUNK_BYTES."""
    per_token = 4 * items * (2 * kv_heads * head_dim + 3 * rows * q_heads)
    return max(1, CHUNK_BYTES // max(per_token * page_size, 1))


def check_ndim(name: str, x: Any, ndim: int, expected: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) != ndim:
        shape = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have shape {expected}, got {shape}")


def check_shape(name: str, x: Any, shape: tuple[int, ...], expected: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {expected} = {tuple(shape)}, got {tuple(x.shape)}")


def check_int(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array (int32), got dtype {x.dtype}")


def check_float(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{name} must be a floating-point array (float32, bfloat16 or, for a cache, float8), got dtype {x.dtype}"
        )


def is_8bit_float(dtype: Any) -> bool:
    """An 8-bit float cache (--kv-cache-dtype fp8*): saturated on write, and moved as bytes on the CPU."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def to_cache_dtype(x: jax.Array, dtype: Any) -> jax.Array:
    """`x` rounded to the cache's dtype. An 8-bit float cache (scale 1.0: it holds the values
    themselves, as vLLM's fp8 cache without calibrated scales) saturates at its largest finite value:
    a plain cast would turn an out-of-range key into NaN (float8_e4m3fn has no infinity) or inf
    (float8_e5m2), and one such key poisons every later softmax of its sequence."""
    dtype = jnp.dtype(dtype)
    if is_8bit_float(dtype) and x.dtype != dtype:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -top, top)
    return x.astype(dtype)


PAGES_SHAPE = "[num_kv_heads, num_pages, page_size, head_dim] (or [num_layers, ...] with layer)"


def check_layer_arg(k_pages: Any, layer: Any) -> None:
    """Static check that `layer` goes with a stacked cache: required for 5D pages, refused for 4D."""
    ndim = len(k_pages.shape)
    if ndim == 5 and layer is None:
        raise ValueError(
            f"k_pages has shape {tuple(k_pages.shape)} = [num_layers, num_kv_heads, num_pages, page_size, "
            "head_dim]: pass layer= (which layer to read)"
        )
    if ndim == 4 and layer is not None:
        raise ValueError(
            f"layer= needs the stacked cache [num_layers, num_kv_heads, num_pages, page_size, head_dim], "
            f"got k_pages of shape {tuple(k_pages.shape)}"
        )


def stacked_cache(k_pages: jax.Array, v_pages: jax.Array, layer: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(k_pages, v_pages, layer) as the kernels take them: a 5D stack and an int32 scalar.

    One layer's 4D pages become a stack of one (adding a leading unit axis is free: no copy), so the
    kernels have a single code path that indexes the layer in place.
    """
    check_layer_arg(k_pages, layer)
    if len(k_pages.shape) == 4:
        return k_pages[None], v_pages[None], jnp.zeros((), jnp.int32)
    return k_pages, v_pages, jnp.asarray(layer, jnp.int32).reshape(())


def validate_cache(
    q: Any, k_pages: Any, v_pages: Any, q_expected: str, layer: Any = None
) -> tuple[int, int, int, int, int]:
    """Checks q against the K/V pages (one layer's 4D, or the stacked 5D cache with `layer`);
    returns (q_heads, kv_heads, num_pages, page_size, head_dim)."""
    check_ndim("q", q, 3, q_expected)
    if not hasattr(k_pages, "shape") or len(k_pages.shape) not in (4, 5):
        check_ndim("k_pages", k_pages, 4, PAGES_SHAPE)
    check_ndim("v_pages", v_pages, len(k_pages.shape), f"k_pages.shape {tuple(k_pages.shape)}")
    check_layer_arg(k_pages, layer)
    check_float("q", q)
    check_float("k_pages", k_pages)
    check_float("v_pages", v_pages)
    kv_heads, num_pages, page_size, head_dim = k_pages.shape[-4:]
    check_shape("v_pages", v_pages, k_pages.shape, f"k_pages.shape {PAGES_SHAPE}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share a dtype, got {k_pages.dtype} and {v_pages.dtype}")
    if layer is not None:
        validate_layer(layer, k_pages.shape[0])
    q_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim (q.shape[2] = {q.shape[2]}) must equal the pages' head_dim {head_dim}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"q_heads ({q_heads}) must be a positive multiple of num_kv_heads ({kv_heads})")
    if num_pages == 0 or page_size == 0:
        raise ValueError(f"k_pages must hold at least one page of at least one slot, got shape {k_pages.shape}")
    return q_heads, kv_heads, num_pages, page_size, head_dim


def validate_layer(layer: Any, num_layers: int) -> None:
    """`layer` is an integer scalar, and in [0, num_layers) when concrete (a traced one cannot be
    checked; the kernels' index maps and DMAs would then read out of bounds)."""
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    value = concrete_or_none(layer)
    if value is not None and not 0 <= int(value) < num_layers:
        raise ValueError(f"layer = {int(value)} is out of range [0, {num_layers}) (num_layers = k_pages.shape[0])")


def validate_options(softcap: float | None, window: Any) -> None:
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive static float, got {softcap!r}")
    w = concrete_or_none(window)
    if w is not None and (w.ndim != 0 or not np.issubdtype(w.dtype, np.integer) or int(w) < 0):
        raise ValueError(f"window must be a non-negative integer scalar (0 = no window), got {window!r}")


def validate_page_tables(page_tables: Any, rows: int, num_pages: int, rows_name: str) -> None:
    check_ndim("page_tables", page_tables, 2, f"[{rows_name}, max_pages_per_seq]")
    check_int("page_tables", page_tables)
    if page_tables.shape[0] != rows:
        raise ValueError(
            f"page_tables must have shape [{rows_name}, max_pages_per_seq] with {rows_name} = {rows}, "
            f"got {tuple(page_tables.shape)}"
        )
    pt = concrete_or_none(page_tables)
    if pt is not None and pt.size and (pt.min() < 0 or pt.max() >= num_pages):
        bad = np.argwhere((pt < 0) | (pt >= num_pages))[0]
        raise ValueError(
            f"page_tables[{bad[0]}, {bad[1]}] = {pt[tuple(bad)]} is out of range [0, {num_pages}) "
            f"(num_pages = k_pages.shape[-3])"
        )
