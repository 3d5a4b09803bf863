"""The paged KV cache on the device, and how many pages fit.

Layout: k and v are each [num_layers, num_kv_heads, num_pages, page_size, head_dim] -- per layer
the [kv_heads, pages, page_size, head_dim] layout of `pallas_kernels`, stacked over layers so
the decoder's layer scan carries one buffer that every step updates in place (donated).
Page 0 is the allocator's null page: padding rows write there and nothing valid reads it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import CacheConfig
from jaxserve.models.config import DecoderConfig

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
    def shape(cfg: DecoderConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
        return (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

    @staticmethod
    def create(cfg: DecoderConfig, num_pages: int, page_size: int, dtype: Any, sharding: Any = None) -> "KVCache":
        shape = KVCache.shape(cfg, num_pages, page_size)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return KVCache(zeros(), zeros())


def bytes_per_page(cfg: DecoderConfig, page_size: int, dtype: Any) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize


def num_pages_for(cache: CacheConfig, cfg: DecoderConfig, dtype: Any, device: jax.Device, kv_shards: int = 1,
                  reserve_bytes: int = 0) -> int:
    """--num-pages if given; else the memory fraction of what the device has free (on the CPU,
    a fixed byte budget: the "device" memory is the host's and is shared with everything else).
    With the cache split `kv_shards` ways (tensor parallelism over kv heads), each device holds
    only its share of every page, so that many more pages fit in the same memory.
    `reserve_bytes` (the steps' scratch memory) is set aside before the fraction is taken."""
    per_page = -(-bytes_per_page(cfg, cache.page_size, dtype) // kv_shards)
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
