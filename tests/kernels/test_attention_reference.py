"""The pure-jnp references (the CPU serving path) against a naive float64 NumPy attention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    DECODE_LENGTHS,
    MAX_PAGES,
    PAGE,
    TOLERANCES,
    decode_case,
    naive_decode,
    naive_ragged,
    ragged_case,
    run_ragged,
)

from pallas_kernels import (
    get_decode_attention,
    get_ragged_attention,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
    validate_decode_inputs,
    validate_ragged_inputs,
    validate_write_inputs,
    write_kv,
)

def run_decode(q, cache, **kw):
    f = jax.jit(functools.partial(paged_decode_attention_reference, **kw))
    return f(q, cache.k_pages, cache.v_pages, cache.page_tables, cache.kv_lens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_decode_reference_matches_naive(dtype, group, softcap):
    q, cache = decode_case(group * 100 + int(softcap or 0), group=group, dtype=dtype)
    scale = q.shape[-1] ** -0.5
    f = jax.jit(functools.partial(paged_decode_attention_reference, scale=scale, softcap=softcap))
    for window in (0, 3, 6):  # traced, as when the engine scans layers
        out = f(q, cache.k_pages, cache.v_pages, cache.page_tables, cache.kv_lens, window=jnp.int32(window))
        assert out.dtype == q.dtype and out.shape == q.shape
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all()
        expected = naive_decode(q.astype(np.float64), cache, scale=scale, softcap=softcap, window=window)
        np.testing.assert_allclose(out, expected, **TOLERANCES[dtype])
        np.testing.assert_array_equal(out[0], 0.0)  # length-0 padding row


def test_decode_reference_head_dim_128_and_traced_window():
    q, cache = decode_case(7, group=4, dtype="float32", head_dim=128, kv_heads=1)

    @jax.jit
    def per_layer(windows):  # the engine scans layers with a per-layer window array
        def body(_, w):
            return None, paged_decode_attention_reference(
                q, cache.k_pages, cache.v_pages, cache.page_tables, cache.kv_lens, scale=0.1, window=w
            )

        return jax.lax.scan(body, None, windows)[1]

    outs = per_layer(jnp.array([0, 2, 9], jnp.int32))
    for w, out in zip([0, 2, 9], outs):
        expected = naive_decode(q.astype(np.float64), cache, scale=0.1, window=w)
        np.testing.assert_allclose(np.asarray(out), expected, **TOLERANCES["float32"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_ragged_reference_matches_naive(dtype, group, softcap):
    batch = ragged_case(group * 10 + int(softcap or 0), group=group, dtype=dtype)
    scale = batch.q.shape[-1] ** -0.5
    c = batch.cache
    f = jax.jit(functools.partial(ragged_paged_attention_reference, scale=scale, softcap=softcap))
    for window in (0, 3, 6):
        out = f(batch.q, c.k_pages, c.v_pages, c.page_tables, batch.cu_q_lens, c.kv_lens, jnp.int32(batch.num_seqs),
                window=jnp.int32(window))
        assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all()
        expected = naive_ragged(batch, scale=scale, softcap=softcap, window=window)
        np.testing.assert_allclose(out, expected, **TOLERANCES[dtype])
        np.testing.assert_array_equal(out[batch.cu_q_lens[batch.num_seqs] :], 0.0)  # padding rows


@pytest.mark.parametrize("q_block", [1, 2, 4, 16, 64])
def test_ragged_reference_any_q_block(q_block):
    batch = ragged_case(3, group=2, dtype="float32")
    expected = naive_ragged(batch, scale=0.3, window=5)
    out = run_ragged(batch, scale=0.3, window=5, q_block=q_block)
    np.testing.assert_allclose(np.asarray(out), expected, **TOLERANCES["float32"])


@pytest.mark.parametrize("chunk_pages", [1, 2, 3, MAX_PAGES])
def test_references_any_kv_chunk(chunk_pages):
    """The online softmax over page chunks (with a traced trip count) equals one dense pass."""
    batch = ragged_case(6, group=4, dtype="float32")
    expected = naive_ragged(batch, scale=0.3, softcap=4.0, window=7)
    out = run_ragged(batch, scale=0.3, softcap=4.0, window=7, chunk_pages=chunk_pages)
    np.testing.assert_allclose(np.asarray(out), expected, **TOLERANCES["float32"])
    q, cache = decode_case(6, group=4, dtype="float32")
    expected = naive_decode(q.astype(np.float64), cache, scale=0.3, window=7)
    out = run_decode(q, cache, scale=0.3, window=7, chunk_pages=chunk_pages)
    np.testing.assert_allclose(np.asarray(out), expected, **TOLERANCES["float32"])


def test_ragged_reference_no_sequences_and_full_bucket():
    batch = ragged_case(4, group=1, dtype="float32", seqs=[], max_seqs=3, total_tokens=8)
    np.testing.assert_array_equal(np.asarray(run_ragged(batch, scale=1.0)), 0.0)
    # Every slot real and every row used: no padding anywhere.
    batch = ragged_case(5, group=2, dtype="float32", seqs=[(4, 6), (1, 20), (3, 3)], max_seqs=3, total_tokens=8)
    expected = naive_ragged(batch, scale=0.5)
    np.testing.assert_allclose(np.asarray(run_ragged(batch, scale=0.5)), expected, **TOLERANCES["float32"])


def test_ragged_reference_equals_decode_reference_for_one_token_each():
    q, cache = decode_case(11, group=4, dtype="float32")
    n = len(DECODE_LENGTHS)
    cu = np.arange(n + 1, dtype=np.int32)
    cu[1] = 0  # the length-0 row has no query token in ragged form
    cu[2:] = np.arange(1, n, dtype=np.int32)
    decode = np.asarray(run_decode(q, cache, scale=0.25, softcap=3.0, window=jnp.int32(4)))
    ragged = jax.jit(functools.partial(ragged_paged_attention_reference, scale=0.25, softcap=3.0, window=4))(
        q[1:], cache.k_pages, cache.v_pages, cache.page_tables, cu, cache.kv_lens, jnp.int32(n)
    )
    np.testing.assert_allclose(np.asarray(ragged), decode[1:], rtol=1e-6, atol=1e-6)


def test_dispatch_reference_backend():
    assert get_decode_attention("reference") is paged_decode_attention_reference
    assert get_ragged_attention("reference") is ragged_paged_attention_reference
    with pytest.raises(ValueError, match="backend"):
        get_decode_attention("cuda")


def test_write_kv_writes_real_slots_and_drops_padding():
    rng = np.random.default_rng(0)
    kv_heads, num_pages, page_size, head_dim = 2, 4, 4, 8
    k_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    slots = np.array([13, -1, 0, 7, -1], np.int32)
    k_new = rng.standard_normal((5, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((5, kv_heads, head_dim)).astype(np.float32)
    validate_write_inputs(k_pages, v_pages, k_new, v_new, slots)
    f = jax.jit(write_kv, donate_argnums=(0, 1))
    k_out, v_out = f(jnp.asarray(k_pages), jnp.asarray(v_pages), k_new, v_new, slots)
    k_exp, v_exp = k_pages.copy(), v_pages.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            k_exp[:, s // page_size, s % page_size] = k_new[i]
            v_exp[:, s // page_size, s % page_size] = v_new[i]
    np.testing.assert_array_equal(np.asarray(k_out), k_exp)
    np.testing.assert_array_equal(np.asarray(v_out), v_exp)


def test_write_kv_casts_to_cache_dtype():
    k = jnp.zeros((1, 2, 2, 4), jnp.bfloat16)
    new = jnp.ones((1, 1, 4), jnp.float32)
    k_out, _ = write_kv(k, k, new, new, jnp.array([3], jnp.int32))
    assert k_out.dtype == jnp.bfloat16
    assert float(k_out[0, 1, 1, 0]) == 1.0 and float(k_out.sum()) == 4.0


@pytest.mark.parametrize("dtype, top", [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)])
def test_write_kv_rounds_to_an_8bit_cache_and_saturates(dtype, top):
    """An 8-bit float cache stores the values themselves, rounded to nearest; what lies beyond the
    format's range is stored as its largest finite value, never as NaN or inf (a plain cast gives
    NaN for e4m3fn, which has no inf), so one outlier key cannot poison a sequence's softmax."""
    pages = jnp.zeros((2, 1, 3, 4, 8), dtype)  # stacked: 2 layers, 1 kv head, 3 pages of 4
    new = jnp.asarray([[[1.0, -2.5, 0.3, 1e6, -1e6, 3.0e4, 1000.0, -0.0]]], jnp.float32)  # [1 token, 1 head, 8]
    k_out, v_out = jax.jit(write_kv)(pages, pages, new, new, jnp.array([5], jnp.int32), layer=jnp.int32(1))
    assert k_out.dtype == dtype
    got = np.asarray(k_out[1, 0, 1, 1], np.float32)
    expected = np.clip(np.asarray(new[0, 0]), -top, top).astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
    assert got[3] == top and got[4] == -top and np.isfinite(got).all()
    assert np.signbit(got[7])  # -0.0 stays negative
    assert float(jnp.abs(k_out.astype(jnp.float32)).sum()) == float(np.abs(got).sum())  # nothing else written


def _decode_args(**over):
    q, cache = decode_case(0, group=2, dtype="float32", lengths=[3, 7])
    args = dict(q=q, k_pages=cache.k_pages, v_pages=cache.v_pages, page_tables=cache.page_tables, lengths=cache.kv_lens)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=np.zeros((2, 4), np.float32)), r"q must have shape \[batch, q_heads, head_dim\]"),
        (dict(q=np.zeros((2, 3, 16), np.float32)), "multiple of num_kv_heads"),
        (dict(q=np.zeros((2, 4, 8), np.float32)), "head_dim"),
        (dict(q=np.zeros((2, 4, 16), np.int32)), "q must be a floating-point"),
        (dict(v_pages=np.zeros((2, 3, PAGE, 16), np.float32)), "v_pages must have shape"),
        (dict(page_tables=np.zeros((3, MAX_PAGES), np.int32)), r"page_tables must have shape \[batch"),
        (dict(page_tables=np.zeros((2, MAX_PAGES), np.float32)), "page_tables must be an integer"),
        (dict(page_tables=np.full((2, MAX_PAGES), 999, np.int32)), r"page_tables\[0, 0\] = 999 is out of range"),
        (dict(page_tables=np.full((2, MAX_PAGES), -1, np.int32)), "out of range"),
        (dict(lengths=np.array([1, 2, 3], np.int32)), r"lengths must have shape \[batch\]"),
        (dict(lengths=np.array([1, MAX_PAGES * PAGE + 1], np.int32)), r"lengths\[1\] = 21 is out of range"),
    ],
)
def test_validate_decode_inputs_rejects(over, match):
    with pytest.raises(ValueError, match=match):
        validate_decode_inputs(**_decode_args(**over))


def test_validate_decode_inputs_accepts_good_and_traced_inputs():
    validate_decode_inputs(**_decode_args())
    args = _decode_args()
    jax.jit(lambda pt, ln: validate_decode_inputs(**{**args, "page_tables": pt, "lengths": ln}) or 0)(
        args["page_tables"], args["lengths"]
    )
    with pytest.raises(ValueError, match="softcap"):
        validate_decode_inputs(**args, softcap=-1.0)
    with pytest.raises(ValueError, match="window"):
        validate_decode_inputs(**args, window=-2)


def _ragged_args(**over):
    b = ragged_case(1, group=2, dtype="float32")
    c = b.cache
    args = dict(
        q=b.q,
        k_pages=c.k_pages,
        v_pages=c.v_pages,
        page_tables=c.page_tables,
        cu_q_lens=b.cu_q_lens,
        kv_lens=c.kv_lens,
        num_seqs=np.int32(b.num_seqs),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=np.zeros((48, 4), np.float32)), r"q must have shape \[total_tokens, q_heads, head_dim\]"),
        (dict(cu_q_lens=np.zeros(8, np.int32)), r"cu_q_lens must have shape \[max_seqs \+ 1\]"),
        (dict(kv_lens=np.zeros((8, 1), np.int32)), r"kv_lens must have shape \[max_seqs\]"),
        (dict(page_tables=np.zeros((7, MAX_PAGES), np.int32)), r"page_tables must have shape \[max_seqs"),
        (dict(page_tables=np.full((8, MAX_PAGES), 10_000, np.int32)), "out of range"),
        (dict(num_seqs=np.int32(9)), "num_seqs = 9 is out of range"),
        (dict(num_seqs=np.zeros(2, np.int32)), "num_seqs must be an integer scalar"),
        (dict(cu_q_lens=np.array([0, 5, 2, 9, 9, 9, 9, 9, 9], np.int32)), "never decrease"),
        (dict(cu_q_lens=np.array([0, 1, 4, 5, 5, 10, 12, 100, 0], np.int32)), "total_tokens"),
        (dict(kv_lens=np.array([1, 2, 4, 3, 5, 5, 20, 0], np.int32)), "kv_lens must include the new tokens"),
        (dict(kv_lens=np.array([1, 3, 4, 3, 5, 5, 21, 0], np.int32)), r"kv_lens\[6\] = 21 is out of range"),
    ],
)
def test_validate_ragged_inputs_rejects(over, match):
    with pytest.raises(ValueError, match=match):
        validate_ragged_inputs(**_ragged_args(**over))


def test_validate_ragged_inputs_accepts_good_inputs():
    validate_ragged_inputs(**_ragged_args())
    validate_ragged_inputs(**_ragged_args(num_seqs=7))


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(slot_mapping=np.array([0, 99], np.int32)), r"slot_mapping\[1\] = 99 is out of range"),
        (dict(slot_mapping=np.array([0, -2], np.int32)), "out of range"),
        (dict(slot_mapping=np.array([3, 3], np.int32)), "same slot twice"),
        (dict(k_new=np.zeros((2, 1, 8), np.float32)), r"k_new must have shape \[tokens, num_kv_heads, head_dim\]"),
        (dict(v_new=np.zeros((3, 2, 8), np.float32)), "v_new must have shape"),
    ],
)
def test_validate_write_inputs_rejects(over, match):
    args = dict(
        k_pages=np.zeros((2, 4, 4, 8), np.float32),
        v_pages=np.zeros((2, 4, 4, 8), np.float32),
        k_new=np.zeros((2, 2, 8), np.float32),
        v_new=np.zeros((2, 2, 8), np.float32),
        slot_mapping=np.array([0, -1], np.int32),
    )
    validate_write_inputs(**args)
    args.update(over)
    with pytest.raises(ValueError, match=match):
        validate_write_inputs(**args)


@pytest.mark.parametrize("chunk_pages", [1, MAX_PAGES])
def test_references_read_one_layer_of_a_stacked_cache(chunk_pages):
    """With `layer`, the references read only that layer of the engine's stacked
    [layers, kv_heads, pages, page_size, head_dim] cache (the other layers hold NaN)."""
    batch = ragged_case(9, group=2, dtype="float32")
    c = batch.cache
    poison = np.full_like(np.asarray(c.k_pages), np.nan)
    k_all = jnp.asarray(np.stack([poison, np.asarray(c.k_pages), poison]))
    v_all = jnp.asarray(np.stack([poison, np.asarray(c.v_pages), poison]))
    f = jax.jit(functools.partial(ragged_paged_attention_reference, scale=0.3, window=5, chunk_pages=chunk_pages))
    out = f(batch.q, k_all, v_all, c.page_tables, batch.cu_q_lens, c.kv_lens, jnp.int32(batch.num_seqs),
            layer=jnp.int32(1))
    np.testing.assert_allclose(np.asarray(out), naive_ragged(batch, scale=0.3, window=5), **TOLERANCES["float32"])
    q, cache = decode_case(9, group=2, dtype="float32")
    k_all = jnp.asarray(np.stack([np.asarray(cache.k_pages), np.full_like(np.asarray(cache.k_pages), np.nan)]))
    v_all = jnp.asarray(np.stack([np.asarray(cache.v_pages), np.full_like(np.asarray(cache.v_pages), np.nan)]))
    out = jax.jit(functools.partial(paged_decode_attention_reference, scale=0.3, chunk_pages=chunk_pages))(
        q, k_all, v_all, cache.page_tables, cache.kv_lens, layer=jnp.int32(0))
    np.testing.assert_allclose(np.asarray(out), naive_decode(q.astype(np.float64), cache, scale=0.3),
                               **TOLERANCES["float32"])


def _stacked_decode_args(**over):
    args = _decode_args()
    args["k_pages"] = np.stack([args["k_pages"]] * 3)
    args["v_pages"] = np.stack([args["v_pages"]] * 3)
    args["layer"] = np.int32(2)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(layer=None), r"pass layer="),
        (dict(layer=np.int32(3)), r"layer = 3 is out of range \[0, 3\)"),
        (dict(layer=np.int32(-1)), "out of range"),
        (dict(layer=np.zeros(2, np.int32)), "layer must be an integer scalar"),
        (dict(layer=1.0), "layer must be an integer scalar"),
        (dict(v_pages=np.zeros((2, 3, 4, PAGE, 16), np.float32)), "v_pages must have shape"),
        (dict(page_tables=np.full((2, MAX_PAGES), 999, np.int32)), r"num_pages = k_pages.shape\[-3\]"),
    ],
)
def test_validators_check_the_layer_of_a_stacked_cache(over, match):
    validate_decode_inputs(**_stacked_decode_args())
    with pytest.raises(ValueError, match=match):
        validate_decode_inputs(**_stacked_decode_args(**over))


def test_validators_take_a_traced_layer_and_refuse_layer_with_one_layer_pages():
    args = _stacked_decode_args()
    jax.jit(lambda layer: validate_decode_inputs(**{**args, "layer": layer}) or 0)(jnp.int32(1))
    ragged = _ragged_args()
    with pytest.raises(ValueError, match="layer= needs the stacked cache"):
        validate_ragged_inputs(**ragged, layer=np.int32(0))
    stacked = {**ragged, "k_pages": ragged["k_pages"][None], "v_pages": ragged["v_pages"][None]}
    validate_ragged_inputs(**stacked, layer=np.int32(0))
    with pytest.raises(ValueError, match="pass layer="):
        validate_ragged_inputs(**stacked)
    q, cache = decode_case(0, group=2, dtype="float32")
    with pytest.raises(ValueError, match="pass layer="):  # the references check it too (statically)
        paged_decode_attention_reference(q, cache.k_pages[None], cache.v_pages[None], cache.page_tables,
                                         cache.kv_lens, scale=1.0)


def test_write_kv_writes_one_layer_of_a_stacked_cache_in_place():
    rng = np.random.default_rng(1)
    layers, kv_heads, num_pages, page_size, head_dim = 3, 2, 4, 4, 8
    shape = (layers, kv_heads, num_pages, page_size, head_dim)
    k_pages = rng.standard_normal(shape).astype(np.float32)
    v_pages = rng.standard_normal(shape).astype(np.float32)
    slots = np.array([13, -1, 0, 7, 99], np.int32)  # 99: past the cache, dropped like padding
    k_new = rng.standard_normal((5, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((5, kv_heads, head_dim)).astype(np.float32)
    validate_write_inputs(k_pages, v_pages, k_new, v_new, np.where(slots > 15, -1, slots), layer=np.int32(1))
    with pytest.raises(ValueError, match="pass layer="):
        validate_write_inputs(k_pages, v_pages, k_new, v_new, slots)
    f = jax.jit(functools.partial(write_kv), donate_argnums=(0, 1))
    k_out, v_out = f(jnp.asarray(k_pages), jnp.asarray(v_pages), k_new, v_new, slots, layer=jnp.int32(1))
    k_exp, v_exp = k_pages.copy(), v_pages.copy()
    for i, s in enumerate(slots):
        if 0 <= s < num_pages * page_size:
            k_exp[1, :, s // page_size, s % page_size] = k_new[i]
            v_exp[1, :, s // page_size, s % page_size] = v_new[i]
    np.testing.assert_array_equal(np.asarray(k_out), k_exp)
    np.testing.assert_array_equal(np.asarray(v_out), v_exp)
