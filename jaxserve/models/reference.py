"""Greedy decoding by repeated full no-cache forwards: slow, simple, and the yardstick that the
engine's paged, batched, chunked paths are compared against token for token. `greedy_choices`
checks a given continuation against the same yardstick in one forward. `RoundedKV` makes the
same forward see its keys and values as a KV cache of another dtype holds them (an 8-bit cache:
--kv-cache-dtype fp8), the yardstick for that cache."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxserve.models.decoder import Decoder, DenseAttention
from pallas_kernels import to_cache_dtype


@struct.dataclass
class RoundedKV:
    """Dense attention over keys and values rounded to a cache dtype and widened back: what a
    paged cache of that dtype hands the attention, without a cache."""

    inner: DenseAttention
    dtype: Any = struct.field(pytree_node=False)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, window: jax.Array,
                 layer: jax.Array) -> tuple[jax.Array, Any]:
        def rounded(x: jax.Array) -> jax.Array:
            return to_cache_dtype(x, self.dtype).astype(x.dtype)

        return self.inner(q, rounded(k), rounded(v), cache, window, layer)


def forward_logits(decoder: Decoder, tokens: jax.Array, kv_dtype: Any = None) -> jax.Array:
    """[t, vocab] float32 logits of one sequence's no-cache forward; with `kv_dtype`, every key and
    value rounded to it first (`RoundedKV`)."""
    tokens = jnp.asarray(tokens)
    positions = jnp.arange(tokens.shape[0])[None]
    attend = DenseAttention(positions, jnp.asarray([tokens.shape[0]]), scale=decoder.cfg.scale,
                            softcap=decoder.cfg.attn_logit_softcap)
    if kv_dtype is not None:
        attend = RoundedKV(attend, kv_dtype)
    hidden, _ = decoder.hidden_states(tokens[None], positions, attend)
    return decoder.logits(hidden)[0]


def _padded(sequences: list[list[int]], room: int) -> tuple[np.ndarray, np.ndarray, jax.Array]:
    """(tokens [b, width], lengths [b], positions [b, width]): the sequences left-aligned in a width
    of the longest plus `room`, rounded up to 64."""
    width = -(-(max(map(len, sequences)) + room) // 64) * 64
    tokens = np.zeros((len(sequences), width), np.int32)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = seq
    lengths = np.array([len(seq) for seq in sequences], np.int32)
    return tokens, lengths, jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)


def greedy_choices(decoder: Decoder, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """choices[i][j]: the no-cache forward's greedy token after prompts[i] + continuations[i][:j].

    A continuation is the greedy one exactly when it equals its own choices (by induction over j:
    each token is the argmax given the tokens before it), so one forward over the whole sequence
    (teacher forcing) checks what `greedy_reference` would decode in len(continuation) forwards.
    The causal mask makes a position's logits independent of the tokens after it; the forward runs
    at the same padded width rule as `greedy_reference` (`_padded`)."""
    tokens, lengths, positions = _padded([[*p, *c] for p, c in zip(prompts, continuations)], 0)
    graphdef, state = nnx.split(decoder)

    @jax.jit
    def argmax_everywhere(state: nnx.State, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        return jnp.argmax(nnx.merge(graphdef, state)(tokens, positions, lengths), axis=-1).astype(jnp.int32)

    best = np.asarray(argmax_everywhere(state, jnp.asarray(tokens), jnp.asarray(lengths)))
    return [best[i, len(p) - 1: len(p) - 1 + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, continuations))]


def greedy_reference(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (exactly max_new_tokens each, EOS not special-cased)."""
    tokens, lengths, positions = _padded(prompts, max_new_tokens)  # one compiled shape for the whole run
    graphdef, state = nnx.split(decoder)

    @jax.jit
    def next_tokens(state: nnx.State, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, state)
        attend_logits = model(tokens, positions, lengths)  # [b, t, vocab]
        last = jnp.take_along_axis(attend_logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return jnp.argmax(last, axis=-1).astype(jnp.int32)

    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        nxt = np.asarray(next_tokens(state, jnp.asarray(tokens), jnp.asarray(lengths)))
        for i, t in enumerate(nxt):
            out[i].append(int(t))
            tokens[i, lengths[i]] = t
        lengths = lengths + 1
    return out
