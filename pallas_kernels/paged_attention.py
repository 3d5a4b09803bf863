"""Decode paged attention: one query token per sequence over the paged KV cache.

Exports the triple every kernel module has:

- `paged_decode_attention_reference` — pure jnp, jit-friendly, the CPU fallback and the oracle
  that the kernels are tested against;
- `validate_decode_inputs` — shapes, dtypes, head divisibility, page-table bounds (when concrete);
- `paged_decode_attention` — the Pallas kernels, selected by backend name ("pallas_gpu" ->
  `gpu_paged_attention`, "pallas_tpu" -> `tpu_paged_attention`).

Semantics shared by all of them: `lengths[b]` counts the valid KV tokens of sequence b *including*
the current one (already written into the pages), so the query sits at position `lengths[b] - 1`;
q head h reads kv head `h // (q_heads // kv_heads)`; logits are `q.k * scale`, optionally soft-capped
as `tanh(s / softcap) * softcap`; key position k is visible iff `k <= qpos` and
(`window == 0` or `qpos - k < window`). Softmax is float32, the output has q's dtype, and a row of
length 0 (padding) returns zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import (
    attend_items,
    check_int,
    check_layer_arg,
    check_shape,
    chunk_pages_for,
    concrete_or_none,
    select_kernel,
    validate_cache,
    validate_options,
    validate_page_tables,
)

# Backend -> (module, function) of the Pallas decode kernels, imported only when selected.
PALLAS_KERNELS = {
    "pallas_gpu": ("pallas_kernels.gpu_paged_attention", "paged_decode_attention_gpu"),
    "pallas_tpu": ("pallas_kernels.tpu_paged_attention", "paged_decode_attention_tpu"),
    "cpu": ("pallas_kernels.cpu_attention", "paged_decode_attention_cpu"),  # native, not Pallas
}


def paged_decode_attention_reference(
    q: jax.Array,  # [batch, q_heads, head_dim]
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    page_tables: jax.Array,  # [batch, max_pages_per_seq] int32
    lengths: jax.Array,  # [batch] int32
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    chunk_pages: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:  # [batch, q_heads, head_dim]
    """Pure-jnp decode attention; `chunk_pages` (static) sets how many pages are read per step of
    the online softmax (default: about CHUNK_BYTES of intermediates; `max_pages_per_seq` = one dense
    pass). With `layer` (an int32 scalar, may be traced), k_pages/v_pages are the engine's stacked
    cache [layers, kv_heads, num_pages, page_size, head_dim] and only that layer is read."""
    batch, q_heads, head_dim = q.shape
    check_layer_arg(k_pages, layer)
    kv_heads, _, page_size, _ = k_pages.shape[-4:]  # [layers,] kv_heads, pages, page_size, head_dim
    lengths = lengths.astype(jnp.int32)
    if chunk_pages is None:
        chunk_pages = chunk_pages_for(batch, 1, q_heads, kv_heads, head_dim, page_size)
    out = attend_items(
        q.reshape(batch, 1, kv_heads, q_heads // kv_heads, head_dim),
        k_pages,
        v_pages,
        page_tables,
        lengths,
        (lengths - 1)[:, None],
        (lengths > 0)[:, None],
        scale=scale,
        softcap=softcap,
        window=window,
        chunk_pages=chunk_pages,
        layer=layer,
    )
    return out.reshape(batch, q_heads, head_dim).astype(q.dtype)


def validate_decode_inputs(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_tables: Any,
    lengths: Any,
    *,
    softcap: float | None = None,
    window: Any = 0,
    layer: Any = None,
) -> None:
    """Raises ValueError naming the argument and the expected shape when the inputs are inconsistent.

    Value checks (page ids in [0, num_pages), 0 <= lengths <= max_pages_per_seq * page_size) run only
    on concrete arrays; under jit only the static checks apply.
    """
    _, _, num_pages, page_size, _ = validate_cache(q, k_pages, v_pages, "[batch, q_heads, head_dim]", layer)
    batch = q.shape[0]
    validate_page_tables(page_tables, batch, num_pages, "batch")
    check_int("lengths", lengths)
    check_shape("lengths", lengths, (batch,), "[batch]")
    validate_options(softcap, window)
    max_kv = page_tables.shape[1] * page_size
    lens = concrete_or_none(lengths)
    if lens is not None and lens.size and (lens.min() < 0 or lens.max() > max_kv):
        b = int(np.argmax((lens < 0) | (lens > max_kv)))
        raise ValueError(
            f"lengths[{b}] = {lens[b]} is out of range [0, {max_kv}] "
            f"(max_pages_per_seq {page_tables.shape[1]} x page_size {page_size})"
        )


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
    backend: str = "pallas_gpu",
    **kernel_options: Any,
) -> jax.Array:
    """The Pallas decode kernel of `backend` ("pallas_gpu" or "pallas_tpu"), reference signature."""
    kernel = select_kernel(backend, paged_decode_attention_reference, PALLAS_KERNELS)
    return kernel(
        q, k_pages, v_pages, page_tables, lengths,
        scale=scale, softcap=softcap, window=window, layer=layer, **kernel_options,
    )  # fmt: skip
