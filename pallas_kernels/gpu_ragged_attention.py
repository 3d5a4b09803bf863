"""Pallas GPU ragged paged attention (prefill, chunked prefill, mixed batches), reference signature.

The batch is cut into the reference's work items (`ragged_paged_attention.plan_work_items`): up to
`q_block` consecutive query rows of one sequence. Grid `(items, kv_heads)`: a program takes its
item's rows times the kv head's query heads as the rows of one matmul (token-major, heads minor),
streams the sequence's pages in blocks of `pages_per_block` from the first key any of its rows can
see (sliding window) to the last (causal), and keeps an online softmax (flash attention). Dead
items (past the real count) do no work. Outputs go to a per-item buffer and are read back per token,
so programs never write the same memory. The pages are the stacked cache plus a `layer` index, read
in place as in `gpu_paged_attention` (the block is a kv head's pages of every layer; the kernel
indexes the layer).

The new K/V are written into the pages beforehand with `kv_write.write_kv` (not fused); whether
fusing the write pays is for the H100 measurement. Lowering choice: as in `gpu_paged_attention`, only
the Triton lowering exists so far (it runs in interpret mode on the CPU); `LOWERINGS` keeps it
swappable, and the default must be chosen by measurement on an H100 (not yet done).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    dot_precision,
    online_softmax_init,
    online_softmax_result,
    online_softmax_step,
    stacked_cache,
)
from pallas_kernels.gpu_paged_attention import (
    MIN_DOT_ROWS,
    _next_pow2,
    _triton_params,
    block_logits,
    default_interpret,
    pages_per_block_for,
    resolve_dot_dtype,
    to_dot_dtype,
    window_and_layer,
)
from pallas_kernels.ragged_paged_attention import default_q_block, plan_work_items


def _ragged_kernel(
    meta_ref,  # [4] int32: first token, first row within the sequence, q_len, kv_len
    window_ref,  # [1] int32
    layer_ref,  # [1] int32
    page_tables_ref,  # [padded_pages] int32: the item's sequence's page-table row
    q_ref,  # [padded_tokens, heads, head_dim]: this kv head's query heads
    k_pages_ref,  # [layers, num_pages, page_size, head_dim]: this kv head's pages of every layer
    v_pages_ref,
    o_ref,  # [q_block * heads, head_dim]
    *,
    scale: float,
    softcap: float | None,
    group: int,
    q_block: int,
    pages_per_block: int,
    precision: jax.lax.Precision,
):
    heads, head_dim = q_ref.shape[1], q_ref.shape[2]
    page_size = k_pages_ref.shape[2]
    block_k = pages_per_block * page_size
    rows = q_block * heads
    token, row0, q_len, kv_len = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    window, layer = window_ref[0], layer_ref[0]

    r = jnp.arange(rows, dtype=jnp.int32)
    local = row0 + r // heads
    row_ok = (local < q_len) & (r % heads < group)
    q_pos = kv_len - q_len + local
    first_pos = kv_len - q_len + row0
    last_pos = kv_len - q_len + jnp.minimum(row0 + q_block, q_len) - 1
    first_key = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    first_block = first_key // block_k
    end_block = pl.cdiv(jnp.maximum(last_pos + 1, 0), block_k)

    q = q_ref[pl.ds(token, q_block), :, :].reshape(rows, head_dim)

    def body(i, carry):
        s, v = block_logits(
            q, page_tables_ref, k_pages_ref, v_pages_ref, layer, i, pages_per_block, scale, softcap, precision
        )
        key_pos = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        key_ok = key_pos < kv_len
        mask = row_ok[:, None] & key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        mask = mask & ((window <= 0) | (q_pos[:, None] - key_pos[None, :] < window))
        return online_softmax_step(carry, s, mask, v, key_ok[:, None], precision=precision)

    acc, _, l = jax.lax.fori_loop(first_block, end_block, body, online_softmax_init(rows, head_dim))
    o_ref[...] = online_softmax_result(acc, l).astype(o_ref.dtype)


# A program holds its float32 accumulator [rows, head_dim], its logits [rows, keys] and its q in
# registers. Compiled for sm_90, 4 warps spill them to local memory (160-1,500 bytes a thread,
# loaded and stored in the key loop) once the accumulator holds 8,192 values, at every head shape
# tried; 8 warps (two warpgroups) hold up to 128 rows and 16,384 values without a spill, and 256
# rows spill again, at head_dim 64 (tests/gpu_lowering compiles these to a cubin on the CPU).
MAX_ROWS = 128
MAX_TILE = 128 * 128
WIDE_TILE = 64 * 128


def gpu_q_block(total_tokens: int, max_seqs: int, heads: int, head_dim: int = 128) -> int:
    """Rows per item: the reference's choice, raised so a dot has >= 16 rows, capped so the
    accumulator tile (rows x head_dim) stays within MAX_ROWS and MAX_TILE (64 rows at head_dim 256)."""
    tq = max(default_q_block(total_tokens, max_seqs), -(-MIN_DOT_ROWS // heads))
    max_rows = max(MIN_DOT_ROWS, min(MAX_ROWS, MAX_TILE // head_dim))
    return max(1, min(tq, max(1, max_rows // heads)))


def gpu_num_warps(rows: int, head_dim: int) -> int:
    """Warps per program: 8 once the accumulator tile reaches WIDE_TILE (4 would spill it), else 4."""
    return 8 if rows * head_dim >= WIDE_TILE else 4


def _ragged_triton(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    scale: float,
    softcap: float | None,
    window: jax.Array | int,
    layer: jax.Array,
    q_block: int | None,
    pages_per_block: int | None,
    num_warps: int | None,
    num_stages: int,
    interpret: bool,
) -> jax.Array:
    total, q_heads, head_dim = q.shape
    num_layers, kv_heads, num_pages, page_size, _ = k_pages.shape
    max_seqs, max_pages = page_tables.shape
    group = q_heads // kv_heads
    heads = _next_pow2(group)
    tq = _next_pow2(q_block or gpu_q_block(total, max_seqs, heads, head_dim))
    w = plan_work_items(cu_q_lens, kv_lens, num_seqs, total_tokens=total, q_block=tq)
    num_items = w.seq.shape[0]

    pages_per_block = pages_per_block_for(pages_per_block, page_size, max_pages)
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    item_pages = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))[w.seq]
    meta = jnp.stack([w.token, w.row0, w.q_len, w.kv_len], axis=1)
    # [kv_heads, tokens + q_block, heads, head_dim]: an item's rows are one slice that never runs off the end.
    qg = q.reshape(total, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qg = jnp.pad(qg, ((0, 0), (0, tq), (0, heads - group), (0, 0)))
    qg = to_dot_dtype(qg, resolve_dot_dtype(q.dtype, k_pages.dtype))  # float16 dots for an fp8 cache
    window_op, layer_op = window_and_layer(window, layer)

    kernel = functools.partial(
        _ragged_kernel,
        scale=scale,
        softcap=softcap,
        group=group,
        q_block=tq,
        pages_per_block=pages_per_block,
        precision=dot_precision(qg.dtype),
    )
    # Every layer of kv head h: the layer is picked inside the kernel (no scalar prefetch in Triton).
    page_block = (num_layers, None, num_pages, page_size, head_dim)
    out = pl.pallas_call(
        kernel,
        grid=(num_items, kv_heads),
        in_specs=[
            pl.BlockSpec((None, 4), lambda i, h: (i, 0)),
            pl.BlockSpec((1,), lambda i, h: (0,)),
            pl.BlockSpec((1,), lambda i, h: (0,)),
            pl.BlockSpec((None, padded_pages), lambda i, h: (i, 0)),
            pl.BlockSpec((None, total + tq, heads, head_dim), lambda i, h: (h, 0, 0, 0)),
            pl.BlockSpec(page_block, lambda i, h: (0, h, 0, 0, 0)),
            pl.BlockSpec(page_block, lambda i, h: (0, h, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, tq * heads, head_dim), lambda i, h: (h, i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((kv_heads, num_items, tq * heads, head_dim), q.dtype),
        compiler_params=_triton_params(num_warps or gpu_num_warps(tq * heads, head_dim), num_stages),
        interpret=interpret,
        name="jaxserve_ragged_paged_attention",
    )(meta, window_op, layer_op, item_pages, qg, k_pages, v_pages)

    out = out.reshape(kv_heads, num_items, tq, heads, head_dim)[:, w.token_item, w.token_row, :group]
    out = out.transpose(1, 0, 2, 3).reshape(total, q_heads, head_dim)
    return jnp.where(w.token_ok[:, None, None], out, jnp.zeros((), out.dtype))


LOWERINGS: dict[str, Callable[..., jax.Array]] = {"triton": _ragged_triton}
DEFAULT_LOWERING = "triton"


def ragged_paged_attention_gpu(
    q: jax.Array,  # [total_tokens, q_heads, head_dim]
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,
    page_tables: jax.Array,  # [max_seqs, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    kv_lens: jax.Array,  # [max_seqs] int32
    num_seqs: jax.Array | int,
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
    q_block: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool | None = None,
    lowering: str = DEFAULT_LOWERING,
) -> jax.Array:  # [total_tokens, q_heads, head_dim]
    """Ragged attention as a Pallas GPU kernel; same semantics as `ragged_paged_attention_reference`.

    `q_block` (query tokens per program, a power of two), `pages_per_block`, `num_warps` (default:
    `gpu_num_warps` of the tile), `num_stages` are static tuning knobs; `interpret` defaults to True
    off-GPU. With `layer`, k_pages/v_pages are the stacked cache and only that layer's pages are read.
    """
    if lowering not in LOWERINGS:
        raise ValueError(f"GPU lowering must be one of {sorted(LOWERINGS)}, got {lowering!r}")
    k_pages, v_pages, layer = stacked_cache(k_pages, v_pages, layer)
    return LOWERINGS[lowering](
        q,
        k_pages,
        v_pages,
        page_tables,
        cu_q_lens,
        kv_lens,
        num_seqs,
        scale=scale,
        softcap=softcap,
        window=window,
        layer=layer,
        q_block=q_block,
        pages_per_block=pages_per_block,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=default_interpret() if interpret is None else interpret,
    )
