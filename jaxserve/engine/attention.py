"""The decoder's attention over the paged KV cache: write the step's new K/V, then attend.

Returns an `AttentionFn` for `Decoder.hidden_states`; the whole KVCache is carried through the
layer scan and indexed by the layer inside single scatter/gather ops.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.engine.kv_cache import KVCache
from jaxserve.models.decoder import AttentionFn


def write_layer(cache: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVCache:
    """Scatter k, v [tokens, kv_heads, head_dim] into `layer` at flat slots (-1: dropped).

    One scatter per buffer on the full (donated, loop-carried) cache, so XLA updates it in place."""
    _, _, num_pages, page_size, _ = cache.k.shape
    valid = (slots >= 0) & (slots < num_pages * page_size)
    page = jnp.where(valid, slots // page_size, num_pages)  # out of range -> dropped
    offset = jnp.where(valid, slots % page_size, 0)
    # Advanced indices (layer, page, offset) around a slice put the token axis first: [T, kv_heads, D].
    new_k = cache.k.at[layer, :, page, offset].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[layer, :, page, offset].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(new_k, new_v)


def paged_attend(
    slots: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    softcap: float | None,
    page_size: int,
    backend: str = "reference",
) -> AttentionFn:
    ragged = pallas_kernels.get_ragged_attention(backend)
    # The reference reads keys in chunks with a traced trip count that stops at the longest live
    # context; small chunks (~128 tokens) keep short contexts cheap even when max_model_len is long.
    if backend != "reference":
        # The Pallas kernels take one layer's [kv_heads, pages, page_size, head_dim]; wiring them to
        # the stacked cache (layer index as a scalar-prefetch argument) is the next step.
        raise NotImplementedError(f"attention backend {backend!r} is not wired into the engine yet; use reference")
    chunk_pages = max(1, 128 // page_size)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, window: jax.Array, layer: jax.Array):
        # q: [1, T, q_heads, D]; k, v: [1, T, kv_heads, D] (the step's tokens as one row)
        cache = write_layer(cache, layer, k[0], v[0], slots)
        out = ragged(
            q[0], cache.k, cache.v, page_tables, cu_q_lens, kv_lens, num_seqs,
            scale=scale, softcap=softcap, window=window, chunk_pages=chunk_pages, layer=layer,
        )
        return out[None], cache

    return attend
