"""The native CPU attention kernel (`pallas_kernels/cpu_attention.cc`) at serving shapes, and its build.

`test_pallas_kernels.py` runs it through the same small cases as the Pallas kernels (backend "cpu");
here the shapes are the ones it serves: page size 16, head_dim 64 and 128, GQA 3:1, prompts longer
than one 16-row block, prefixes from the cache, scattered pages, NaN in every unused slot and in
the other layers, bfloat16 and float32.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_attention, paged_decode_attention_reference, ragged_paged_attention_reference

TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=2e-2, rtol=2e-2)}


def make_cache(rng, *, layers, kv_heads, num_pages, page, dim, dtype, written):
    """Stacked K/V [layers, kv_heads, pages, page, dim]: NaN everywhere except the `written` slots of
    every layer's pages ({page id: slots}), so any read of an unwritten slot shows up as NaN."""
    shape = (layers, kv_heads, num_pages, page, dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    for p, slots in written.items():
        k[:, :, p, :slots] = rng.standard_normal((layers, kv_heads, slots, dim))
        v[:, :, p, :slots] = rng.standard_normal((layers, kv_heads, slots, dim))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def paged_batch(rng, kv_lens, *, page, max_pages, num_pages):
    """Scattered page tables for sequences of `kv_lens` tokens and the slots each page holds."""
    ids = rng.permutation(num_pages)
    tables = np.zeros((len(kv_lens), max_pages), np.int32)
    written = {}
    used = 0
    for b, n in enumerate(kv_lens):
        for i in range(-(-n // page)):
            tables[b, i] = ids[used]
            written[int(ids[used])] = min(page, n - i * page)
            used += 1
    return tables, written


@pytest.mark.parametrize("dtype,dim,window,softcap", [
    ("bfloat16", 64, 0, None), ("float32", 64, 0, None), ("float32", 128, 37, None), ("bfloat16", 64, 20, 30.0),
])
def test_ragged_prefill_with_prefixes_equals_reference(dtype, dim, window, softcap):
    """Chunks of 40, 17, 1 and 5 new tokens after prefixes of 0, 30, 200 and 3 cached tokens (more
    than one 16-row block, one decode-like row), two padding sequences and padded rows at the end."""
    rng = np.random.default_rng(dim + window)
    page, layers, kv_heads, group = 16, 3, 3, 3
    q_lens = [40, 17, 1, 5, 0, 0]
    kv_lens = [40, 47, 201, 8, 0, 0]
    num_seqs = 4
    max_pages = 16
    tables, written = paged_batch(rng, kv_lens, page=page, max_pages=max_pages, num_pages=64)
    k, v = make_cache(rng, layers=layers, kv_heads=kv_heads, num_pages=64, page=page, dim=dim, dtype=dtype,
                      written=written)
    total = 72  # 63 real rows + padding
    q = jnp.asarray(rng.standard_normal((total, kv_heads * group, dim)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(cu), jnp.asarray(np.array(kv_lens, np.int32)), jnp.int32(num_seqs))
    kw = dict(scale=dim**-0.5, softcap=softcap, window=jnp.int32(window), layer=jnp.int32(1))
    out = jax.jit(functools.partial(cpu_attention.ragged_paged_attention_cpu, **kw))(*args)
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))(*args)
    assert out.dtype == q.dtype and out.shape == q.shape
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    np.testing.assert_array_equal(out[cu[num_seqs]:], 0.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_at_serving_shape_equals_reference(dtype):
    """16 sequences of 0 (padding) to 300 tokens, SmolLM2's heads (9 q, 3 kv, head_dim 64), page 16."""
    rng = np.random.default_rng(7)
    page, layers, kv_heads, group, dim, batch = 16, 2, 3, 3, 64, 16
    lengths = [0, 1, 15, 16, 17, 31, 32, 33, 100, 128, 129, 200, 255, 256, 257, 300]
    tables, written = paged_batch(rng, lengths, page=page, max_pages=19, num_pages=160)
    k, v = make_cache(rng, layers=layers, kv_heads=kv_heads, num_pages=160, page=page, dim=dim, dtype=dtype,
                      written=written)
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, dim)), dtype)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(np.array(lengths, np.int32)))
    for layer in (0, 1):
        kw = dict(scale=0.125, layer=jnp.int32(layer))
        out = np.asarray(jax.jit(functools.partial(cpu_attention.paged_decode_attention_cpu, **kw))(*args), np.float32)
        ref = np.asarray(jax.jit(functools.partial(paged_decode_attention_reference, **kw))(*args), np.float32)
        np.testing.assert_allclose(out, ref, **TOL[dtype])
        np.testing.assert_array_equal(out[0], 0.0)  # length 0: padding


def test_unsupported_head_dim_falls_back_to_the_reference():
    rng = np.random.default_rng(1)
    tables, written = paged_batch(rng, [5, 9], page=4, max_pages=3, num_pages=8)
    k, v = make_cache(rng, layers=1, kv_heads=1, num_pages=8, page=4, dim=8, dtype="float32", written=written)
    q = jnp.asarray(rng.standard_normal((2, 2, 8)), jnp.float32)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(np.array([5, 9], np.int32)))
    assert not cpu_attention.supports(8, jnp.float32) and cpu_attention.supports(64, jnp.bfloat16)
    out = cpu_attention.paged_decode_attention_cpu(*args, scale=0.3, layer=0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_decode_attention_reference(*args, scale=0.3, layer=0)))


def test_build_is_cached_and_reports_compiler_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    built = cpu_attention._build()
    assert built.parent == tmp_path / "cache" and built.suffix == ".so"
    stamp = os.stat(built).st_mtime_ns
    assert cpu_attention._build() == built and os.stat(built).st_mtime_ns == stamp  # reused, not rebuilt

    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", broken)
    with pytest.raises(cpu_attention.BuildError, match="failed"):
        cpu_attention._build()
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / c++ / clang++ either
    with pytest.raises(cpu_attention.BuildError, match="no C\\+\\+ compiler"):
        cpu_attention._compiler()


def test_wide_logits_and_mixed_dtypes():
    """Logits spread over ~+-60 (the kernel's own exp across its whole range) in float32, and
    float32 queries over a bfloat16 cache, which the kernel leaves to the reference (it keeps the
    queries in float32, where the kernel would round them)."""
    rng = np.random.default_rng(3)
    lengths = [37, 64, 5]
    tables, written = paged_batch(rng, lengths, page=16, max_pages=4, num_pages=12)
    k, v = make_cache(rng, layers=1, kv_heads=2, num_pages=12, page=16, dim=32, dtype="float32", written=written)
    q = jnp.asarray(rng.standard_normal((3, 4, 32)) * 3.0, jnp.float32)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(np.array(lengths, np.int32)))
    out = cpu_attention.paged_decode_attention_cpu(*args, scale=1.0, layer=0)
    ref = paged_decode_attention_reference(*args, scale=1.0, layer=0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL["float32"])  # float32 rounding of |s| ~ 60

    k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    mixed = (q, k16, v16) + args[3:]
    assert not cpu_attention.supports(32, jnp.bfloat16, jnp.float32)
    np.testing.assert_array_equal(np.asarray(cpu_attention.paged_decode_attention_cpu(*mixed, scale=1.0, layer=0)),
                                  np.asarray(paged_decode_attention_reference(*mixed, scale=1.0, layer=0)))


def test_inconsistent_inputs_stay_inside_the_buffers():
    """Under jit nothing validates cu_q_lens: a length past the end of q is clamped (rows beyond it
    are not written), and arrays of the wrong size are refused by the kernel, not read past."""
    rng = np.random.default_rng(4)
    tables, written = paged_batch(rng, [6, 9], page=4, max_pages=3, num_pages=8)
    k, v = make_cache(rng, layers=1, kv_heads=1, num_pages=8, page=4, dim=16, dtype="float32", written=written)
    q = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)
    pt = jnp.asarray(tables)
    out = cpu_attention.ragged_paged_attention_cpu(q, k, v, pt, jnp.asarray([0, 5, 1000], jnp.int32),
                                                   jnp.asarray([6, 9], jnp.int32), 2, scale=0.25, layer=0)
    assert np.isfinite(np.asarray(out)).all()
    with pytest.raises(Exception, match="kv_lens"):
        cpu_attention._call(q, k, v, pt, jnp.asarray([0, 5, 8], jnp.int32), jnp.asarray([6], jnp.int32), 2,
                            scale=0.25, softcap=None, window=0, layer=0)
