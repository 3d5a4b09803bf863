"""Paged attention on the CPU through a native kernel (`cpu_attention.cc`, an XLA FFI custom call).

The CPU counterpart of the Pallas kernels: same signatures and semantics as
`ragged_paged_attention_reference` / `paged_decode_attention_reference` (it is tested against
them), backend name "cpu". XLA:CPU runs the pure-jnp references' page gathers as per-element loops
and writes the gathered keys and values out, widened to float32, before the products read them:
on SmolLM2 with 16 sequences that was ~20 ms of a ~50 ms decode step. The kernel reads each
page row once, straight from the cache, for a whole group of query heads and a block of query rows.
An 8-bit cache (`--kv-cache-dtype fp8*`) is read as stored and widened exactly in the kernel, under
float32 or bfloat16 queries: half the bytes of a bfloat16 cache per step.

The source is compiled on first use for this machine (`native.build`). `available()` says
whether that worked; without a compiler the engine's "auto" backend stays on the reference (with a warning),
and `--attention-backend cpu` fails with the compiler's message.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels._common import stacked_cache
from pallas_kernels.cpu_matmul import TIERS, target_name
from pallas_kernels.native import BuildError
from pallas_kernels.paged_attention import paged_decode_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

log = logging.getLogger("jaxserve.kernels")

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "jaxserve_cpu_paged_attention"
# What the kernel computes; anything else goes to the pure-jnp reference (same results, slower).
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 192, 256)
DTYPES = (jnp.float32, jnp.bfloat16)  # of the queries and the output, and of a cache like them
# An 8-bit cache (`--kv-cache-dtype fp8*`, scale 1.0) under queries of either DTYPES: the kernel
# widens its elements exactly as it reads them, which is what the references' float32 upcast does.
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


# The kernel's builds are the products' (cpu_matmul.TIERS): "native" is what serving uses, the best
# code for this CPU; "avx2" is the AVX2 + FMA code even where AVX512-BF16 exists (its own FFI
# target, suffixed "_avx2"), so that the tests run it there too.
ISA_NAMES = {2: "AVX512-BF16", 1: "AVX2", 0: "generic"}  # JaxserveAttentionIsa() -> name


@functools.cache
def _register(tier: str = "native") -> None:
    """Build (or find) the kernel and register it with XLA once per process; raises BuildError."""
    lib = native.load(SOURCE, TIERS[tier])
    jax.ffi.register_ffi_target(target_name(TARGET, tier), jax.ffi.pycapsule(lib.JaxservePagedAttention),
                                platform="cpu")


def ensure_built(tier: str = "native") -> None:
    """Build and register the kernel now; raises BuildError (with the compiler's message) if it can't."""
    _register(tier)


def isa(tier: str = "native") -> str:
    """The code that build `tier` runs its tasks on here: "AVX512-BF16" (bfloat16 queries; float32
    ones run the generic code), "AVX2" or "generic". Raises BuildError."""
    return ISA_NAMES[native.load(SOURCE, TIERS[tier]).JaxserveAttentionIsa()]


@functools.cache
def available() -> bool:
    """Whether the native kernel builds and loads here (logs why not, once)."""
    try:
        _register()
        return True
    except BuildError as e:
        log.warning("native CPU attention unavailable, using the pure-jnp reference: %s", e)
        return False


def supports(head_dim: int, dtype: Any, q_dtype: Any = None) -> bool:
    """Whether the kernel computes this head_dim and cache dtype under queries of `q_dtype` (None:
    any it takes): queries of the cache's own dtype, float32 / bfloat16 ones over a float8 cache,
    or float32 ones over a bfloat16 cache (each widened as it is read). Else the reference does."""
    if head_dim not in HEAD_DIMS:
        return False
    dtype = jnp.dtype(dtype)
    if dtype in map(jnp.dtype, FP8_DTYPES):
        return q_dtype is None or jnp.dtype(q_dtype) in map(jnp.dtype, DTYPES)
    if q_dtype is not None and jnp.dtype(q_dtype) == jnp.float32 and dtype == jnp.bfloat16:
        return True
    return dtype in map(jnp.dtype, DTYPES) and (q_dtype is None or jnp.dtype(q_dtype) == dtype)


def _call(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array, cu_q_lens: jax.Array,
          kv_lens: jax.Array, num_seqs: Any, *, scale: float, softcap: float | None, window: Any,
          layer: Any, tier: str = "native") -> jax.Array:
    _register(tier)
    k_pages, v_pages, layer = stacked_cache(k_pages, v_pages, layer)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return jax.ffi.ffi_call(target_name(TARGET, tier), jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_pages, v_pages, i32(page_tables), i32(cu_q_lens), i32(kv_lens), i32(num_seqs).reshape(()),
        i32(layer).reshape(()), i32(window).reshape(()),
        scale=np.float32(scale), softcap=np.float32(softcap or 0.0))


def ragged_paged_attention_cpu(
    q: jax.Array,  # [total_tokens, q_heads, head_dim]
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,
    page_tables: jax.Array,  # [max_seqs, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    kv_lens: jax.Array,  # [max_seqs] int32
    num_seqs: jax.Array | int,
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
    tier: str = "native",
) -> jax.Array:  # [total_tokens, q_heads, head_dim]
    """`ragged_paged_attention_reference`, computed by the native kernel (by the reference itself
    for a head_dim or dtype the kernel does not cover); `tier` picks a build (cpu_matmul.TIERS),
    for tests."""
    if not supports(q.shape[-1], k_pages.dtype, q.dtype):
        return ragged_paged_attention_reference(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                                                scale=scale, softcap=softcap, window=window, layer=layer)
    return _call(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                 scale=scale, softcap=softcap, window=window, layer=layer, tier=tier)


def paged_decode_attention_cpu(
    q: jax.Array,  # [batch, q_heads, head_dim]
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,  # [batch, max_pages_per_seq] int32
    lengths: jax.Array,  # [batch] int32, including the current token
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
    tier: str = "native",
) -> jax.Array:  # [batch, q_heads, head_dim]
    """`paged_decode_attention_reference`, computed by the native kernel: a ragged batch of one
    token per sequence (a length-0 row is padding and returns zeros)."""
    if not supports(q.shape[-1], k_pages.dtype, q.dtype):
        return paged_decode_attention_reference(q, k_pages, v_pages, page_tables, lengths,
                                                scale=scale, softcap=softcap, window=window, layer=layer)
    batch = q.shape[0]
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    return _call(q, k_pages, v_pages, page_tables, cu, lengths, batch,
                 scale=scale, softcap=softcap, window=window, layer=layer, tier=tier)
