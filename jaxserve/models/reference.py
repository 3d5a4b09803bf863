"""Greedy decoding by repeated full no-cache forwards: slow, simple, and the yardstick that the
engine's paged, batched, chunked paths are compared against token for token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.decoder import Decoder


def greedy_reference(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (exactly max_new_tokens each, EOS not special-cased)."""
    width = max(map(len, prompts)) + max_new_tokens
    width = -(-width // 64) * 64  # one compiled shape for the whole run
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
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
