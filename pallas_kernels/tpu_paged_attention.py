"""Pallas TPU (Mosaic) decode paged attention, with the reference's signature.

Grid `(batch, kv_heads)`; the lengths, the flattened page tables and the window are scalar-prefetched
into SMEM (`PrefetchScalarGridSpec`), so each program knows its pages before it starts. The K/V pages
stay in HBM (`memory_space=ANY`); a program walks its sequence's visible pages in blocks of
`pages_per_block`, copying each page with its own DMA into a two-slot VMEM scratch: while block i
is being computed, block i + 1 is already in flight (double buffering). Every DMA goes from
`pages.at[head, page]` to `buffer.at[slot, j]` — whole refs indexed, never reshaped (reshaped refs
feeding DMAs break TPU interpret mode); the reshape to `[block_k, head_dim]` is on the loaded value.

Only the blocks a row can see are copied: from the first key of the sliding window to the last
written token, so a step reads the pages it uses, not `max_pages_per_seq`. A program's query rows
are the kv head's `group` query heads, one matmul per block with an exact online softmax in float32.

Correct in TPU interpret mode (`pltpu.InterpretParams`, out-of-bounds reads raising, NaN-filled
uninitialised memory), which is how CI tests it. Not yet run or timed on a TPU: block sizes
(`pages_per_block`), megacore splitting and whether to prefetch the next program's first block (as
jax's own kernel does) are for measurement there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import MASK_VALUE


def default_interpret_params() -> pltpu.InterpretParams | bool:
    """Interpret off-TPU, with out-of-bounds reads raising and uninitialised memory NaN."""
    if jax.default_backend() == "tpu":
        return False
    return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


def _decode_kernel(
    # scalar prefetch (SMEM)
    lengths_ref,  # [batch] int32
    page_tables_ref,  # [batch * padded_pages] int32
    window_ref,  # [1] int32
    # inputs
    q_ref,  # [group, head_dim] (VMEM block)
    k_pages_hbm,  # [kv_heads, num_pages, page_size, head_dim] (HBM)
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
    pages_per_block: int,
    padded_pages: int,
    precision: jax.lax.Precision,
):
    b, h = pl.program_id(0), pl.program_id(1)
    group, head_dim = q_ref.shape
    page_size = k_buf.shape[2]
    block_k = pages_per_block * page_size
    length = lengths_ref[b]
    window = window_ref[0]
    first_key = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)  # q_pos - window + 1
    first_block = first_key // block_k
    end_block = (length + block_k - 1) // block_k

    def copies(block, slot):
        """The DMAs of one block: each page of K and V into its place in the slot's buffer."""
        out = []
        for j in range(pages_per_block):
            page = page_tables_ref[b * padded_pages + block * pages_per_block + j]
            out.append(pltpu.make_async_copy(k_pages_hbm.at[h, page], k_buf.at[slot, j], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_pages_hbm.at[h, page], v_buf.at[slot, j], sems.at[1, slot]))
        return out

    def start(block, slot):
        for c in copies(block, slot):
            c.start()

    @pl.when(first_block < end_block)
    def _prefetch_first():
        start(first_block, 0)

    q = q_ref[...]

    def body(block, carry):
        acc, m, l = carry
        slot = (block - first_block) % 2

        @pl.when(block + 1 < end_block)
        def _prefetch_next():
            start(block + 1, 1 - slot)

        for c in copies(block, slot):
            c.wait()
        k = k_buf[slot].reshape(block_k, head_dim)
        v = v_buf[slot].reshape(block_k, head_dim)
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        key_pos = block * block_k + jax.lax.broadcasted_iota(jnp.int32, (group, block_k), 1)
        mask = (key_pos < length) & (key_pos >= first_key)  # key_pos <= q_pos follows from < length
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        v_pos = block * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
        v = jnp.where(v_pos < length, v, jnp.zeros((), v.dtype))  # unwritten slots may hold NaN
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        return acc * alpha + pv, m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True)

    init = (
        jnp.zeros((group, head_dim), jnp.float32),
        jnp.full((group, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((group, 1), jnp.float32),
    )
    acc, _, l = jax.lax.fori_loop(first_block, end_block, body, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def paged_decode_attention_tpu(
    q: jax.Array,  # [batch, q_heads, head_dim]
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,
    page_tables: jax.Array,  # [batch, max_pages_per_seq] int32
    lengths: jax.Array,  # [batch] int32
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    pages_per_block: int | None = None,
    interpret: pltpu.InterpretParams | bool | None = None,
) -> jax.Array:  # [batch, q_heads, head_dim]
    """Decode attention as a Pallas TPU kernel; same semantics as `paged_decode_attention_reference`.

    `pages_per_block` (static, default ~128 keys per block) sets the DMA/compute block; `interpret`
    defaults to `pltpu.InterpretParams(out_of_bounds_reads="raise")` off-TPU.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    max_pages = page_tables.shape[1]
    group = q_heads // kv_heads
    if pages_per_block is None:
        pages_per_block = max(1, 128 // page_size)
    pages_per_block = max(1, min(pages_per_block, max_pages))
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    # Padding entries are page 0: in range, and past every length, so never visible.
    page_tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))
    if interpret is None:
        interpret = default_interpret_params()
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT

    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, *_: (b, h, 0, 0))
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    out = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            scale=scale,
            softcap=softcap,
            pages_per_block=pages_per_block,
            padded_pages=padded_pages,
            precision=precision,
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
        interpret=interpret,
        name="jaxserve_paged_decode_tpu",
    )(
        lengths.astype(jnp.int32),
        page_tables.reshape(-1),
        jnp.asarray(window, jnp.int32).reshape(1),
        q.reshape(batch, kv_heads, group, head_dim),
        k_pages,
        v_pages,
    )
    return out.reshape(batch, q_heads, head_dim)
