"""Pallas TPU (Mosaic) decode paged attention, with the reference's signature.

Grid `(batch, kv_heads)`; the lengths, the flattened page tables, the window and the layer are
scalar-prefetched into SMEM (`PrefetchScalarGridSpec`), so each program knows its pages before it
starts. The K/V pages are the engine's stacked cache `[layers, kv_heads, num_pages, page_size,
head_dim]` (one layer's 4D pages are a stack of one) and stay in HBM (`memory_space=ANY`), so no
layer is ever sliced out. A program walks its sequence's visible pages in blocks of
`pages_per_block`, copying each page with its own DMA into a two-slot VMEM scratch: while block i
is being computed, block i + 1 is already in flight (double buffering). Every DMA goes from
`pages.at[layer, head, page]` to `buffer.at[slot, j]` — whole refs indexed, never reshaped
(reshaped refs feeding DMAs break TPU interpret mode); the reshape to `[block_k, head_dim]` is on
the loaded value.

Only the blocks a row can see are copied: from the first key of the sliding window to the last
written token, so a step reads the pages it uses, not `max_pages_per_seq`. A program's query rows
are the kv head's `group` query heads, one matmul per block with an exact online softmax in float32.

Correct in TPU interpret mode (`pltpu.InterpretParams`, out-of-bounds reads raising, NaN-filled
uninitialised memory), which is how CI tests it; CI also compiles it with the real TPU compiler
(Mosaic) for v5e and v6e at Llama-3 shapes (tests/tpu_aot). Not yet run or timed on a TPU: block
sizes (`pages_per_block`), megacore splitting and whether to prefetch the next program's first
block (as jax's own kernel does) are for measurement there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    apply_softcap,
    dot_precision,
    online_softmax_init,
    online_softmax_result,
    online_softmax_step,
    stacked_cache,
    target_platform,
)


def default_interpret_params() -> pltpu.InterpretParams | bool:
    """Interpret unless compiling for a TPU (a real one, or abstract TPU devices ahead of time),
    with out-of-bounds reads raising and uninitialised memory NaN."""
    if target_platform() == "tpu":
        return False
    return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


def block_page_tables(page_tables: jax.Array, page_size: int, pages_per_block: int | None) -> tuple[jax.Array, int, int]:
    """Page tables as int32, padded to whole blocks: (page_tables, pages_per_block, padded_pages).

    `pages_per_block` defaults to ~128 keys per block and is capped at `max_pages_per_seq`. Padding
    entries are page 0: in range, and past every length, so never visible.
    """
    max_pages = page_tables.shape[1]
    if pages_per_block is None:
        pages_per_block = max(1, 128 // page_size)
    pages_per_block = max(1, min(pages_per_block, max_pages))
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    page_tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))
    return page_tables, pages_per_block, padded_pages


def page_walk_cost(
    *,
    walks: int,
    rows: int,
    pages: int,
    kv_heads: int,
    page_size: int,
    head_dim: int,
    kv_itemsize: int,
    softcap: float | None,
    other_bytes: int,
) -> pl.CostEstimate:
    """The worst-case cost of a kernel whose programs walk page-table rows, for XLA's cost model.

    `walks` page-table rows (decode: one per sequence; ragged: one per work item), each walked by
    every kv head with `rows` query rows (decode: the head's group; ragged: q_block * group) over
    `pages` pages of K and of V. Which pages a row actually reads depends on the lengths and the
    window, unknown at compile time, so this is the worst case the shapes allow: every page-table
    entry (padded to whole blocks, since a block's DMAs move all of its pages) of every row read
    once, plus `other_bytes` (q, the output, the scalar-prefetched tables). Without an estimate XLA
    counts a Mosaic call as free, and a step's cost_analysis() would miss the KV reads that dominate it.
    """
    keys = walks * pages * page_size  # per kv head
    logits = kv_heads * keys * rows
    return pl.CostEstimate(
        flops=4 * logits * head_dim,  # q.k and p.v, a multiply and an add each
        transcendentals=logits * (2 if softcap is not None else 1),  # exp (+ tanh)
        bytes_accessed=2 * kv_heads * keys * head_dim * kv_itemsize + other_bytes,
    )


def nbytes(*arrays: jax.Array) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in arrays)


def attend_page_blocks(
    load_q: Callable[[], jax.Array],
    key_mask: Callable[[jax.Array], jax.Array],
    kv_len: jax.Array,
    first_block: jax.Array,
    end_block: jax.Array,
    *,
    page_ids_ref,  # SMEM int32: the program's page-table row starts at page_ids_ref[page_offset]
    page_offset: jax.Array,
    layer: jax.Array,
    head: jax.Array,
    k_pages_hbm,  # [layers, kv_heads, num_pages, page_size, head_dim] (HBM)
    v_pages_hbm,
    k_buf,  # [2, pages_per_block, page_size, head_dim] VMEM
    v_buf,
    sems,  # DMA semaphores, [0, slot] for K and [1, slot] for V
    scale: float,
    softcap: float | None,
    precision: jax.lax.Precision,
) -> jax.Array:  # [rows, head_dim] float32
    """The body both TPU kernels share: attention of one program's query rows over its blocks of pages.

    Blocks `first_block <= i < end_block` are copied from HBM page by page into the two-slot
    buffers (block i + 1 is in flight while block i is computed) and folded into a keepdims online
    softmax. `load_q()` gives the query rows [rows, head_dim]; it is called after the first block's
    DMAs have started, so a query DMA overlaps them. `key_mask(key_pos)` says which keys each row
    sees ([rows, block_k] int32 positions -> bool); value slots at or past `kv_len` are unwritten.
    """
    pages_per_block, page_size, head_dim = k_buf.shape[1:]
    block_k = pages_per_block * page_size

    def copies(block, slot):
        """The DMAs of one block: each page of K and V into its place in the slot's buffer."""
        out = []
        for j in range(pages_per_block):
            page = page_ids_ref[page_offset + block * pages_per_block + j]
            out.append(pltpu.make_async_copy(k_pages_hbm.at[layer, head, page], k_buf.at[slot, j], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_pages_hbm.at[layer, head, page], v_buf.at[slot, j], sems.at[1, slot]))
        return out

    def start(block, slot):
        for c in copies(block, slot):
            c.start()

    @pl.when(first_block < end_block)
    def _prefetch_first():
        start(first_block, 0)

    q = load_q()
    rows = q.shape[0]

    def body(block, carry):
        slot = (block - first_block) % 2

        @pl.when(block + 1 < end_block)
        def _prefetch_next():
            start(block + 1, 1 - slot)

        for c in copies(block, slot):
            c.wait()
        # An 8-bit cache is widened to q's dtype here, in VMEM: HBM moves only its 8-bit pages.
        k = k_buf[slot].reshape(block_k, head_dim).astype(q.dtype)
        v = v_buf[slot].reshape(block_k, head_dim).astype(q.dtype)
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = apply_softcap(s * scale, softcap)
        key_pos = block * block_k + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        v_pos = block * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
        # unwritten slots may hold NaN
        return online_softmax_step(carry, s, key_mask(key_pos), v, v_pos < kv_len, precision=precision, keepdims=True)

    init = online_softmax_init(rows, head_dim, keepdims=True)
    acc, _, l = jax.lax.fori_loop(first_block, end_block, body, init)
    return online_softmax_result(acc, l, keepdims=True)


def _decode_kernel(
    # scalar prefetch (SMEM)
    lengths_ref,  # [batch] int32
    page_tables_ref,  # [batch * padded_pages] int32
    scalars_ref,  # [2] int32: window, layer
    # inputs
    q_ref,  # [group, head_dim] (VMEM block)
    k_pages_hbm,  # [layers, kv_heads, num_pages, page_size, head_dim] (HBM)
    v_pages_hbm,
    # output
    o_ref,  # [group, head_dim]
    # scratch
    k_buf,  # [2, pages_per_block, page_size, head_dim] VMEM
    v_buf,
    sems,  # DMA semaphores [2, 2]: (k/v, slot)
    *,
    scale: float,
    softcap: float | None,
    padded_pages: int,
    precision: jax.lax.Precision,
):
    b, h = pl.program_id(0), pl.program_id(1)
    block_k = k_buf.shape[1] * k_buf.shape[2]
    length = lengths_ref[b]
    window = scalars_ref[0]
    first_key = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)  # q_pos - window + 1

    def key_mask(key_pos):
        return (key_pos < length) & (key_pos >= first_key)  # key_pos <= q_pos follows from < length

    out = attend_page_blocks(
        lambda: q_ref[...],
        key_mask,
        length,
        first_key // block_k,
        (length + block_k - 1) // block_k,
        page_ids_ref=page_tables_ref,
        page_offset=b * padded_pages,
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


def paged_decode_attention_tpu(
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
    interpret: pltpu.InterpretParams | bool | None = None,
) -> jax.Array:  # [batch, q_heads, head_dim]
    """Decode attention as a Pallas TPU kernel; same semantics as `paged_decode_attention_reference`.

    `pages_per_block` (static, default ~128 keys per block) sets the DMA/compute block; `interpret`
    defaults to `pltpu.InterpretParams(out_of_bounds_reads="raise")` off-TPU. With `layer`,
    k_pages/v_pages are the stacked cache and only that layer's pages are read.
    """
    k_pages, v_pages, layer = stacked_cache(k_pages, v_pages, layer)
    batch, q_heads, head_dim = q.shape
    _, kv_heads, _, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    page_tables, pages_per_block, padded_pages = block_page_tables(page_tables, page_size, pages_per_block)
    if interpret is None:
        interpret = default_interpret_params()

    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, *_: (b, h, 0, 0))
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    lengths = lengths.astype(jnp.int32)
    cost = page_walk_cost(
        walks=batch,
        rows=group,
        pages=padded_pages,
        kv_heads=kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        kv_itemsize=jnp.dtype(k_pages.dtype).itemsize,
        softcap=softcap,
        other_bytes=2 * nbytes(q) + nbytes(lengths, page_tables),  # q in, out (q's shape and dtype)
    )
    out = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            scale=scale,
            softcap=softcap,
            padded_pages=padded_pages,
            precision=dot_precision(q.dtype),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, kv_heads),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), q.dtype),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxserve_paged_decode_tpu",
    )(
        lengths,
        page_tables.reshape(-1),
        jnp.stack([jnp.asarray(window, jnp.int32).reshape(()), layer]),
        q.reshape(batch, kv_heads, group, head_dim),
        k_pages,
        v_pages,
    )
    return out.reshape(batch, q_heads, head_dim)
