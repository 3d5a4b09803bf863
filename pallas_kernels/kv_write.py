"""Writing new K/V tokens into the paged cache.

`write_kv` is one scatter per cache; meant to run under jit with the pages donated, so XLA updates
them in place. Its triple partner is `validate_write_inputs`; the scatter is already what a kernel
would do (one row copy per token), so there is no separate Pallas variant.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import check_float, check_int, check_ndim, check_shape, concrete_or_none


def write_kv(
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    k_new: jax.Array,  # [tokens, kv_heads, head_dim]
    v_new: jax.Array,  # [tokens, kv_heads, head_dim]
    slot_mapping: jax.Array,  # [tokens] int32: page * page_size + offset, -1 = padding
) -> tuple[jax.Array, jax.Array]:
    """Returns (k_pages, v_pages) with token i written at flat slot `slot_mapping[i]`.

    Padding slots (-1) are sent to an out-of-range index and dropped by the scatter, so a padded
    bucket never touches a real page.
    """
    kv_heads, num_pages, page_size, head_dim = k_pages.shape
    num_slots = num_pages * page_size
    slots = slot_mapping.astype(jnp.int32)
    slots = jnp.where((slots < 0) | (slots >= num_slots), num_slots, slots)

    def write(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(kv_heads, num_slots, head_dim)  # a bitcast: no copy under donation
        flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return write(k_pages, k_new), write(v_pages, v_new)


def validate_write_inputs(k_pages: Any, v_pages: Any, k_new: Any, v_new: Any, slot_mapping: Any) -> None:
    """Raises ValueError naming the argument and the expected shape; slot bounds checked when concrete."""
    check_ndim("k_pages", k_pages, 4, "[num_kv_heads, num_pages, page_size, head_dim]")
    check_shape("v_pages", v_pages, k_pages.shape, "k_pages.shape [num_kv_heads, num_pages, page_size, head_dim]")
    check_float("k_pages", k_pages)
    check_float("v_pages", v_pages)
    kv_heads, num_pages, page_size, head_dim = k_pages.shape
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
