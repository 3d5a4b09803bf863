"""The decoder's attention over the paged KV cache: write the step's new K/V, then attend.

Returns an `AttentionFn` for `Decoder.hidden_states`; the whole KVCache ([layers, kv_heads, pages,
page_size, head_dim] per K and V) is carried through the layer scan, and both the write and the
attention take the layer index and touch only that layer's pages in place: slicing a layer out
would make XLA copy the layer's entire cache on every layer of every step.

Backends (`--attention-backend`): "reference" is the pure-jnp attention; "pallas_gpu" /
"pallas_tpu" are the Pallas kernels of `pallas_kernels`; "cpu" is the native CPU kernel
(`pallas_kernels/cpu_attention.cc`, an XLA FFI call built on first use). The CLI's "auto" is the
Pallas kernels on a GPU (checked and timed on an H100: identical greedy output, 2.5-3.5x XLA's
decode attention from batch 8 up, see benchmarks/RESULTS.md), the native kernel on the CPU when it
builds (16% more tokens/s than the reference at 16 sequences on SmolLM2; without a C++ compiler,
the reference), and the reference on TPUs until their kernels have run on a real one; "pallas" is
the kernels of the machine, and on the CPU the GPU flavour run by the Pallas interpreter: correct
but very slow, for tests and debugging only.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.engine.kv_cache import KVCache
from jaxserve.models.decoder import AttentionFn

log = logging.getLogger("jaxserve.engine")

CHOICES = ("auto", "reference", "pallas", "cpu")  # what --attention-backend accepts
_PALLAS_OF_PLATFORM = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}
_PLATFORM_OF_PALLAS = {backend: platform for platform, backend in _PALLAS_OF_PLATFORM.items()}


def resolve_backend(name: str, platform: str | None = None, tensor_parallel: int = 1) -> str:
    """The concrete backend ("reference", "pallas_gpu", "pallas_tpu" or "cpu") of an
    --attention-backend choice on `platform` (default: jax's default backend). Concrete names pass
    through; "cpu" is built here, so a missing compiler fails at start-up, not at the first step."""
    platform = platform or jax.default_backend()
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU only, not on {platform}")
        if tensor_parallel > 1:
            raise ValueError("--attention-backend cpu does not shard over devices; use reference with "
                             f"--tensor-parallel-size {tensor_parallel}")
        from pallas_kernels import cpu_attention

        cpu_attention.ensure_built()
        return name
    if name in pallas_kernels.BACKENDS:
        return name
    if name == "auto":
        # The GPU kernels passed their tests and beat XLA on an H100; the TPU kernels have only
        # run in TPU interpret mode, so TPUs keep the reference until they are timed on one.
        if platform == "gpu":
            return "pallas_gpu"
        if platform == "cpu" and tensor_parallel == 1:
            # The custom call has no sharding rule: split over devices, XLA would gather the
            # whole cache onto each of them, so tensor-parallel CPU runs keep the reference.
            from pallas_kernels import cpu_attention

            return "cpu" if cpu_attention.available() else "reference"
        return "reference"
    if name == "pallas":
        # The generic Pallas interpreter (GPU flavour) is much faster on the CPU than TPU interpret
        # mode, which simulates every DMA and semaphore.
        return _PALLAS_OF_PLATFORM.get(platform, "pallas_gpu")
    raise ValueError(f"attention backend must be one of {CHOICES + pallas_kernels.BACKENDS}, got {name!r}")


def is_interpreted(backend: str, platform: str | None = None) -> bool:
    """Whether `backend`'s kernels would run in (slow) interpret mode on `platform`."""
    platform = platform or jax.default_backend()
    return backend in _PLATFORM_OF_PALLAS and _PLATFORM_OF_PALLAS[backend] != platform


def describe_backend(backend: str, platform: str | None = None) -> str:
    """One line for the start-up log."""
    platform = platform or jax.default_backend()
    if backend == "cpu":
        return "cpu (native kernel, pallas_kernels/cpu_attention.cc)"
    if is_interpreted(backend, platform):
        return (f"{backend} in Pallas interpret mode on {platform} (very slow: for testing the kernels only; "
                "use --attention-backend reference to serve on the CPU)")
    return backend if backend == "reference" else f"{backend} (Pallas kernels on {platform})"


@functools.cache
def _warn_interpreted(backend: str, platform: str) -> None:
    # Once per process, not once per compiled bucket.
    log.warning("attention backend %s", describe_backend(backend, platform))


def write_layer(cache: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVCache:
    """Scatter k, v [tokens, kv_heads, head_dim] into `layer` at flat slots (-1: dropped).

    One scatter per buffer on the full (donated, loop-carried) cache, so XLA updates it in place."""
    new_k, new_v = pallas_kernels.write_kv(cache.k, cache.v, k, v, slots, layer=layer)
    return KVCache(new_k, new_v)


def decode_only(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """Whether every live sequence of a ragged batch has exactly one new token (then token i is
    sequence i's, and the decode kernel computes the same thing as the ragged one)."""
    live = jnp.arange(cu_q_lens.shape[0] - 1) < num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    return jnp.all(jnp.where(live, q_lens == 1, True)) & (cu_q_lens[0] == 0)


def paged_attend(
    slots: jax.Array,  # [T] int32 flat KV slot of each new token, -1 for padding
    page_tables: jax.Array,  # [S, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    kv_lens: jax.Array,  # [S] int32, including this step's tokens
    num_seqs: jax.Array,  # [] int32
    *,
    scale: float,
    softcap: float | None,
    page_size: int,
    backend: str = "reference",
) -> AttentionFn:
    """The step's attention: every bucket goes through the ragged attention of `backend`; with a
    Pallas backend, a bucket shaped like decode (tokens == seqs) takes the decode kernel (which
    splits long contexts over more programs) whenever the batch really is one token per sequence."""
    backend = resolve_backend(backend)
    if is_interpreted(backend):
        _warn_interpreted(backend, jax.default_backend())
    ragged = pallas_kernels.get_ragged_attention(backend)
    options: dict[str, Any] = {}
    if backend == "reference":
        # The reference reads keys in chunks with a traced trip count that stops at the longest live
        # context; small chunks (~128 tokens) keep short contexts cheap even when max_model_len is long.
        options["chunk_pages"] = max(1, 128 // page_size)
    # A prefill bucket can have tokens == seqs too (e.g. 16 tokens, 16 seqs), so the shape alone does
    # not prove decode; the check is one cond per layer on a few ints. The reference takes the decode
    # path too: it skips the ragged work-item planning and the two row gathers around it, which cost
    # as much as the attention itself in a CPU decode step.
    decode_shaped = slots.shape[0] == page_tables.shape[0]
    decode = pallas_kernels.get_decode_attention(backend) if decode_shaped else None
    use_decode = decode_only(cu_q_lens, num_seqs)
    lengths = jnp.where(jnp.arange(kv_lens.shape[0]) < num_seqs, kv_lens, 0)  # padding rows: 0 -> zeros

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, window: jax.Array, layer: jax.Array):
        # q: [1, T, q_heads, D]; k, v: [1, T, kv_heads, D] (the step's tokens as one row)
        cache = write_layer(cache, layer, k[0], v[0], slots)
        common = dict(scale=scale, softcap=softcap, window=window, layer=layer)

        def ragged_step() -> jax.Array:
            return ragged(q[0], cache.k, cache.v, page_tables, cu_q_lens, kv_lens, num_seqs, **common, **options)

        def decode_step() -> jax.Array:
            return decode(q[0], cache.k, cache.v, page_tables, lengths, **common, **options)

        out = ragged_step() if decode is None else jax.lax.cond(use_decode, decode_step, ragged_step)
        return out[None], cache

    return attend
