"""Random paged-KV test inputs and a naive float64 NumPy attention to check everything against.

Every case shuffles pages (so a sequence's pages are non-contiguous), fills every slot that is not a
written token with NaN (unused pages and the tails of last pages), and points unused page-table
entries at random in-range pages (NaN pages or other sequences' pages), so a kernel that reads
anything it should not returns NaN or a wrong value.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax

import jax.numpy as jnp
import ml_dtypes
import numpy as np

# Tolerances per dtype (absolute, relative), for outputs of unit-scale attention:
# float32: the same math in another order; bfloat16: one output rounding (2^-8) plus the kernels'
# bf16 probabilities in the PV product.
TOLERANCES = {
    "float32": dict(atol=2e-5, rtol=2e-5),
    "bfloat16": dict(atol=3e-2, rtol=3e-2),
}


@dataclass
class PagedCache:
    k_pages: np.ndarray  # [kv_heads, num_pages, page_size, head_dim], NaN where unwritten
    v_pages: np.ndarray
    page_tables: np.ndarray  # [rows, max_pages] int32
    kv_lens: np.ndarray  # [rows] int32


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)


def make_cache(
    rng: np.random.Generator,
    kv_lens: list[int],
    *,
    kv_heads: int,
    page_size: int,
    head_dim: int,
    max_pages: int,
    dtype: str = "float32",
    spare_pages: int = 3,
) -> PagedCache:
    needed = [-(-n // page_size) for n in kv_lens]
    if max(needed, default=0) > max_pages:
        raise ValueError("a length needs more pages than max_pages")
    num_pages = sum(needed) + spare_pages
    shape = (kv_heads, num_pages, page_size, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    order = rng.permutation(num_pages)
    page_tables = rng.integers(0, num_pages, size=(len(kv_lens), max_pages)).astype(np.int32)
    used = 0
    for b, n in enumerate(kv_lens):
        pages = order[used : used + needed[b]]
        used += needed[b]
        page_tables[b, : needed[b]] = pages
        for t in range(n):
            p, s = pages[t // page_size], t % page_size
            k[:, p, s] = rng.standard_normal((kv_heads, head_dim))
            v[:, p, s] = rng.standard_normal((kv_heads, head_dim))
    # Round through the dtype so the naive float64 check sees exactly the kernel's inputs.
    k, v = as_dtype(k, dtype), as_dtype(v, dtype)
    return PagedCache(k, v, page_tables, np.asarray(kv_lens, np.int32))


FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def with_cache_dtype(cache: PagedCache, name: str) -> PagedCache:
    """The cache's pages rounded to an 8-bit float cache (FP8 name), NaN slots kept: the kernels,
    the reference and the naive check then all read the same rounded values."""
    return dataclasses.replace(cache, k_pages=cache.k_pages.astype(FP8[name]), v_pages=cache.v_pages.astype(FP8[name]))


def stack_layers(pages: np.ndarray, rng: np.random.Generator, *, layer: int, num_layers: int) -> np.ndarray:
    """One layer's pages inside an engine-style stacked cache [num_layers, kv_heads, num_pages,
    page_size, head_dim]: the layers below `layer` hold NaN, those above finite random values, so a
    kernel that reads any other layer returns NaN or a wrong value."""
    layers = []
    for i in range(num_layers):
        if i == layer:
            layers.append(pages)
        elif i < layer:
            layers.append(np.full_like(pages, np.nan))
        else:
            layers.append(rng.standard_normal(pages.shape).astype(pages.dtype))
    return np.stack(layers)


def dense_kv(cache: PagedCache, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's keys and values as float64 [kv_len, kv_heads, head_dim], read token by token."""
    page_size = cache.k_pages.shape[2]
    n = int(cache.kv_lens[b])
    ks, vs = [], []
    for t in range(n):
        p = cache.page_tables[b, t // page_size]
        ks.append(cache.k_pages[:, p, t % page_size].astype(np.float64))
        vs.append(cache.v_pages[:, p, t % page_size].astype(np.float64))
    kv_heads, head_dim = cache.k_pages.shape[0], cache.k_pages.shape[3]
    if not ks:
        return np.zeros((0, kv_heads, head_dim)), np.zeros((0, kv_heads, head_dim))
    return np.stack(ks), np.stack(vs)


def naive_attention(
    q: np.ndarray,  # [q_heads, head_dim] one query
    k: np.ndarray,  # [kv_len, kv_heads, head_dim]
    v: np.ndarray,
    q_pos: int,
    *,
    scale: float,
    softcap: float | None,
    window: int,
) -> np.ndarray:
    q_heads, head_dim = q.shape
    group = q_heads // k.shape[1]
    keys = [j for j in range(min(q_pos + 1, k.shape[0])) if window == 0 or q_pos - j < window]
    out = np.zeros((q_heads, head_dim))
    if not keys:
        return out
    for h in range(q_heads):
        kh, vh = k[keys, h // group], v[keys, h // group]
        s = kh @ q[h].astype(np.float64) * scale
        if softcap is not None:
            s = np.tanh(s / softcap) * softcap
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vh
    return out


def naive_decode(q: np.ndarray, cache: PagedCache, *, scale: float, softcap=None, window=0) -> np.ndarray:
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        k, v = dense_kv(cache, b)
        out[b] = naive_attention(q[b], k, v, int(cache.kv_lens[b]) - 1, scale=scale, softcap=softcap, window=window)
    return out


@dataclass
class RaggedBatch:
    cache: PagedCache
    q: np.ndarray  # [total_tokens, q_heads, head_dim]
    cu_q_lens: np.ndarray  # [max_seqs + 1]
    num_seqs: int
    q_lens: list[int]


def make_ragged(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per real sequence
    *,
    max_seqs: int,
    total_tokens: int,
    q_heads: int,
    kv_heads: int,
    page_size: int,
    head_dim: int,
    max_pages: int,
    dtype: str = "float32",
) -> RaggedBatch:
    """A ragged batch whose slots past num_seqs hold garbage that must be ignored."""
    q_lens = [ql for ql, _ in seqs]
    kv_lens = [kl for _, kl in seqs] + [int(rng.integers(0, max_pages * page_size + 1))] * (max_seqs - len(seqs))
    cache = make_cache(
        rng, kv_lens, kv_heads=kv_heads, page_size=page_size, head_dim=head_dim, max_pages=max_pages, dtype=dtype
    )
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : len(seqs) + 1] = np.cumsum(q_lens)
    cu[len(seqs) + 1 :] = rng.integers(0, total_tokens + 1, size=max_seqs - len(seqs))  # garbage
    if cu[len(seqs)] > total_tokens:
        raise ValueError("the sequences need more than total_tokens query rows")
    q = as_dtype(rng.standard_normal((total_tokens, q_heads, head_dim)).astype(np.float32), dtype)
    q[cu[len(seqs)] :] = np.nan  # padding rows may hold anything
    return RaggedBatch(cache, q, cu, len(seqs), q_lens)


def naive_ragged(batch: RaggedBatch, *, scale: float, softcap=None, window=0) -> np.ndarray:
    out = np.zeros(batch.q.shape)
    for b in range(batch.num_seqs):
        k, v = dense_kv(batch.cache, b)
        kv_len = int(batch.cache.kv_lens[b])
        for i in range(batch.q_lens[b]):
            t = int(batch.cu_q_lens[b]) + i
            pos = kv_len - batch.q_lens[b] + i
            out[t] = naive_attention(batch.q[t], k, v, pos, scale=scale, softcap=softcap, window=window)
    return out


# Small shapes shared by the reference and kernel tests.
PAGE = 4
MAX_PAGES = 5
# Decode lengths: padding row, 1, page_size - 1, page_size, page_size + 1, the maximum.
DECODE_LENGTHS = [0, 1, PAGE - 1, PAGE, PAGE + 1, MAX_PAGES * PAGE]


def decode_case(seed, *, group, dtype, head_dim=16, kv_heads=2, lengths=DECODE_LENGTHS):
    rng = np.random.default_rng(seed)
    cache = make_cache(
        rng, lengths, kv_heads=kv_heads, page_size=PAGE, head_dim=head_dim, max_pages=MAX_PAGES, dtype=dtype
    )
    q = rng.standard_normal((len(lengths), kv_heads * group, head_dim)).astype(cache.k_pages.dtype)
    return q, cache


def ragged_case(seed, *, group, dtype, seqs=None, max_seqs=8, total_tokens=48, head_dim=16, kv_heads=2):
    # (q_len, kv_len): decode rows, a whole prefill, chunked prefills across page edges, the maximum,
    # and an empty sequence in the middle.
    if seqs is None:
        seqs = [(1, 1), (3, PAGE - 1), (1, PAGE), (0, 3), (PAGE + 1, PAGE + 1), (2, PAGE + 1), (9, MAX_PAGES * PAGE)]
    rng = np.random.default_rng(seed)
    return make_ragged(
        rng,
        seqs,
        max_seqs=max_seqs,
        total_tokens=total_tokens,
        q_heads=kv_heads * group,
        kv_heads=kv_heads,
        page_size=PAGE,
        head_dim=head_dim,
        max_pages=MAX_PAGES,
        dtype=dtype,
    )


def run_ragged(batch, fn=None, *, stacked=None, layer=None, **kw):
    """`fn` (default: the reference) on the batch, jitted; with `stacked` = (k, v) stacked caches,
    reads layer `layer` of them (passed traced, as in the engine's layer scan)."""
    if fn is None:
        from pallas_kernels import ragged_paged_attention_reference as fn
    c = batch.cache
    k, v = stacked if stacked is not None else (c.k_pages, c.v_pages)
    extra = {} if layer is None else dict(layer=jnp.int32(layer))
    f = jax.jit(functools.partial(fn, **kw))
    return f(batch.q, k, v, c.page_tables, batch.cu_q_lens, c.kv_lens, jnp.int32(batch.num_seqs), **extra)


