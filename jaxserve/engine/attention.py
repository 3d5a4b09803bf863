"""The decoder's attention over the paged KV cache: write the step's new K/V, then attend.

`PagedAttention` is an `AttentionFn` for `Decoder.hidden_states`; the whole KVCache ([layers,
kv_heads, pages, page_size, head_dim] per K and V) is carried through the layers, and both the
write and the attention take the layer index and touch only that layer's pages in place: slicing
a layer out would make XLA copy the layer's entire cache on every layer of every step.

Backends (`--attention-backend`): "reference" is the pure-jnp attention; "pallas_gpu" /
"pallas_tpu" are the Pallas kernels of `pallas_kernels`; "cpu" is the native CPU kernel
(`pallas_kernels/cpu_attention.cc`, an XLA FFI call built on first use), whose cache write is
native too (`cpu_kv_write.cc`: XLA:CPU has no float8 scatter). The CLI's "auto" is the
Pallas kernels on a GPU (checked and timed on an H100: identical greedy output, 2.5-3.5x XLA's
decode attention from batch 8 up, see benchmarks/RESULTS.md), the native kernel on the CPU when it
builds (16% more tokens/s than the reference at 16 sequences on SmolLM2; without a C++ compiler,
the reference), and the Pallas kernels on TPUs too (correct in TPU interpret mode and compiled by
the real TPU compiler in CI, tests/tpu_aot; not yet timed on a TPU); "pallas" is
the kernels of the machine, and on the CPU the GPU flavour run by the Pallas interpreter: correct
but very slow, for tests and debugging only.
"""

from __future__ import annotations

import functools
import logging
import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels._common import target_platform
from jaxserve.engine.kv_cache import KVCache

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
        # The GPU kernels passed their tests and beat XLA on an H100. The TPU kernels are correct in
        # TPU interpret mode and compile through the real TPU compiler in CI (tests/tpu_aot), with
        # every page read once by DMA; XLA's gather-based reference is no faster a bet on a TPU.
        if platform in ("gpu", "tpu"):
            return _PALLAS_OF_PLATFORM[platform]
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
    """Whether `backend`'s kernels would run in (slow) interpret mode on `platform` (default: the
    platform being compiled for)."""
    platform = platform or target_platform()
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


def write_layer(cache: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
                backend: str = "reference") -> KVCache:
    """Write k, v [tokens, kv_heads, head_dim] into `layer` at flat slots (-1: dropped), with
    `backend`'s cache write (`pallas_kernels.get_kv_write`).

    The full (donated, loop-carried) cache goes in, so the write updates it in place."""
    new_k, new_v = pallas_kernels.get_kv_write(backend)(cache.k, cache.v, k, v, slots, layer=layer)
    return KVCache(new_k, new_v)


def pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    """`x` [..., D] zero-padded to the cache's `head_dim` (`kv_cache.cache_head_dim`: wider on a TPU).
    Zero lanes add nothing to q.k (the scale is the model's, passed explicitly), and a zero V lane
    gives a zero output lane, which the caller slices off."""
    if x.shape[-1] == head_dim:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])])


@struct.dataclass
class PagedAttention:
    """The step's attention over the paged cache (an `AttentionFn`): write the layer's new K/V,
    then attend. A decode step (one token per sequence, `decode`) takes the backend's decode
    kernel, which splits long contexts over more programs; any other step its ragged attention.
    The engine compiles decode and prefill steps separately, so the choice is static."""

    slots: jax.Array  # [T] int32 flat KV slot of each new token, -1 for padding
    page_tables: jax.Array  # [S, max_pages_per_seq] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    kv_lens: jax.Array  # [S] int32, including this step's tokens
    num_seqs: jax.Array  # [] int32
    scale: float = struct.field(pytree_node=False)
    softcap: float | None = struct.field(pytree_node=False)
    backend: str = struct.field(pytree_node=False)
    decode: bool = struct.field(pytree_node=False)
    # Tensor parallelism: the cache's own sharding, pinned after every layer. Left free, GSPMD may
    # re-split a replicated cache inside the layers (to follow the q heads) and all-gather the
    # whole cache back after them: a full-cache collective on every step.
    cache_sharding: jax.sharding.Sharding | None = struct.field(pytree_node=False, default=None)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, window: jax.Array,
                 layer: jax.Array) -> tuple[jax.Array, KVCache]:
        # q: [1, T, q_heads, D]; k, v: [1, T, kv_heads, D] (the step's tokens as one row)
        head_dim = q.shape[-1]
        q, k, v = (pad_head_dim(x, cache.k.shape[-1]) for x in (q, k, v))
        cache = write_layer(cache, layer, k[0], v[0], self.slots, self.backend)
        mesh = getattr(self.cache_sharding, "mesh", None)
        if mesh is None or mesh.size == 1:
            out = self._attend(q[0], cache.k, cache.v, window, layer)
        else:
            out = self._attend_sharded(mesh, q[0], cache, window, layer)
        if self.cache_sharding is not None:
            cache = jax.lax.with_sharding_constraint(cache, self.cache_sharding)
        return out[None, ..., :head_dim], cache

    def _attend(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, window: jax.Array,
                layer: jax.Array) -> jax.Array:
        """q [T, q_heads, D] against the pages of whichever kv heads k_pages / v_pages hold."""
        common = dict(scale=self.scale, softcap=self.softcap, window=window, layer=layer)
        if self.backend == "reference":
            # The reference reads keys in chunks with a traced trip count that stops at the longest live
            # context; small chunks (~128 tokens) keep short contexts cheap even when max_model_len is long.
            common["chunk_pages"] = max(1, 128 // k_pages.shape[-2])
        if self.decode:
            # Padding rows get length 0, which the kernels answer with zeros. A step padded to more
            # tokens than sequences (min_rows: one sequence, two rows for the products) attends
            # its sequences with the decode kernel and gives the extra tokens zeros: the ragged
            # kernel took 37 us a layer for those two rows on an H100, the decode kernel 6.
            seqs, rows = self.page_tables.shape[0], q.shape[0]
            lengths = jnp.where(jnp.arange(self.kv_lens.shape[0]) < self.num_seqs, self.kv_lens, 0)
            kernel = pallas_kernels.get_decode_attention(self.backend)
            if self.backend == "pallas_gpu" and rows > seqs:
                # The GPU kernel attends the padding rows itself (length 0: zeros), with its
                # splits sized for the real ones: padding its output instead took a kernel per
                # layer per decode iteration (Llama-3-8B at batch 1 for an H100, tests/gpu_aot),
                # where these pads are one per iteration, shared by the layers.
                page_tables = jnp.pad(self.page_tables, ((0, rows - seqs), (0, 0)))
                lengths = jnp.pad(lengths, (0, rows - seqs))
                return kernel(q, k_pages, v_pages, page_tables, lengths, live_rows=seqs, **common)
            out = kernel(q[:seqs], k_pages, v_pages, self.page_tables, lengths, **common)
            return jnp.pad(out, ((0, rows - seqs), (0, 0), (0, 0)))
        return pallas_kernels.get_ragged_attention(self.backend)(
            q, k_pages, v_pages, self.page_tables, self.cu_q_lens, self.kv_lens, self.num_seqs, **common)

    def _attend_sharded(self, mesh: jax.sharding.Mesh, q: jax.Array, cache: KVCache, window: jax.Array,
                        layer: jax.Array) -> jax.Array:
        """Tensor parallelism, explicitly per device (`shard_map`): XLA cannot partition a Pallas
        kernel itself (Mosaic refuses; anything else would gather the whole cache). With the cache
        split by kv head, each device attends its q heads to its kv heads: no communication. With
        the cache replicated (kv heads do not divide by the mesh), each device attends every head
        (q is gathered, a few KiB) and keeps its own: the same pages read, no cache traffic."""
        kv_spec = self.cache_sharding.spec
        split = len(kv_spec) > 1 and kv_spec[1] is not None
        heads = P(None, kv_spec[1], None) if split else P()
        rest = (self.page_tables, self.cu_q_lens, self.kv_lens, self.num_seqs, window, layer)

        def local(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                  cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, window: jax.Array,
                  layer: jax.Array) -> jax.Array:
            inner = self.replace(page_tables=page_tables, cu_q_lens=cu_q_lens, kv_lens=kv_lens, num_seqs=num_seqs)
            return inner._attend(q, k_pages, v_pages, window, layer)

        return jax.shard_map(local, mesh=mesh, in_specs=(heads, kv_spec, kv_spec, *(P(),) * len(rest)),
                             out_specs=heads, check_vma=False)(q, cache.k, cache.v, *rest)


def paged_attention(
    slots: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    softcap: float | None,
    backend: str = "reference",
    decode: bool = False,
    cache_sharding: jax.sharding.Sharding | None = None,
) -> PagedAttention:
    """A `PagedAttention` for `backend` (resolved; warns once when its kernels would be interpreted)."""
    backend = resolve_backend(backend)
    if is_interpreted(backend):
        _warn_interpreted(backend, target_platform())
    return PagedAttention(slots, page_tables, cu_q_lens, kv_lens, num_seqs, scale=scale, softcap=softcap,
                          backend=backend, decode=decode, cache_sharding=cache_sharding)
