"""`write_kv`'s TPU form (one head_dim row per token and kv head), which only a TPU lowering takes,
writes exactly what the default form (one [kv_heads, head_dim] window per token) writes. Runs on
the CPU, with or without libtpu."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import write_kv
from pallas_kernels.kv_write import scatter_head_rows, scatter_tokens


def test_tpu_row_scatter_equals_the_token_scatter():
    layers, kv_heads, num_pages, page_size, head_dim = 3, 4, 5, 4, 8
    rng = np.random.default_rng(0)
    pages = jnp.asarray(rng.standard_normal((layers, kv_heads, num_pages, page_size, head_dim)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((7, kv_heads, head_dim)), jnp.float32)
    slots = np.array([3, 17, -1, 0, 19, -1, 8], np.int32)  # -1: padding, dropped
    page = jnp.asarray(np.where(slots >= 0, slots // page_size, num_pages), jnp.int32)
    offset = jnp.asarray(np.where(slots >= 0, slots % page_size, 0), jnp.int32)
    layer = jnp.int32(1)
    by_rows = jax.jit(scatter_head_rows)(pages, new, layer, page, offset)
    by_tokens = jax.jit(scatter_tokens)(pages, new, layer, page, offset)
    np.testing.assert_array_equal(np.asarray(by_rows), np.asarray(by_tokens))
    # and both are what write_kv (the default form off TPU) returns
    k_out, _ = write_kv(pages, pages, new, new, jnp.asarray(slots), layer=layer)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(by_tokens))
    expected = np.asarray(pages).copy()
    for t, s in enumerate(slots):
        if s >= 0:
            expected[1, :, s // page_size, s % page_size] = np.asarray(new[t])
    np.testing.assert_array_equal(np.asarray(by_rows), expected)
