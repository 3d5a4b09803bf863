"""The paged KV cache on the device, and how many pages fit.

Layout: k and v are each [num_layers, num_kv_heads, num_pages, page_size, head_dim] -- per layer
the [kv_heads, pages, page_size, head_dim] layout of `pallas_kernels`, stacked over layers so one
buffer per K and V is carried through the layers and updated in place (donated); every kernel and
write indexes its layer in place. The dtype is the model's, or 8-bit floats (`KV_CACHE_DTYPES`):
half the bytes per token, so twice the tokens in the same memory and half the KV reads per step.
On a TPU the cache's head_dim is the model's rounded up to 128 lanes (`cache_head_dim`); the
attention pads q, k and v to it with zeros and slices the output back.
Page 0 is the allocator's null page: padding rows write there and nothing valid reads it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import KV_CACHE_DTYPES, CacheConfig
from jaxserve.models.config import DecoderConfig
from pallas_kernels._common import target_platform

log = logging.getLogger("jaxserve.engine")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [layers, kv_heads, pages, page_size, head_dim]
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @staticmethod
    def shape(cfg: DecoderConfig, num_pages: int, page_size: int, platform: str | None = None) -> tuple[int, ...]:
        """The shape of K (and of V) on `platform` (default: the one being compiled for)."""
        return (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cache_head_dim(cfg.head_dim, platform))

    @staticmethod
    def create(cfg: DecoderConfig, num_pages: int, page_size: int, dtype: Any, sharding: Any = None,
               platform: str | None = None) -> "KVCache":
        shape = KVCache.shape(cfg, num_pages, page_size, platform)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return KVCache(zeros(), zeros())


TPU_LANES = 128


def cache_head_dim(head_dim: int, platform: str | None = None) -> int:
    """The cache's head_dim on `platform` (default: the one being compiled for): the model's, or on a
    TPU the model's rounded up to a multiple of 128 lanes.

    Why: XLA:TPU tiles the two minor dims of an array as (sublanes, 128 lanes). For [..., page_size,
    64] it avoids padding the lanes by laying the cache out with the pages as the minor dim, which
    neither the Pallas kernels nor an in-place row write can use: every step then copied the whole
    cache into the row-major layout and back (scratch of ~3 caches, 1.5 GB read per decode step of
    a 3-layer model with 10,000 pages, where 128-lane rows read 0.04 GB; v6e, libtpu 0.0.48,
    `python -m jaxserve.plan`, benchmarks/RESULTS.md). A row-major 64-wide cache would be padded to
    128 lanes in HBM anyway, so the padding costs no memory the layout could have saved, and every
    kernel sees its one tested head_dim. Packing K and V of a token into one 128-lane row (as
    tpu-inference's head_dim-64 kernel does) would halve it, at the price of its own kernels."""
    platform = platform or target_platform()
    return -(-head_dim // TPU_LANES) * TPU_LANES if platform == "tpu" else head_dim


# --kv-cache-dtype (config.KV_CACHE_DTYPES) -> the cache's dtype (None: the model's). The 8-bit
# formats are vLLM's and SGLang's: the values themselves rounded to float8, with no scale (vLLM's
# behaviour without calibrated scales), saturated on write (`pallas_kernels._common.to_cache_dtype`).
# e4m3 keeps 3 mantissa bits over +-448, e5m2 2 bits over +-57344.
_DTYPES: dict[str, Any] = {
    "auto": None,
    "bfloat16": jnp.bfloat16,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}
assert tuple(_DTYPES) == KV_CACHE_DTYPES


def cache_dtype(name: str, model_dtype: Any) -> jnp.dtype:
    """The KV cache's dtype for a --kv-cache-dtype choice and the model's activation dtype."""
    if name not in _DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return jnp.dtype(_DTYPES[name] or model_dtype)


def check_cache_dtype(dtype: Any, attention_backend: str, device: Any) -> None:
    """Refuses a cache the GPU kernels cannot read on this GPU: Triton takes float8_e4m3fn only on
    compute capability 8.9 and up (Ada, Hopper; an A100 is 8.0) and fails inside XLA's compile of
    the kernel otherwise, a worse place to learn it than start-up. Warns where an 8-bit cache is
    measured slow: the pure-jnp reference attention's on the CPU."""
    if attention_backend == "reference" and getattr(device, "platform", None) == "cpu" \
            and jnp.dtype(dtype).itemsize == 1:
        # Measured 2026-11-25 (benchmarks/RESULTS.md): XLA:CPU has no float8 scatter, so the
        # reference's write scatters the cache's bytes, and XLA copies the whole cache to uint8
        # and back around it on every layer (1.8-3.4x slower decode steps on SmolLM2). The native
        # backend writes in place. Said at start-up so nobody mistakes it for the format's cost.
        log.warning("--kv-cache-dtype %s with --attention-backend reference on the CPU: decode steps are 1.8-3.4x "
                    "slower than with the model's dtype (XLA:CPU copies the whole cache per layer); the "
                    "native kernel (--attention-backend cpu, the default on one device) writes it in place",
                    jnp.dtype(dtype).name)
    if attention_backend != "pallas_gpu" or jnp.dtype(dtype) != jnp.float8_e4m3fn:
        return
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return  # not a CUDA device (ROCm's Triton has its own float8 rules)
    if tuple(int(x) for x in str(capability).split(".")[:2]) < (8, 9):
        raise ValueError(f"--kv-cache-dtype fp8 / fp8_e4m3 needs a GPU of compute capability 8.9 or newer for the "
                         f"Pallas kernels; this {device.device_kind} is {capability}: use fp8_e5m2, or "
                         "--attention-backend reference")


def bytes_per_page(cfg: DecoderConfig, page_size: int, dtype: Any, platform: str | None = None) -> int:
    """K and V bytes of one page over all layers, as the cache holds it on `platform`."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cache_head_dim(cfg.head_dim, platform) \
        * jnp.dtype(dtype).itemsize


def num_pages_for(cache: CacheConfig, cfg: DecoderConfig, dtype: Any, device: jax.Device, kv_shards: int = 1,
                  reserve_bytes: int = 0) -> int:
    """--num-pages if given; else the memory fraction of what the device has free (on the CPU,
    a fixed byte budget: the "device" memory is the host's and is shared with everything else).
    With the cache split `kv_shards` ways (tensor parallelism over kv heads), each device holds
    only its share of every page, so that many more pages fit in the same memory.
    `reserve_bytes` (the steps' scratch memory) is set aside before the fraction is taken."""
    per_page = -(-bytes_per_page(cfg, cache.page_size, dtype, device.platform) // kv_shards)
    if cache.num_pages is not None:
        return cache.num_pages
    if device.platform == "cpu":
        budget = cache.cpu_kv_cache_bytes
    else:
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit is None:
            raise ValueError("cannot read the device's memory size; pass --num-pages")
        budget = int((limit - stats.get("bytes_in_use", 0) - reserve_bytes) * cache.kv_cache_memory_fraction)
    pages = budget // per_page
    if pages < 2:
        raise ValueError(f"only {budget} bytes for the KV cache: not even 2 pages of {per_page} bytes")
    return int(pages)


# Pallas's Triton lowering (jax 0.11.2, `_compute_offsets_from_indices`) addresses an operand with
# 32-bit signed element offsets unless it is over 2**32 bytes: right for 2-byte elements, but a
# 1-byte array of (2**31, 2**32] bytes has offsets past 2**31 that wrap, and the GPU kernels would
# read the wrong pages (tests/gpu_lowering pins the rule).
TRITON_OFFSET_WRAP = (2**31, 2**32)


def triton_safe_pages(pages: int, array_page_bytes: list[float]) -> int:
    """`pages`, or fewer, so that no 8-bit K or V array, of `array_page_bytes` per page each (per
    device; a draft model's cache is another), lies in `TRITON_OFFSET_WRAP`: cut to 2 GiB, with a
    warning saying why. For the GPU kernels only."""
    low, high = TRITON_OFFSET_WRAP
    safe = pages
    while any(low < safe * per_page <= high for per_page in array_page_bytes):  # one cut may put another in
        safe = min(int(low // per_page) for per_page in array_page_bytes if low < safe * per_page <= high)
    if safe != pages:
        log.warning("KV cache: %d pages instead of %d: an 8-bit K or V array of 2-4 GiB is addressed with "
                    "32-bit offsets that wrap in the GPU kernels (jax's Pallas Triton lowering); over 4 GiB "
                    "it is not", safe, pages)
    return safe
