"""Ragged paged attention: prefill, chunked prefill and decode of many sequences in one call.

The new query tokens of all sequences are concatenated into `q [total_tokens, q_heads, head_dim]`
(padded at the end to a bucket size); `cu_q_lens [max_seqs + 1]` holds their cumulative lengths,
`kv_lens [max_seqs]` the total KV length of each sequence including its new tokens (already written
into the pages), and `num_seqs` (a traced int32 scalar) how many sequences are real. Query i of
sequence b sits at position `kv_lens[b] - q_len_b + i` and attends causally, with the softcap and
sliding-window rules of `paged_attention`. Rows at or beyond `cu_q_lens[num_seqs]` are padding and
return zeros.

Exports `ragged_paged_attention_reference` (pure jnp, the oracle and CPU fallback), `validate_ragged_inputs`
and `ragged_paged_attention` (the Pallas kernel of a backend: `gpu_ragged_attention` or
`tpu_ragged_attention`, same signature). The new K/V are written first with `kv_write.write_kv`.

How the reference stays cheap: materialising each token's keys ([tokens, max_kv, ...]) or scoring
every token against every sequence ([tokens, batch, max_kv]) would both be far too big for a
512-token prefill chunk. Instead the tokens of each sequence are cut into blocks of `q_block` rows
("work items"); an item reads its one sequence's pages once, and the number of items is bounded by
`total_tokens / q_block + max_seqs`, so the gathered KV is proportional to the work. Items run
vectorised; keys are read in page chunks with an online softmax (`_common.attend_items`), only as
far as the longest live sequence, so memory stays bounded and short contexts cost little.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import (
    attend_items,
    check_int,
    check_layer_arg,
    check_ndim,
    check_shape,
    chunk_pages_for,
    concrete_or_none,
    select_kernel,
    validate_cache,
    validate_options,
    validate_page_tables,
)

# Backend -> (module, function) of the Pallas ragged kernels, imported only when selected.
PALLAS_KERNELS = {
    "pallas_gpu": ("pallas_kernels.gpu_ragged_attention", "ragged_paged_attention_gpu"),
    "pallas_tpu": ("pallas_kernels.tpu_ragged_attention", "ragged_paged_attention_tpu"),
    "cpu": ("pallas_kernels.cpu_attention", "ragged_paged_attention_cpu"),  # native, not Pallas
}


def default_q_block(total_tokens: int, max_seqs: int) -> int:
    """Rows per work item: about the mean tokens per sequence, a power of two in [1, 64].

    Decode buckets (one token per sequence) get 1, so no row is wasted; prefill buckets get larger
    blocks, so each item's page gather is amortised over many query rows.
    """
    mean = -(-total_tokens // max(max_seqs, 1))
    return int(min(64, 1 << max(0, (mean - 1).bit_length())))


def max_work_items(total_tokens: int, max_seqs: int, q_block: int) -> int:
    # sum_b ceil(L_b / q_block) <= (sum_b L_b + n * (q_block - 1)) / q_block, and an item has >= 1 token.
    return max(1, min(total_tokens, (total_tokens + max_seqs * (q_block - 1)) // q_block))


class WorkItems(NamedTuple):
    """The static-size work list of a ragged batch: item w is up to `q_block` consecutive query rows
    of one sequence. Items past the real count are dead (no rows, kv_len 0)."""

    seq: jax.Array  # [items] int32 sequence of each item
    token: jax.Array  # [items] int32 flat q row of the item's first row
    row0: jax.Array  # [items] int32 index of the first row within its sequence's new tokens
    q_len: jax.Array  # [items] int32 the sequence's number of new tokens (0 for dead items)
    kv_len: jax.Array  # [items] int32 the sequence's KV length (0 for dead items)
    token_item: jax.Array  # [total_tokens] int32 item that computes each token
    token_row: jax.Array  # [total_tokens] int32 row of the token within that item
    token_ok: jax.Array  # [total_tokens] bool: a real token (not padding)


def plan_work_items(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array | int, *, total_tokens: int, q_block: int
) -> WorkItems:
    """Cuts every sequence's new tokens into blocks of `q_block` rows (jit-friendly, static sizes)."""
    max_seqs = kv_lens.shape[0]
    tq = q_block
    num_items = max_work_items(total_tokens, max_seqs, tq)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    live = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs
    q_start = cu_q_lens[:-1]
    q_lens = jnp.where(live, cu_q_lens[1:] - q_start, 0)  # entries past num_seqs may be garbage

    items_per_seq = (q_lens + tq - 1) // tq  # sequence b owns ceil(q_len_b / tq) consecutive items
    item_end = jnp.cumsum(items_per_seq)
    item_begin = item_end - items_per_seq
    item = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(item_end, item, side="right").astype(jnp.int32), max_seqs - 1)
    item_live = item < item_end[-1]
    row0 = (item - item_begin[seq]) * tq

    t = jnp.arange(total_tokens, dtype=jnp.int32)
    bounds = jnp.where(jnp.arange(max_seqs + 1) <= num_seqs, cu_q_lens, jnp.iinfo(jnp.int32).max)
    t_seq = jnp.clip(jnp.searchsorted(bounds, t, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1)
    local = t - q_start[t_seq]
    return WorkItems(
        seq=seq,
        token=jnp.where(item_live, q_start[seq] + row0, 0),
        row0=row0,
        q_len=jnp.where(item_live, q_lens[seq], 0),
        kv_len=jnp.where(item_live, kv_lens[seq], 0),
        token_item=jnp.clip(item_begin[t_seq] + local // tq, 0, num_items - 1),
        token_row=jnp.clip(local % tq, 0, tq - 1),
        token_ok=(t < cu_q_lens[jnp.clip(num_seqs, 0, max_seqs)]) & live[t_seq],
    )


def ragged_paged_attention_reference(
    q: jax.Array,  # [total_tokens, q_heads, head_dim]
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    page_tables: jax.Array,  # [max_seqs, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    kv_lens: jax.Array,  # [max_seqs] int32
    num_seqs: jax.Array | int,  # int32 scalar
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    q_block: int | None = None,
    chunk_pages: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:  # [total_tokens, q_heads, head_dim]
    """Pure-jnp ragged attention. `q_block` (static): query rows per work item (default from the
    bucket shape); `chunk_pages` (static): pages per online-softmax step (default: bounded memory).
    With `layer` (a traced int32), k_pages/v_pages are the engine's whole stacked cache [layers,
    kv_heads, num_pages, page_size, head_dim] and only that layer is read."""
    total, q_heads, head_dim = q.shape
    check_layer_arg(k_pages, layer)
    kv_heads, _, page_size, _ = k_pages.shape[-4:]  # [layers,] kv_heads, pages, page_size, head_dim
    max_seqs = page_tables.shape[0]
    tq = q_block or default_q_block(total, max_seqs)
    w = plan_work_items(cu_q_lens, kv_lens, num_seqs, total_tokens=total, q_block=tq)
    num_items = w.seq.shape[0]
    row = w.row0[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]  # [items, tq]
    token = jnp.clip(w.token[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :], 0, total - 1)

    if chunk_pages is None:
        chunk_pages = chunk_pages_for(num_items, tq, q_heads, kv_heads, head_dim, page_size)
    item_out = attend_items(
        q[token].reshape(num_items, tq, kv_heads, q_heads // kv_heads, head_dim),
        k_pages,
        v_pages,
        page_tables[w.seq],
        w.kv_len,
        (w.kv_len - w.q_len)[:, None] + row,
        row < w.q_len[:, None],
        scale=scale,
        softcap=softcap,
        window=window,
        chunk_pages=chunk_pages,
        layer=layer,
    ).reshape(num_items, tq, q_heads, head_dim)

    out = item_out[w.token_item, w.token_row]  # each real token reads its row back from its item
    return jnp.where(w.token_ok[:, None, None], out, 0.0).astype(q.dtype)


def validate_ragged_inputs(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_tables: Any,
    cu_q_lens: Any,
    kv_lens: Any,
    num_seqs: Any,
    *,
    softcap: float | None = None,
    window: Any = 0,
    layer: Any = None,
) -> None:
    """Raises ValueError naming the argument and the expected shape when the inputs are inconsistent.

    Value checks (page ids, cu_q_lens monotone from 0 and within total_tokens, q_len <= kv_len <=
    max_pages_per_seq * page_size, 0 <= num_seqs <= max_seqs) run only on concrete arrays.
    """
    _, _, num_pages, page_size, _ = validate_cache(q, k_pages, v_pages, "[total_tokens, q_heads, head_dim]", layer)
    total = q.shape[0]
    check_ndim("kv_lens", kv_lens, 1, "[max_seqs]")
    check_int("kv_lens", kv_lens)
    max_seqs = kv_lens.shape[0]
    validate_page_tables(page_tables, max_seqs, num_pages, "max_seqs")
    check_ndim("cu_q_lens", cu_q_lens, 1, "[max_seqs + 1]")
    check_int("cu_q_lens", cu_q_lens)
    check_shape("cu_q_lens", cu_q_lens, (max_seqs + 1,), "[max_seqs + 1]")
    if jnp.ndim(num_seqs) != 0 or not jnp.issubdtype(jnp.result_type(num_seqs), jnp.integer):
        raise ValueError(f"num_seqs must be an integer scalar, got {num_seqs!r}")
    validate_options(softcap, window)

    n, cu, kv = concrete_or_none(num_seqs), concrete_or_none(cu_q_lens), concrete_or_none(kv_lens)
    if n is None:
        return
    n = int(n)
    if not 0 <= n <= max_seqs:
        raise ValueError(f"num_seqs = {n} is out of range [0, {max_seqs}] (max_seqs = kv_lens.shape[0])")
    if cu is not None:
        cu = cu[: n + 1].astype(np.int64)
        if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > total:
            raise ValueError(
                f"cu_q_lens[:num_seqs + 1] must start at 0, never decrease and end <= total_tokens ({total}), "
                f"got {cu.tolist()}"
            )
    max_kv = page_tables.shape[1] * page_size
    if kv is not None:
        kv = kv[:n].astype(np.int64)
        if kv.size and (kv.min() < 0 or kv.max() > max_kv):
            b = int(np.argmax((kv < 0) | (kv > max_kv)))
            raise ValueError(
                f"kv_lens[{b}] = {kv[b]} is out of range [0, {max_kv}] "
                f"(max_pages_per_seq {page_tables.shape[1]} x page_size {page_size})"
            )
        if cu is not None and np.any(np.diff(cu) > kv):
            b = int(np.argmax(np.diff(cu) > kv))
            raise ValueError(
                f"sequence {b} has {np.diff(cu)[b]} query tokens but kv_lens[{b}] = {kv[b]}: "
                "kv_lens must include the new tokens"
            )


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
    backend: str = "pallas_gpu",
    **kernel_options: Any,
) -> jax.Array:
    """The Pallas ragged kernel of `backend` ("pallas_gpu" or "pallas_tpu"), reference signature."""
    kernel = select_kernel(backend, ragged_paged_attention_reference, PALLAS_KERNELS)
    return kernel(
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
        **kernel_options,
    )
