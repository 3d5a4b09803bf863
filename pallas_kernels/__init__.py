"""Paged attention over jaxserve's paged KV cache: pure-jnp references, validators, Pallas kernels
(GPU, TPU) and a native CPU kernel (`cpu_attention`, an XLA FFI call).

KV cache layout (the engine follows it): separate K and V arrays, each
`[num_kv_heads, num_pages, page_size, head_dim]` per layer; token t of sequence b is at page
`page_tables[b, t // page_size]`, slot `t % page_size`. Unused page-table entries may hold any
in-range page id and unused pages may hold NaN; neither ever reaches a result. The engine keeps all
layers in one `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` array per K and V; every
function here also takes that stack with `layer=` (an int32 scalar, traced inside the engine's layer
scan) and reads that layer's pages in place, never slicing the layer out (which would copy it).

`get_decode_attention(backend)` / `get_ragged_attention(backend)` return a callable with the
reference's signature for backend in {"reference", "pallas_gpu", "pallas_tpu", "cpu"}, and
`get_kv_write(backend)` the cache write that goes with it. Kernel modules are imported only when
asked for, so the CPU serving path never imports Pallas.
"""

from __future__ import annotations

from collections.abc import Callable

from pallas_kernels._common import select_kernel, to_cache_dtype
from pallas_kernels.kv_write import validate_write_inputs, write_kv
from pallas_kernels.paged_attention import PALLAS_KERNELS as _DECODE_KERNELS
from pallas_kernels.paged_attention import paged_decode_attention_reference, validate_decode_inputs
from pallas_kernels.ragged_paged_attention import PALLAS_KERNELS as _RAGGED_KERNELS
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference, validate_ragged_inputs

BACKENDS = ("reference", "pallas_gpu", "pallas_tpu", "cpu")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")


def get_decode_attention(backend: str) -> Callable[..., object]:
    """Decode attention for `backend`, called as `f(q, k_pages, v_pages, page_tables, lengths, *, scale,
    softcap=None, window=0, layer=None)`."""
    _check_backend(backend)
    return select_kernel(backend, paged_decode_attention_reference, _DECODE_KERNELS)


def get_ragged_attention(backend: str) -> Callable[..., object]:
    """Ragged (prefill/decode) attention for `backend`, called as `f(q, k_pages, v_pages, page_tables,
    cu_q_lens, kv_lens, num_seqs, *, scale, softcap=None, window=0, layer=None)`."""
    _check_backend(backend)
    return select_kernel(backend, ragged_paged_attention_reference, _RAGGED_KERNELS)


def get_kv_write(backend: str) -> Callable[..., object]:
    """The cache write for `backend`, called as `write_kv`: the "cpu" backend's native in-place write
    (XLA:CPU has no float8 scatter, and scattering a float8 cache's bytes copies it twice per
    layer), XLA's scatter for every other backend (on a TPU or a GPU, an in-place row copy)."""
    _check_backend(backend)
    if backend == "cpu":
        from pallas_kernels.cpu_kv_write import write_kv_cpu

        return write_kv_cpu
    return write_kv


__all__ = [
    "BACKENDS",
    "get_decode_attention",
    "get_kv_write",
    "get_ragged_attention",
    "paged_decode_attention_reference",
    "ragged_paged_attention_reference",
    "to_cache_dtype",
    "validate_decode_inputs",
    "validate_ragged_inputs",
    "validate_write_inputs",
    "write_kv",
]
