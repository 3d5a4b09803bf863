"""Writing new K/V tokens into the paged cache.

`write_kv` is one scatter per cache (one layer's pages, or the engine's stacked cache with `layer`);
meant to run under jit with the pages donated (or loop-carried), so XLA updates them in place. Its
triple partner is `validate_write_inputs`; the scatter is already what a kernel would do (one row
copy per token), so there is no separate Pallas variant. Whether fusing the write into the ragged
kernel pays is for the H100 (`benchmarks/kernels.py` times `write_kv` beside the kernels).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import (
    PAGES_SHAPE,
    check_float,
    check_int,
    check_layer_arg,
    check_ndim,
    check_shape,
    concrete_or_none,
    is_8bit_float,
    stacked_cache,
    to_cache_dtype,
    validate_layer,
)


def write_kv(
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    k_new: jax.Array,  # [tokens, kv_heads, head_dim]
    v_new: jax.Array,  # [tokens, kv_heads, head_dim]
    slot_mapping: jax.Array,  # [tokens] int32: page * page_size + offset, -1 = padding
    *,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Returns (k_pages, v_pages) with token i written at flat slot `slot_mapping[i]` (of `layer`,
    when the pages are the engine's stacked [layers, ...] cache).

    Padding slots (-1) are sent to an out-of-range page and dropped by the scatter, so a padded
    bucket never touches a real page. The scatter indexes (layer, page, offset) directly rather than
    reshaping pages x page_size into flat slots: on a TPU that reshape crosses the tiled minor
    dimensions and could cost a copy of the whole cache.
    """
    stacked, v_stacked, layer = stacked_cache(k_pages, v_pages, layer)
    num_pages, page_size = stacked.shape[2], stacked.shape[3]
    slots = slot_mapping.astype(jnp.int32)
    valid = (slots >= 0) & (slots < num_pages * page_size)
    page = jnp.where(valid, slots // page_size, num_pages)  # out of range -> dropped
    offset = jnp.where(valid, slots % page_size, 0)

    def write(pages: jax.Array, new: jax.Array) -> jax.Array:
        # TPU: with windows [kv_heads, head_dim] that are not contiguous in the cache, XLA:TPU
        # scatters 1024 tokens or more by transposing the whole cache to [layers, pages, page_size,
        # kv_heads, head_dim] and back: two copies of a 4 GiB cache per layer's prefill write, a
        # 4 GiB temporary (v5e/v6e, libtpu 0.0.48; tests/tpu_aot). Scattering head_dim rows keeps
        # every scattered dim major to the window, a plain row scatter done in place at any token
        # count. XLA:CPU (the CPU serving path) is 2-4x slower on rows than on whole tokens, so the
        # row form is for TPU only.
        new = to_cache_dtype(new, pages.dtype)
        cpu = scatter_bytes if is_8bit_float(pages.dtype) else scatter_tokens
        return jax.lax.platform_dependent(pages, new, layer, page, offset, tpu=scatter_head_rows, cpu=cpu,
                                          default=scatter_tokens)

    k_out, v_out = write(stacked, k_new), write(v_stacked, v_new)
    if len(k_pages.shape) == 4:
        return k_out[0], v_out[0]
    return k_out, v_out


def scatter_tokens(pages: jax.Array, new: jax.Array, layer: jax.Array, page: jax.Array, offset: jax.Array) -> jax.Array:
    """`new` [T, kv_heads, head_dim] into the stacked `pages` at (layer, page[t], offset[t]), one
    [kv_heads, head_dim] window per token; out-of-range pages are dropped."""
    # Advanced indices (layer, page, offset) around a slice put the token axis first: [T, kv_heads, D].
    return pages.at[layer, :, page, offset].set(new, mode="drop")


def scatter_bytes(pages: jax.Array, new: jax.Array, layer: jax.Array, page: jax.Array, offset: jax.Array) -> jax.Array:
    """`scatter_tokens` of an 8-bit float cache, done on its bytes. XLA:CPU has no float8 scatter:
    its float normalization widened the whole cache to float16 around every layer's write (two
    copies of the cache per layer). An integer scatter is native. The CPU's form only: XLA:TPU
    scatters float8 in place, and there the byte view costs a copy of the cache (tests/tpu_aot);
    on a GPU it is unmeasured."""
    raw = scatter_tokens(jax.lax.bitcast_convert_type(pages, jnp.uint8), jax.lax.bitcast_convert_type(new, jnp.uint8),
                         layer, page, offset)
    return jax.lax.bitcast_convert_type(raw, pages.dtype)


def scatter_head_rows(
    pages: jax.Array, new: jax.Array, layer: jax.Array, page: jax.Array, offset: jax.Array
) -> jax.Array:
    """What `scatter_tokens` does, as one head_dim row per (token, kv head): the TPU form."""
    heads = jnp.arange(pages.shape[1], dtype=jnp.int32)[None, :]  # indices broadcast to [T, kv_heads]
    return pages.at[layer, heads, page[:, None], offset[:, None]].set(new, mode="drop")


def validate_write_inputs(
    k_pages: Any, v_pages: Any, k_new: Any, v_new: Any, slot_mapping: Any, *, layer: Any = None
) -> None:
    """Raises ValueError naming the argument and the expected shape; slot bounds checked when concrete."""
    if not hasattr(k_pages, "shape") or len(k_pages.shape) not in (4, 5):
        check_ndim("k_pages", k_pages, 4, PAGES_SHAPE)
    check_shape("v_pages", v_pages, k_pages.shape, f"k_pages.shape {PAGES_SHAPE}")
    check_layer_arg(k_pages, layer)
    check_float("k_pages", k_pages)
    check_float("v_pages", v_pages)
    if layer is not None:
        validate_layer(layer, k_pages.shape[0])
    kv_heads, num_pages, page_size, head_dim = k_pages.shape[-4:]
    check_ndim("slot_mapping", slot_mapping, 1, "[tokens]")
    check_int("slot_mapping", slot_mapping)
    tokens = slot_mapping.shape[0]
    for name, new in (("k_new", k_new), ("v_new", v_new)):
        check_ndim(name, new, 3, "[tokens, num_kv_heads, head_dim]")
        check_shape(name, new, (tokens, kv_heads, head_dim), "[tokens, num_kv_heads, head_dim]")
        check_float(name, new)
    slots = concrete_or_none(slot_mapping)
    num_slots = num_pages * page_size
    if slots is not None and slots.size:
        bad = (slots < -1) | (slots >= num_slots)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"slot_mapping[{i}] = {slots[i]} is out of range: expected -1 (padding) or a slot in "
                f"[0, {num_slots}) (num_pages {num_pages} x page_size {page_size})"
            )
        real = slots[slots >= 0]
        if np.unique(real).size != real.size:
            raise ValueError("slot_mapping writes the same slot twice; each real token needs its own slot")
