"""The native CPU attention kernel (`pallas_kernels/cpu_attention.cc`) at serving shapes, and its build.

`test_pallas_kernels.py` runs it through the same small cases as the Pallas kernels (backend "cpu");
here the shapes are the ones it serves: page size 16, head_dim 64 and 128, GQA 3:1, prompts longer
than one 16-row block, prefixes from the cache, scattered pages, NaN in every unused slot and in
the other layers, bfloat16 and float32, and 8-bit float caches (--kv-cache-dtype fp8*) under either.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_tiers import ATTENTION_TIERS
from paged_cases import FP8, make_cache, stack_layers, with_cache_dtype

from pallas_kernels import cpu_attention, native, paged_decode_attention_reference, ragged_paged_attention_reference

TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=2e-2, rtol=2e-2)}
# The correctness tests run in every build of the kernel this machine has (kernel_tiers): on an
# AVX512-BF16 machine the AVX2 code too.
each_tier = pytest.mark.parametrize("tier", ATTENTION_TIERS)


def paged(rng, kv_lens, *, page, dim, dtype, max_pages, kv_heads=3, layer=0, num_layers=1, cache_dtype=None):
    """`paged_cases.make_cache` (scattered pages, NaN in every unwritten slot, garbage page ids past
    each sequence) as layer `layer` of an engine-style stacked cache (other layers poisoned):
    (k, v, page_tables) as jax arrays. With `cache_dtype` (an FP8 name) the pages are rounded to
    that 8-bit cache, NaN included (0x7f for e4m3fn)."""
    cache = make_cache(rng, kv_lens, kv_heads=kv_heads, page_size=page, head_dim=dim, max_pages=max_pages, dtype=dtype)
    if cache_dtype is not None:
        cache = with_cache_dtype(cache, cache_dtype)
    k, v = (jnp.asarray(stack_layers(x, rng, layer=layer, num_layers=num_layers)) for x in (cache.k_pages, cache.v_pages))
    return k, v, jnp.asarray(cache.page_tables)


# bfloat16 head dims 16 / 48 end in a half 32-dim chunk of the AVX512-BF16 path (masked loads).
@each_tier
@pytest.mark.parametrize("dtype,dim,window,softcap", [
    ("bfloat16", 64, 0, None), ("float32", 64, 0, None), ("float32", 128, 37, None), ("bfloat16", 64, 20, 30.0),
    ("bfloat16", 128, 37, None), ("bfloat16", 48, 0, None), ("bfloat16", 16, 5, 20.0),
])
def test_ragged_prefill_with_prefixes_equals_reference(dtype, dim, window, softcap, tier):
    """Chunks of 40, 17, 1 and 5 new tokens after prefixes of 0, 30, 200 and 3 cached tokens (more
    than one 16-row block, one decode-like row), two padding sequences and padded rows at the end."""
    check_ragged_prefill(dtype, dim, window, softcap, tier=tier)


# Head dims, windows and softcaps under each 8-bit format and query dtype: on a CPU with AVX512-BF16,
# bfloat16 queries take its path (the block's rows widened to bfloat16; half chunks for 16 / 48),
# float32 queries the float32 one.
@each_tier
@pytest.mark.parametrize("dim,window,softcap", [(64, 0, None), (128, 37, None), (48, 20, 30.0), (16, 5, 20.0)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("cache_dtype", list(FP8))
def test_ragged_prefill_over_an_8bit_cache_equals_reference(cache_dtype, dtype, dim, window, softcap, tier):
    """The chunked prefill above over an 8-bit cache: the reference widens the same stored values to
    float32, so the kernel matches it at the query dtype's tolerance."""
    check_ragged_prefill(dtype, dim, window, softcap, cache_dtype=cache_dtype, tier=tier)


def check_ragged_prefill(dtype, dim, window, softcap, cache_dtype=None, tier="native"):
    rng = np.random.default_rng(dim + window)
    kv_heads, group = 3, 3
    q_lens = [40, 17, 1, 5, 0, 0]
    kv_lens = [40, 47, 201, 8, 0, 0]
    num_seqs = 4
    k, v, tables = paged(rng, kv_lens, page=16, dim=dim, dtype=dtype, max_pages=16, layer=1, num_layers=3,
                         cache_dtype=cache_dtype)
    assert cpu_attention.supports(dim, k.dtype, dtype)  # the kernel computes it, not the reference fallback
    total = 72  # 63 real rows + padding
    q = jnp.asarray(rng.standard_normal((total, kv_heads * group, dim)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (q, k, v, tables, jnp.asarray(cu), jnp.asarray(np.array(kv_lens, np.int32)), jnp.int32(num_seqs))
    kw = dict(scale=dim**-0.5, softcap=softcap, window=jnp.int32(window), layer=jnp.int32(1))
    out = jax.jit(functools.partial(cpu_attention.ragged_paged_attention_cpu, **kw, tier=tier))(*args)
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))(*args)
    assert out.dtype == q.dtype and out.shape == q.shape
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    np.testing.assert_array_equal(out[cu[num_seqs]:], 0.0)


@each_tier
@pytest.mark.parametrize("cache_dtype", [None, *FP8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_at_serving_shape_equals_reference(dtype, cache_dtype, tier):
    """16 sequences of 0 (padding) to 300 tokens, SmolLM2's heads (9 q, 3 kv, head_dim 64), page 16;
    the cache of the query dtype, or an 8-bit one."""
    rng = np.random.default_rng(7)
    kv_heads, group, dim, batch = 3, 3, 64, 16
    lengths = [0, 1, 15, 16, 17, 31, 32, 33, 100, 128, 129, 200, 255, 256, 257, 300]
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, dim)), dtype)
    for layer in (0, 1):  # the layer index picks the right slice of the stack (the other is poisoned)
        k, v, tables = paged(rng, lengths, page=16, dim=dim, dtype=dtype, max_pages=19, layer=layer, num_layers=2,
                             cache_dtype=cache_dtype)
        args = (q, k, v, tables, jnp.asarray(np.array(lengths, np.int32)))
        kw = dict(scale=0.125, layer=jnp.int32(layer))
        out = np.asarray(jax.jit(functools.partial(cpu_attention.paged_decode_attention_cpu, **kw, tier=tier))(*args),
                         np.float32)
        ref = np.asarray(jax.jit(functools.partial(paged_decode_attention_reference, **kw))(*args), np.float32)
        np.testing.assert_allclose(out, ref, **TOL[dtype])
        np.testing.assert_array_equal(out[0], 0.0)  # length 0: padding


@each_tier
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_head_dim_equals_reference(dtype, tier):
    """Every head_dim the kernel takes (cpu_attention.HEAD_DIMS; the AVX2 code updates an output
    row 64 dims at a time, then the rest), decode rows over 1 to 40 keys with a window on some."""
    rng = np.random.default_rng(11)
    lengths = [1, 23, 40]
    for dim in cpu_attention.HEAD_DIMS:
        k, v, tables = paged(rng, lengths, page=16, dim=dim, dtype=dtype, max_pages=3, kv_heads=2)
        q = jnp.asarray(rng.standard_normal((3, 4, dim)), dtype)
        args = (q, k, v, tables, jnp.asarray(np.array(lengths, np.int32)))
        for window in (0, 17):
            kw = dict(scale=dim**-0.5, layer=0, window=window)
            out = cpu_attention.paged_decode_attention_cpu(*args, **kw, tier=tier)
            ref = paged_decode_attention_reference(*args, **kw)
            np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype],
                                       err_msg=f"head_dim {dim}, window {window}")


@each_tier
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("cache_dtype", list(FP8))
def test_8bit_cache_widens_every_value_exactly(cache_dtype, dtype, tier):
    """Every bit pattern of the format (subnormals, +-0, the largest values, e5m2's infinities, the
    NaNs) as the value of a one-key sequence: its softmax weight is exactly 1, so the output is the
    widened value itself (exact in bfloat16 too), which must equal ml_dtypes' widening. The page's
    other slots hold NaN and the keys are 0."""
    fmt = FP8[cache_dtype]
    bits = np.arange(256, dtype=np.uint8)
    dim, page = 16, 16
    values = np.zeros(-(-bits.size // dim) * dim, np.uint8)
    values[: bits.size] = bits
    values = values.view(fmt).reshape(-1, dim)  # one sequence (and page) per row
    n = values.shape[0]
    rng = np.random.default_rng(5)
    pages = rng.permutation(n).astype(np.int32)  # sequence i's key sits in slot 0 of page pages[i]
    v = np.full((1, n, page, dim), np.nan, np.float32).astype(fmt)
    k = v.copy()
    v[0, pages, 0] = values
    k[0, pages, 0] = 0
    q = jnp.asarray(rng.standard_normal((n, 1, dim)), dtype)
    tables = jnp.asarray(pages[:, None])
    assert cpu_attention.supports(dim, fmt, dtype)
    out = cpu_attention.paged_decode_attention_cpu(q, jnp.asarray(k), jnp.asarray(v), tables,
                                                   jnp.ones((n,), jnp.int32), scale=0.5, tier=tier)
    assert out.dtype == q.dtype
    # NaN where NaN. (-0.0 comes out as 0.0, as from the reference: the output is a sum from zero.)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[:, 0], values.astype(np.float32))


def test_8bit_cache_dtypes_supported():
    """An 8-bit cache goes to the kernel under float32 and bfloat16 queries (it widens the cache, so
    no query is rounded), as does a bfloat16 one under float32 queries; other dtype mismatches still
    go to the reference, and the kernel itself refuses them."""
    for fmt in FP8.values():
        assert cpu_attention.supports(64, fmt) and cpu_attention.supports(64, fmt, jnp.float32)
        assert cpu_attention.supports(128, fmt, jnp.bfloat16)
        assert not cpu_attention.supports(64, fmt, jnp.float16) and not cpu_attention.supports(8, fmt, jnp.bfloat16)
    assert not cpu_attention.supports(64, jnp.float32, jnp.bfloat16)  # a wider cache: the reference
    assert cpu_attention.supports(64, jnp.bfloat16, jnp.float32)
    assert not cpu_attention.supports(64, jnp.float32, FP8["fp8_e4m3"])  # no 8-bit queries
    rng = np.random.default_rng(6)
    k, v, pt = paged(rng, [6, 9], page=4, dim=16, dtype="float32", max_pages=3, kv_heads=1)
    q = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.bfloat16)
    with pytest.raises(Exception, match="share a dtype"):
        cpu_attention._call(q, k, v, pt, jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([6, 9], jnp.int32), 2,
                            scale=0.25, softcap=None, window=0, layer=0)


def test_unsupported_head_dim_falls_back_to_the_reference():
    rng = np.random.default_rng(1)
    k, v, tables = paged(rng, [5, 9], page=4, dim=8, dtype="float32", max_pages=3, kv_heads=1)
    q = jnp.asarray(rng.standard_normal((2, 2, 8)), jnp.float32)
    args = (q, k, v, tables, jnp.asarray(np.array([5, 9], np.int32)))
    assert not cpu_attention.supports(8, jnp.float32) and cpu_attention.supports(64, jnp.bfloat16)
    out = cpu_attention.paged_decode_attention_cpu(*args, scale=0.3, layer=0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_decode_attention_reference(*args, scale=0.3, layer=0)))


def test_build_is_cached_and_reports_compiler_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    # A one-line source: the cache, not the kernel, is under test (the kernel takes ~15 s to build).
    source = tmp_path / "tiny_kernel.cc"
    source.write_text('extern "C" int jaxserve_tiny_kernel() { return 7; }\n')
    built = native.build(source)
    assert built.parent == tmp_path / "cache" and built.suffix == ".so" and built.name.startswith("tiny_kernel-")
    assert ctypes.CDLL(str(built)).jaxserve_tiny_kernel() == 7
    stamp = os.stat(built).st_mtime_ns
    assert native.build(source) == built and os.stat(built).st_mtime_ns == stamp  # reused, not rebuilt
    source.write_text('extern "C" int jaxserve_tiny_kernel() { return 8; }\n')
    assert native.build(source) != built  # a changed source is built anew

    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    with pytest.raises(native.BuildError, match="broken.cc .*failed"):
        native.build(broken)
    with pytest.raises(native.BuildError, match="missing.cc failed"):  # an OSError, reported as a build error
        native.build(tmp_path / "missing.cc")
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / c++ / clang++ either
    with pytest.raises(native.BuildError, match="no C\\+\\+ compiler"):
        native.compiler()


@each_tier
def test_wide_logits_and_mixed_dtypes(tier):
    """Logits spread over ~+-60 (the kernel's own exp across its whole range) in float32, and
    float32 queries over a bfloat16 cache (--dtype float32 --kv-cache-dtype bfloat16), which the
    kernel widens as it reads, keeping the queries in float32 as the reference does."""
    rng = np.random.default_rng(3)
    lengths = [37, 64, 5]
    k, v, tables = paged(rng, lengths, page=16, dim=32, dtype="float32", max_pages=4, kv_heads=2)
    q = jnp.asarray(rng.standard_normal((3, 4, 32)) * 3.0, jnp.float32)
    args = (q, k, v, tables, jnp.asarray(np.array(lengths, np.int32)))
    out = cpu_attention.paged_decode_attention_cpu(*args, scale=1.0, layer=0, tier=tier)
    ref = paged_decode_attention_reference(*args, scale=1.0, layer=0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL["float32"])  # float32 rounding of |s| ~ 60

    k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    mixed = (q, k16, v16) + args[3:]
    assert cpu_attention.supports(32, jnp.bfloat16, jnp.float32)
    out = cpu_attention.paged_decode_attention_cpu(*mixed, scale=1.0, layer=0, tier=tier)
    assert out.dtype == jnp.float32
    ref = paged_decode_attention_reference(*mixed, scale=1.0, layer=0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL["float32"])


def test_inconsistent_inputs_stay_inside_the_buffers():
    """Under jit nothing validates cu_q_lens: a length past the end of q is clamped (rows beyond it
    are not written), and arrays of the wrong size are refused by the kernel, not read past."""
    rng = np.random.default_rng(4)
    k, v, pt = paged(rng, [6, 9], page=4, dim=16, dtype="float32", max_pages=3, kv_heads=1)
    q = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)
    out = cpu_attention.ragged_paged_attention_cpu(q, k, v, pt, jnp.asarray([0, 5, 1000], jnp.int32),
                                                   jnp.asarray([6, 9], jnp.int32), 2, scale=0.25, layer=0)
    assert np.isfinite(np.asarray(out)).all()
    with pytest.raises(Exception, match="kv_lens"):
        cpu_attention._call(q, k, v, pt, jnp.asarray([0, 5, 8], jnp.int32), jnp.asarray([6], jnp.int32), 2,
                            scale=0.25, softcap=None, window=0, layer=0)
