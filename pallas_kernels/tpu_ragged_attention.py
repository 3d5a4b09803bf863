"""Pallas TPU (Mosaic) ragged paged attention (prefill, chunked prefill, mixed), reference signature.

Same work items as the reference and the GPU kernel (`ragged_paged_attention.plan_work_items`):
grid `(items, kv_heads)`, with each item's metadata and page-table row scalar-prefetched into SMEM.
An item's query rows start at an arbitrary token, which a BlockSpec cannot express, so q stays in
HBM and the item's `q_block` tokens are copied by one DMA into VMEM. K/V pages are copied page by
page into a two-slot VMEM buffer, double-buffered across the blocks of pages the item can see
(sliding window to causal end), from layer `layer` (scalar-prefetched) of the stacked cache in
place. Every DMA indexes whole refs (`.at[...]`), never reshaped refs; the reshapes are on loaded
values. The block loop itself is `tpu_paged_attention.attend_page_blocks`,
shared with the decode kernel. Outputs go to a per-item block and are read back per token.

Correct in TPU interpret mode (`pltpu.InterpretParams`, out-of-bounds reads raising) and compiled
by the real TPU compiler for v5e and v6e in CI (tests/tpu_aot); never run or timed on a TPU, where
block sizes and layout (e.g. head_dim/lanes, q_block * heads/sublanes) need measuring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import dot_precision, stacked_cache
from pallas_kernels.ragged_paged_attention import default_q_block, plan_work_items
from pallas_kernels.tpu_paged_attention import (
    attend_page_blocks,
    block_page_tables,
    default_interpret_params,
    nbytes,
    page_walk_cost,
)

_META = 4  # per item: first token, first row within the sequence, q_len, kv_len


def _ragged_kernel(
    # scalar prefetch (SMEM)
    meta_ref,  # [items * 4] int32
    page_tables_ref,  # [items * padded_pages] int32
    scalars_ref,  # [2] int32: window, layer
    # inputs
    q_hbm,  # [kv_heads, padded_tokens, group, head_dim] (HBM)
    k_pages_hbm,  # [layers, kv_heads, num_pages, page_size, head_dim] (HBM)
    v_pages_hbm,
    # output
    o_ref,  # [q_block * group, head_dim]
    # scratch
    q_buf,  # [q_block, group, head_dim] VMEM
    k_buf,  # [2, pages_per_block, page_size, head_dim] VMEM
    v_buf,
    sems,  # DMA semaphores [3, 2]: (k/v/q, slot)
    *,
    scale: float,
    softcap: float | None,
    q_block: int,
    padded_pages: int,
    precision: jax.lax.Precision,
):
    item, h = pl.program_id(0), pl.program_id(1)
    _, group, head_dim = q_buf.shape
    block_k = k_buf.shape[1] * k_buf.shape[2]
    rows = q_block * group
    token = meta_ref[item * _META]
    row0 = meta_ref[item * _META + 1]
    q_len = meta_ref[item * _META + 2]
    kv_len = meta_ref[item * _META + 3]
    window = scalars_ref[0]

    first_pos = kv_len - q_len + row0
    last_pos = kv_len - q_len + jnp.minimum(row0 + q_block, q_len) - 1
    first_key = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)

    q_copy = pltpu.make_async_copy(q_hbm.at[h, pl.ds(token, q_block)], q_buf, sems.at[2, 0])
    q_copy.start()

    def load_q():
        q_copy.wait()
        return q_buf[...].reshape(rows, head_dim)

    r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    local = row0 + r // group
    row_ok = local < q_len  # [rows, 1]
    q_pos = kv_len - q_len + local

    def key_mask(key_pos):
        mask = row_ok & (key_pos < kv_len) & (key_pos <= q_pos)
        return mask & ((window <= 0) | (q_pos - key_pos < window))

    out = attend_page_blocks(
        load_q,
        key_mask,
        kv_len,
        first_key // block_k,
        (jnp.maximum(last_pos + 1, 0) + block_k - 1) // block_k,
        page_ids_ref=page_tables_ref,
        page_offset=item * padded_pages,
        layer=scalars_ref[1],
        head=h,
        k_pages_hbm=k_pages_hbm,
        v_pages_hbm=v_pages_hbm,
        k_buf=k_buf,
        v_buf=v_buf,
        sems=sems,
        scale=scale,
        softcap=softcap,
        precision=precision,
    )
    o_ref[...] = out.astype(o_ref.dtype)


def ragged_paged_attention_tpu(
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
    interpret: pltpu.InterpretParams | bool | None = None,
) -> jax.Array:  # [total_tokens, q_heads, head_dim]
    """Ragged attention as a Pallas TPU kernel; same semantics as `ragged_paged_attention_reference`.
    With `layer`, k_pages/v_pages are the stacked cache and only that layer's pages are read."""
    k_pages, v_pages, layer = stacked_cache(k_pages, v_pages, layer)
    total, q_heads, head_dim = q.shape
    _, kv_heads, _, page_size, _ = k_pages.shape
    max_seqs = page_tables.shape[0]
    group = q_heads // kv_heads
    tq = q_block or max(default_q_block(total, max_seqs), -(-8 // group))  # >= 8 rows (one sublane tile)
    w = plan_work_items(cu_q_lens, kv_lens, num_seqs, total_tokens=total, q_block=tq)
    num_items = w.seq.shape[0]
    page_tables, pages_per_block, padded_pages = block_page_tables(page_tables, page_size, pages_per_block)
    item_pages = page_tables[w.seq]
    meta = jnp.stack([w.token, w.row0, w.q_len, w.kv_len], axis=1)
    # [kv_heads, tokens + q_block, group, head_dim]: an item's q_block rows never run off the end.
    qg = q.reshape(total, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qg = jnp.pad(qg, ((0, 0), (0, tq), (0, 0), (0, 0)))
    if interpret is None:
        interpret = default_interpret_params()

    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    # Worst case: every item walks its whole (padded) page-table row; each item's q block is read
    # once and its output block written once.
    cost = page_walk_cost(
        walks=num_items,
        rows=tq * group,
        pages=padded_pages,
        kv_heads=kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        kv_itemsize=jnp.dtype(k_pages.dtype).itemsize,
        softcap=softcap,
        other_bytes=2 * num_items * tq * q_heads * head_dim * jnp.dtype(q.dtype).itemsize
        + nbytes(meta, item_pages),
    )
    out = pl.pallas_call(
        functools.partial(
            _ragged_kernel,
            scale=scale,
            softcap=softcap,
            q_block=tq,
            padded_pages=padded_pages,
            precision=dot_precision(q.dtype),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_items, kv_heads),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3,
            out_specs=pl.BlockSpec((None, None, tq * group, head_dim), lambda i, h, *_: (h, i, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((tq, group, head_dim), q.dtype),
                buf,
                buf,
                pltpu.SemaphoreType.DMA((3, 2)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct((kv_heads, num_items, tq * group, head_dim), q.dtype),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxserve_ragged_paged_attention_tpu",
    )(
        meta.reshape(-1),
        item_pages.reshape(-1),
        jnp.stack([jnp.asarray(window, jnp.int32).reshape(()), layer]),
        qg,
        k_pages,
        v_pages,
    )

    out = out.reshape(kv_heads, num_items, tq, group, head_dim)[:, w.token_item, w.token_row]
    out = out.transpose(1, 0, 2, 3).reshape(total, q_heads, head_dim)
    return jnp.where(w.token_ok[:, None, None], out, jnp.zeros((), out.dtype))
