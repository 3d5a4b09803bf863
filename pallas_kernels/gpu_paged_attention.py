"""Pallas GPU decode paged attention (flash-decoding), with the reference's signature.

Grid `(batch, kv_heads, splits)`: a program owns one sequence, one kv head and one split of that
sequence's page-table row. It keeps the kv head's `group` query heads as the rows of one matmul
(repeated in registers to 16 rows, Triton's smallest dot), streams its pages in blocks of
`pages_per_block` (one gather of page ids per block), and keeps an online softmax. Each split writes
its unnormalised accumulator with its running max and sum for its real rows only; a second small
kernel merges the splits exactly with log-sum-exp.
Splits whose pages are all past the sequence's length, or all outside its sliding window, do no
work, so a batch pays for the pages its sequences use, not for `max_pages_per_seq`.

The pages are the engine's stacked cache `[layers, kv_heads, num_pages, page_size, head_dim]` plus a
`layer` index (one layer's 4D pages are a stack of one). The Triton lowering has no scalar
prefetch, so the layer cannot steer a BlockSpec index map; instead a program's K/V block is the kv
head's pages of *every* layer (`[layers, num_pages, page_size, head_dim]`, which on the GPU is only a
base pointer and strides, nothing is copied) and the kernel reads `pages[layer, ids]`, so exactly
the pages it needs are loaded from the layer in place. (In interpret mode on the CPU the block is
sliced out per program, which is slow but only for tests.)

Lowering choice. Pallas on GPU has two lowerings: Triton (`jax.experimental.pallas.triton`) and
Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`, the supported Hopper path in new JAX; Triton is
deprecated there). Only the Triton variant exists so far: it is the one that runs in interpret mode
on the CPU (how CI tests it), and no GPU was available when it was written. `LOWERINGS` maps a
name to an implementation so a Mosaic GPU variant can be added beside it; which one is the default
must be decided by measurement on an H100 with `benchmarks/kernels.py` (not yet done), and the
reason recorded here and in `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    apply_softcap,
    dot_precision,
    online_softmax_init,
    online_softmax_step,
    stacked_cache,
    target_platform,
)

MIN_DOT_ROWS = 16  # Triton's tl.dot needs every dimension >= 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_interpret() -> bool:
    """Run kernels in interpret mode unless compiling for a GPU (a real one, or abstract GPU
    devices ahead of time)."""
    return target_platform() != "gpu"


F16_MAX = float(jnp.finfo(jnp.float16).max)


def resolve_dot_dtype(q_dtype: Any, cache_dtype: Any, dot_dtype: Any = None) -> jnp.dtype:
    """The dtype the GPU kernels widen keys and values (and q) to for their dots: `dot_dtype` when
    given, else float16 for an 8-bit float cache under bfloat16 queries, else q's dtype.

    Why float16 for an fp8 cache: Triton widens e4m3 (and e5m2) to float16 with one instruction
    per two values on Hopper, and reaches bfloat16 only through float16, one more conversion (an
    F2F, issued at a fraction of the FP32 rate) per value. Read from the kernel's sm_90 code
    (tests/gpu_lowering, benchmarks/RESULTS.md): the same tensor-core instructions either way and
    128 fewer conversions a program. float16 holds every e4m3 and e5m2 value exactly, and holds
    bfloat16 queries and the softmax's probabilities with 3 more mantissa bits; only a query
    component beyond 65504 would not fit, and `to_dot_dtype` saturates those."""
    if dot_dtype is not None:
        return jnp.dtype(dot_dtype)
    cache_dtype, q_dtype = jnp.dtype(cache_dtype), jnp.dtype(q_dtype)
    if cache_dtype.itemsize == 1 and jnp.issubdtype(cache_dtype, jnp.floating) and q_dtype == jnp.bfloat16:
        return jnp.dtype(jnp.float16)
    return q_dtype


def to_dot_dtype(x: jax.Array, dtype: Any) -> jax.Array:
    """`x` in the kernels' dot dtype; wider values saturate at float16's largest instead of
    becoming inf (and NaN in the softmax)."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype == jnp.float16:
        # Clipped in float32: bfloat16 rounds 65504 itself up to 65536, which float16 calls inf.
        x = jnp.clip(x.astype(jnp.float32), -F16_MAX, F16_MAX)
    return x.astype(dtype)


def pages_per_block_for(pages_per_block: int | None, page_size: int, max_pages: int) -> int:
    """Pages per block of keys: a power of two, by default about 64 keys (a dot needs >= 16)."""
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    return min(_next_pow2(pages_per_block), _next_pow2(max_pages))


def block_logits(
    q: jax.Array,  # [rows, head_dim]
    page_tables_ref,  # [n] int32: the program's page ids
    k_pages_ref,  # [layers, num_pages, page_size, head_dim]: one kv head's pages of every layer
    v_pages_ref,
    layer: jax.Array,
    i: jax.Array,
    pages_per_block: int,
    scale: float,
    softcap: float | None,
    precision: jax.lax.Precision,
) -> tuple[jax.Array, jax.Array]:
    """Block `i` of a program's pages of `layer` (one gather of page ids): the logits [rows,
    block_k], scaled and soft-capped, and the values [block_k, head_dim]."""
    head_dim = k_pages_ref.shape[3]
    block_k = pages_per_block * k_pages_ref.shape[2]
    ids = page_tables_ref[pl.ds(i * pages_per_block, pages_per_block)]
    # An 8-bit cache is widened to q's dtype after the load: memory moves only its 8-bit pages.
    k = k_pages_ref[layer, ids].reshape(block_k, head_dim).astype(q.dtype)
    v = v_pages_ref[layer, ids].reshape(block_k, head_dim).astype(q.dtype)
    s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale
    return apply_softcap(s, softcap), v


def _decode_kernel(
    lengths_ref,  # [1] int32: this sequence's length
    window_ref,  # [1] int32
    layer_ref,  # [1] int32
    page_tables_ref,  # [pages_per_split] int32: this sequence's pages in this split
    q_ref,  # [heads, head_dim]: this kv head's query heads (a power of two of them)
    k_pages_ref,  # [layers, num_pages, page_size, head_dim]: this kv head's pages of every layer
    v_pages_ref,  # [layers, num_pages, page_size, head_dim]
    acc_ref,  # [heads, head_dim] float32, or the normalised output in q's dtype (one split)
    m_ref,  # [heads] float32 (absent with one split)
    l_ref,  # [heads] float32 (absent with one split)
    *,
    scale: float,
    softcap: float | None,
    pages_per_block: int,
    precision: jax.lax.Precision,
):
    split = pl.program_id(2)
    heads, head_dim = q_ref.shape
    rows = max(MIN_DOT_ROWS, heads)
    page_size = k_pages_ref.shape[2]
    pages_per_split = page_tables_ref.shape[0]
    block_k = pages_per_block * page_size
    length = lengths_ref[0]
    window, layer = window_ref[0], layer_ref[0]
    q_pos = length - 1
    first_key = jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)

    split_start = split * pages_per_split  # in pages
    first_block = jnp.maximum(first_key // page_size - split_start, 0) // pages_per_block
    end_block = pl.cdiv(jnp.clip(pl.cdiv(length, page_size) - split_start, 0, pages_per_split), pages_per_block)
    q = tile_rows(q_ref[...], rows)

    def body(i, carry):
        s, v = block_logits(
            q, page_tables_ref, k_pages_ref, v_pages_ref, layer, i, pages_per_block, scale, softcap, precision
        )
        key_pos = (split_start + i * pages_per_block) * page_size + jnp.arange(block_k, dtype=jnp.int32)
        ok = (key_pos < length) & (key_pos >= first_key)  # key_pos <= q_pos follows from < length
        mask = jnp.broadcast_to(ok[None, :], (rows, block_k))
        return online_softmax_step(carry, s, mask, v, ok[:, None], precision=precision)

    init = online_softmax_init(rows, head_dim)
    acc, m, l = jax.lax.fori_loop(first_block, end_block, body, init)
    acc, m, l = first_copy(acc, heads), first_copy(m, heads), first_copy(l, heads)
    if m_ref is None:
        # One split: nothing to combine, so normalise here and skip a float32 round trip.
        acc_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(acc_ref.dtype)
        return
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def tile_rows(x: jax.Array, rows: int) -> jax.Array:
    """`x` [heads, ...] repeated to `rows` rows (copy c holds rows c*heads ...), in registers.

    A dot needs >= 16 rows and a kv head has fewer query heads (4 for Llama-3), so the kernel pads
    them itself. Padded in XLA, q took a kernel of its own and the output a slice: one kernel per
    layer per decode iteration more (Llama-3-8B at batch 64 for an H100, tests/gpu_aot: 476 -> 444),
    and the split accumulators held 16 rows for 4 (4 MiB a layer at batch 1). Copies of the real
    rows, not zeros, because a broadcast and a reshape are all the Triton lowering needs (it has no
    concatenate of rows); each copy's logits and output equal the real rows' exactly, and the
    unused copies cost what zero rows did. The rows are not loaded from past the array's end:
    Triton's loads of a block taller than its array are unmasked (the interpreter pads them, so
    only a GPU would see it).
    """
    heads = x.shape[0]
    if rows == heads:
        return x
    return jnp.broadcast_to(x[None], (rows // heads, *x.shape)).reshape(rows, *x.shape[1:])


def first_copy(x: jax.Array, heads: int) -> jax.Array:
    """The first copy's rows [heads, ...] of a `tile_rows` result [rows, ...], exactly."""
    rows = x.shape[0]
    if rows == heads:
        return x
    x = x.reshape(rows // heads, heads, *x.shape[1:])
    copy = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(copy == 0, x, 0), axis=0)


def _single_split_kernel(lengths_ref, window_ref, layer_ref, page_tables_ref, q_ref, k_pages_ref, v_pages_ref, o_ref,
                         **kw):
    _decode_kernel(lengths_ref, window_ref, layer_ref, page_tables_ref, q_ref, k_pages_ref, v_pages_ref, o_ref, None,
                   None, **kw)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Exact log-sum-exp merge of per-split partial softmaxes along axis 0; empty rows give 0."""
    m_max = jnp.max(m, axis=0)
    w = jnp.where(l > 0.0, jnp.exp(m - m_max[None]), 0.0)
    denom = jnp.sum(w * l, axis=0)
    out = jnp.sum(w[..., None] * acc, axis=0)
    return out / jnp.where(denom == 0.0, 1.0, denom)[..., None]


MAX_COMBINE_VALUES = 64 * 128  # splits x head_dim of one merge program: Llama-3-8B's at batch 1


def _combine_kernel(acc_ref, m_ref, l_ref, o_ref):  # [splits, head_dim], [splits], [splits] -> [head_dim]
    o_ref[...] = combine_splits(acc_ref[...], m_ref[...], l_ref[...]).astype(o_ref.dtype)


def combine_splits_kernel(acc: jax.Array, m: jax.Array, l: jax.Array, dtype: Any, *, interpret: bool) -> jax.Array:
    """`combine_splits` of acc [splits, *rows, head_dim] as one Triton kernel, one program per row.

    XLA compiles the merge as three reductions, three kernels per layer per decode iteration
    beside the attention kernel (Llama-3-8B at batch 1 for an H100, tests/gpu_aot); here it is one.
    A program holds one row's splits x head_dim float32 values (64 x 128 at batch 1: 32 KiB).
    """
    splits, *rows, head_dim = acc.shape
    n = math.prod(rows)
    acc = acc.reshape(splits, n, head_dim)
    m, l = m.reshape(splits, n), l.reshape(splits, n)
    out = pl.pallas_call(
        _combine_kernel,
        grid=(n,),
        in_specs=[
            pl.BlockSpec((splits, None, head_dim), lambda i: (0, i, 0)),
            pl.BlockSpec((splits, None), lambda i: (0, i)),
            pl.BlockSpec((splits, None), lambda i: (0, i)),
        ],
        out_specs=pl.BlockSpec((None, head_dim), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, head_dim), dtype),
        compiler_params=_triton_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxserve_combine_splits",
    )(acc, m, l)
    return out.reshape(*rows, head_dim)


def default_splits(batch: int, kv_heads: int, num_blocks: int, target_programs: int = 264) -> int:
    """Enough programs to fill an H100 (132 SMs, two programs each) without splitting needlessly."""
    want = _next_pow2(max(1, -(-target_programs // max(batch * kv_heads, 1))))
    return max(1, min(want, _next_pow2(num_blocks)))


def window_and_layer(window: jax.Array | int, layer: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """The kernels' window and layer operands, [1] int32 each. Two operands, not one stacked
    [window, layer]: both are constants per layer, and XLA rewrites the constant [0, i] as iota * i,
    a kernel of its own per layer on every decode iteration (Llama-3-8B compiled for an H100 without
    one, tests/gpu_aot: 32 of the 645 kernels of a batch-1 iteration)."""
    return jnp.asarray(window, jnp.int32).reshape(1), jnp.asarray(layer, jnp.int32).reshape(1)


def _decode_triton(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    softcap: float | None,
    window: jax.Array | int,
    layer: jax.Array,
    pages_per_block: int | None,
    num_splits: int | None,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    dot_dtype: Any = None,
    live_rows: int | None = None,
) -> jax.Array:
    batch, q_heads, head_dim = q.shape
    num_layers, kv_heads, num_pages, page_size, _ = k_pages.shape
    max_pages = page_tables.shape[1]
    group = q_heads // kv_heads
    heads = _next_pow2(group)  # Triton's blocks are powers of two; the kernel tiles them to >= 16 rows

    pages_per_block = pages_per_block_for(pages_per_block, page_size, max_pages)
    num_blocks = -(-max_pages // pages_per_block)
    splits = num_splits or default_splits(live_rows or batch, kv_heads, num_blocks)
    splits = max(1, min(splits, num_blocks))
    blocks_per_split = -(-num_blocks // splits)
    pages_per_split = blocks_per_split * pages_per_block
    padded_pages = splits * pages_per_split
    # Padding entries are page 0: in range, and past every length, so never visible.
    page_tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))

    qg = q.reshape(batch, kv_heads, group, head_dim)
    if heads != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, heads - group), (0, 0)))
    # The kernel widens keys and values to q's dtype, and dots in it.
    qg = to_dot_dtype(qg, resolve_dot_dtype(q.dtype, k_pages.dtype, dot_dtype))
    window_op, layer_op = window_and_layer(window, layer)

    kernel = functools.partial(
        _decode_kernel if splits > 1 else _single_split_kernel,
        scale=scale,
        softcap=softcap,
        pages_per_block=pages_per_block,
        precision=dot_precision(qg.dtype),
    )
    # Every layer of kv head h: the layer is picked inside the kernel (no scalar prefetch in Triton).
    page_block = (num_layers, None, num_pages, page_size, head_dim)
    in_specs = [
        pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
        pl.BlockSpec((1,), lambda b, h, s: (0,)),
        pl.BlockSpec((1,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, pages_per_split), lambda b, h, s: (b, s)),
        pl.BlockSpec((None, None, heads, head_dim), lambda b, h, s: (b, h, 0, 0)),
        pl.BlockSpec(page_block, lambda b, h, s: (0, h, 0, 0, 0)),
        pl.BlockSpec(page_block, lambda b, h, s: (0, h, 0, 0, 0)),
    ]
    operands = (lengths.astype(jnp.int32).reshape(batch, 1), window_op, layer_op, page_tables, qg, k_pages, v_pages)
    if splits == 1:
        out = pl.pallas_call(
            kernel,
            grid=(batch, kv_heads, 1),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, heads, head_dim), lambda b, h, s: (b, h, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((batch, kv_heads, heads, head_dim), q.dtype),
            compiler_params=_triton_params(num_warps, num_stages),
            interpret=interpret,
            name="jaxserve_paged_decode",
        )(*operands)
        return out[:, :, :group].reshape(batch, q_heads, head_dim)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, heads, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, heads), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, heads), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, batch, kv_heads, heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, heads), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, heads), jnp.float32),
        ],
        compiler_params=_triton_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxserve_paged_decode",
    )(*operands)

    # A Triton block's dimensions are powers of two, and a program holds its row's splits in
    # registers: up to the size compiled for sm_90 without a spill (tests/gpu_lowering).
    if splits == _next_pow2(splits) and splits * head_dim <= MAX_COMBINE_VALUES:
        out = combine_splits_kernel(acc, m, l, q.dtype, interpret=interpret)
    else:
        out = combine_splits(acc, m, l).astype(q.dtype)
    return out[:, :, :group].reshape(batch, q_heads, head_dim)


def _triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# Lowering name -> implementation. Add "mosaic" here once written, and pick the default by
# measurement on the H100 (see the module docstring).
LOWERINGS: dict[str, Callable[..., jax.Array]] = {"triton": _decode_triton}
DEFAULT_LOWERING = "triton"


def paged_decode_attention_gpu(
    q: jax.Array,  # [batch, q_heads, head_dim]
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,
    page_tables: jax.Array,  # [batch, max_pages_per_seq] int32
    lengths: jax.Array,  # [batch] int32
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    lowering: str = DEFAULT_LOWERING,
    dot_dtype: Any = None,
    live_rows: int | None = None,
) -> jax.Array:  # [batch, q_heads, head_dim]
    """Decode attention as a Pallas GPU kernel; same semantics as `paged_decode_attention_reference`.

    `pages_per_block`, `num_splits`, `num_warps`, `num_stages` are static tuning knobs (defaults:
    ~64 keys per block, enough splits for ~264 programs); `interpret` defaults to True off-GPU.
    With `layer`, k_pages/v_pages are the stacked cache and only that layer's pages are read.

    `dot_dtype`: the dtype keys, values and q are widened to for the dots (float32 accumulation
    either way; the output keeps q's dtype). Default: float16 for an 8-bit float cache under
    bfloat16 queries, else q's dtype (`resolve_dot_dtype`); `benchmarks/kernels.py` times both.

    `live_rows` (default: all): how many leading rows may hold a sequence, the rest being padding
    (length 0: zeros out). The default split count fills the GPU with the live rows' programs alone.
    """
    if lowering not in LOWERINGS:
        raise ValueError(f"GPU lowering must be one of {sorted(LOWERINGS)}, got {lowering!r}")
    k_pages, v_pages, layer = stacked_cache(k_pages, v_pages, layer)
    return LOWERINGS[lowering](
        q,
        k_pages,
        v_pages,
        page_tables,
        lengths,
        scale=scale,
        softcap=softcap,
        window=window,
        layer=layer,
        pages_per_block=pages_per_block,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=default_interpret() if interpret is None else interpret,
        dot_dtype=dot_dtype,
        live_rows=live_rows,
    )
