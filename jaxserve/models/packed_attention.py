"""Attention over several sequences packed into one row, for prefill-only work (classification).

A classification step concatenates its inputs into one [tokens] row, each with its own segment id
and positions restarting at the model's first position, instead of padding a [batch, longest]
matrix: one static shape per token-count bucket serves any mix of lengths, and padding is only the
tail of the bucket. A query sees the keys of its own segment only (causally for decoders, all of
them for BERT-style encoders); padding rows have segment -1 and see nothing.

Scores are [heads, queries, keys], so a long bucket attends in query blocks: the largest bucket
(the whole context, tens of thousands of tokens for some decoders) must not materialise a
[tokens x tokens] float32 matrix per head at once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.models.decoder import grouped_attention

Array = jax.Array

QUERY_BLOCK = 512  # queries per block once a step has more than this many tokens


@struct.dataclass
class PackedAttention:
    """An AttentionFn for one packed row. segments, positions: [tokens] int32 (segment -1 = padding).
    `window` (per layer, 0 = full) limits a query at position p to keys at p - window + 1 .. p.
    max_segment, the longest a segment can be, lets a query block read only the keys its segments
    can reach instead of the whole row."""

    segments: Array  # [t]
    positions: Array  # [t]
    causal: bool = struct.field(pytree_node=False)
    scale: float = struct.field(pytree_node=False)
    softcap: float | None = struct.field(pytree_node=False, default=None)
    max_segment: int | None = struct.field(pytree_node=False, default=None)

    def _mask(self, q_seg: Array, q_pos: Array, k_seg: Array, k_pos: Array, window: Array) -> Array:
        m = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] >= 0)  # [tq, tk]
        if self.causal:
            # Positions rise inside a segment, so comparing positions is comparing order.
            m &= k_pos[None, :] <= q_pos[:, None]
            m &= (window == 0) | (q_pos[:, None] - k_pos[None, :] < window)
        return m

    def __call__(self, q: Array, k: Array, v: Array, cache: Any, window: Array, layer: Array) -> tuple[Array, Any]:
        seg, pos, scale, softcap = self.segments, self.positions, self.scale, self.softcap
        t = seg.shape[0]
        if t <= QUERY_BLOCK:
            return grouped_attention(q, k, v, self._mask(seg, pos, seg, pos, window)[None], scale, softcap), cache
        block = QUERY_BLOCK
        blocks = -(-t // block)
        pad = blocks * block - t
        hq, d = q.shape[2], q.shape[3]
        qb = jnp.pad(q[0], ((0, pad), (0, 0), (0, 0))).reshape(blocks, block, hq, d)
        sb = jnp.pad(seg, (0, pad), constant_values=-1).reshape(blocks, block)
        pb = jnp.pad(pos, (0, pad)).reshape(blocks, block)
        # Keys a block's queries can reach: their segments start at most max_segment - 1 tokens
        # before the block and (unless causal) end at most max_segment - 1 tokens after it.
        max_segment = self.max_segment
        reach = t if max_segment is None else block + (max_segment - 1) * (1 if self.causal else 2)
        span = min(t, reach)

        def one(args: tuple[Array, Array, Array, Array]) -> Array:
            qi, si, pi, index = args
            start = jnp.clip(index * block - (0 if span == t else max_segment - 1), 0, t - span)
            ki, vi = (jax.lax.dynamic_slice_in_dim(x, start, span, axis=1) for x in (k, v))
            ks, kp = (jax.lax.dynamic_slice_in_dim(x, start, span) for x in (seg, pos))
            return grouped_attention(qi[None], ki, vi, self._mask(si, pi, ks, kp, window)[None], scale, softcap)[0]

        out = jax.lax.map(one, (qb, sb, pb, jnp.arange(blocks)))  # [blocks, block, hq, d]
        return out.reshape(blocks * block, hq, d)[:t][None], cache
