"""Block-quantized products (`pallas_kernels/cpu_qmatmul.py` and its native kernel) against float64
sums over the dequantized weight, for the 4-bit (Q4: w = q d + mn) and 8-bit (Q8: w = q d) formats,
every group size the server offers, and shapes crossing each tile edge.

The kernel sums exact products x q per group in float32, scales each group's sum by d, adds mn
times the group's float32 sum of x, and rounds to bfloat16 once. So every output lies within one
bfloat16 rounding of the exact sum (2^-8 of it) plus float32 error, bounded here by (K + 4 K / G
+ 4) roundings of 2^-24 of sum_k |x_k| (|q_k d| + |mn|). A wrong nibble, column, group, scale or
minimum is far outside that.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_tiers import BLOCK_TIERS, NO_KERNEL

from jaxserve.models import products
from jaxserve.weights import gguf_file
from pallas_kernels import cpu_qmatmul as Q

needs_kernel = pytest.mark.skipif(not Q.available(), reason=NO_KERNEL)
# Each test of the kernel runs in every build this machine has (kernel_tiers: AVX512-BF16, AVX2).
each_tier = pytest.mark.parametrize("tier", BLOCK_TIERS)


def _weight(rng, k, n):
    """A [K, N] weight with columns of mixed scales and offsets (so minima matter)."""
    return jnp.asarray(rng.standard_normal((k, n)) * rng.uniform(0.01, 2.0, n) + rng.uniform(-0.5, 0.5, n),
                       jnp.float32)


def _blocks(rng, k, n, group, bits):
    """(q, d, mn or None), quantized from a random weight."""
    w = _weight(rng, k, n)
    if bits == 4:
        return jax.jit(Q.quantize_q4, static_argnums=1)(w, group)
    q, d = jax.jit(Q.quantize_q8, static_argnums=1)(w, group)
    return q, d, None


def _packed(q, d, mn):
    return (Q.pack_q4(q) if mn is not None else Q.pack_q8(q)), Q.pack_scales(d, mn)


def _product(x, packed, scales, n, bits, tier="native"):
    f = Q.matmul_q4 if bits == 4 else Q.matmul_q8
    return jax.jit(f, static_argnums=(3, 4))(x, packed, scales, n, tier)


def _check(got, x, q, d, mn, weight_rounding=0.0):
    """got ~ x @ dequantize(q, d, mn) to one bfloat16 rounding plus float32 error (module doc),
    plus `weight_rounding` of the magnitude where the weight itself was rounded (XLA's bf16 dot)."""
    x64 = np.asarray(x, np.float64)
    k, n = q.shape
    group = k // d.shape[0]
    qd = (np.asarray(q, np.float64).reshape(k // group, group, n) * np.asarray(d, np.float64)[:, None]).reshape(k, n)
    offset = 0 if mn is None else np.repeat(np.asarray(mn, np.float64), group, axis=0)
    exact = x64 @ (qd + offset)
    magnitude = np.abs(x64) @ (np.abs(qd) + np.abs(offset))
    bound = 2.0**-8 * np.abs(exact) + ((k + 4 * k // group + 4) * 2.0**-24 + weight_rounding) * magnitude + 1e-30
    got = np.asarray(got, np.float64)
    assert got.shape == exact.shape
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)


def test_quantize_q4_on_a_hand_made_group():
    """mn = the group's minimum, d = (max - min) / 15 (both float16), q = (w - mn) / d rounded; a
    constant group stores d = 0 and q = 0."""
    w = jnp.asarray(np.stack([np.linspace(-1.0, 2.0, 4), [0.25] * 4], axis=1), jnp.float32)  # [4, 2]
    q, d, mn = Q.quantize_q4(w, 2)
    assert q.dtype == jnp.uint8 and d.dtype == jnp.float16 and mn.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(mn, np.float32), [[-1.0, 0.25], [1.0, 0.25]])
    np.testing.assert_array_equal(np.asarray(d, np.float32), [[np.float16(1 / 15), 0], [np.float16(1 / 15), 0]])
    np.testing.assert_array_equal(np.asarray(q), [[0, 0], [15, 0], [0, 0], [15, 0]])


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_q4_round_trip_within_half_a_step(group):
    rng = np.random.default_rng(group)
    w = _weight(rng, 256, 70)
    q, d, mn = Q.quantize_q4(w, group)
    assert int(np.asarray(q).max()) <= 15
    back = np.asarray(Q.dequantize(q, d, mn), np.float64)
    step = np.repeat(np.asarray(d, np.float64), group, axis=0)
    mn_err = np.repeat(np.abs(np.asarray(mn, np.float64) - np.asarray(w, np.float64).reshape(-1, group, 70).min(1)),
                       group, axis=0)
    assert np.all(np.abs(back - np.asarray(w, np.float64)) <= step * (0.5 + 2**-10) + mn_err)


def test_quantize_q8_round_trip_and_bad_groups():
    rng = np.random.default_rng(1)
    w = _weight(rng, 64, 9)
    q, d = Q.quantize_q8(w, 32)
    assert np.abs(np.asarray(q, np.int32)).max() == 127
    back = np.asarray(Q.dequantize(q, d), np.float64)
    assert np.all(np.abs(back - np.asarray(w)) <= np.repeat(np.asarray(d, np.float64), 32, axis=0) * 0.51)
    with pytest.raises(ValueError, match="whole number of groups"):
        Q.quantize_q4(w[:48], 32)
    with pytest.raises(ValueError, match="whole number of groups"):
        Q.quantize_q8(w, 3)


def test_pack_q4_layout_and_round_trip():
    """Byte j of a strip's row pair holds rows k + j % 2 of columns j / 2 (low nibble) and
    16 + j / 2 (high nibble); unpack_q4 inverts it, padding columns zero."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.integers(0, 16, (6, 40)), jnp.uint8)
    packed = Q.pack_q4(q)
    assert packed.shape == (2, 3, 32) and packed.dtype == jnp.uint8
    qn = np.asarray(q)
    assert int(packed[0, 1, 5]) == qn[3, 2] | (qn[3, 18] << 4)  # pair 1 = rows 2, 3; j = 5 -> row 3
    assert int(packed[1, 2, 14]) == qn[4, 39] | 0  # strip 1 column 7 = 39; column 23 is padding
    np.testing.assert_array_equal(np.asarray(Q.unpack_q4(packed, 40)), qn)
    d, mn = (jnp.asarray(rng.standard_normal((3, 40)), jnp.float16) for _ in range(2))
    sd, smn = Q.unpack_scales(Q.pack_scales(d, mn), 40)
    np.testing.assert_array_equal(np.asarray(sd), np.asarray(d))
    np.testing.assert_array_equal(np.asarray(smn), np.asarray(mn))


# Rows around the 6-row pass (7 = 4 + 3, 13 = 5 + 4 + 4 from the kept pairs, 64); K of one group
# and several; N inside one strip, on its edge, one past it, a padded last strip and a full layer.
M_VALUES = [1, 2, 5, 6, 7, 13, 64]
K_GROUPS = [(32, 32), (64, 32), (576, 32), (128, 64), (256, 128), (48, 16)]
N_VALUES = [1, 31, 32, 33, 95, 1536]


@each_tier
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("k,group", K_GROUPS)
def test_products_match_float64_sums(bits, m, k, group, tier):
    rng = np.random.default_rng(m * 1000 + k + bits)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    for n in N_VALUES:
        q, d, mn = _blocks(rng, k, n, group, bits)
        packed, scales = _packed(q, d, mn)
        got = _product(x, packed, scales, n, bits, tier)
        assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
        _check(got, x, q, d, mn)


@each_tier
@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_rows_and_leading_dims(bits, tier):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((3, 67, 128)), jnp.bfloat16)
    q, d, mn = _blocks(rng, 128, 70, 32, bits)
    got = _product(x, *_packed(q, d, mn), 70, bits, tier)
    assert got.shape == (3, 67, 70)
    _check(got.reshape(-1, 70), x.reshape(-1, 128), q, d, mn)


@each_tier
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 13])  # one pass; several, the later ones from the kept pairs
def test_nan_poisoned_padding_never_reaches_outputs(bits, m, tier):
    """NaN scales and minima and all-ones values in the last strip's padding columns (no pack makes
    them, a reused buffer could hold them) leave the N valid outputs exact and finite."""
    rng = np.random.default_rng(5)
    k, n = 64, 45
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    q, d, mn = _blocks(rng, k, n, 32, bits)
    packed, scales = _packed(q, d, mn)
    pad = n % 32
    poisoned_scales = scales.at[-1, :, :, pad:].set(jnp.float16(jnp.nan))
    if bits == 4:  # padding columns are bytes' halves: columns 13-15 low nibbles, 29-31 high ones
        lanes = np.zeros(32, np.uint8)
        for col in range(pad, 32):
            for row in range(2):
                lanes[2 * (col % 16) + row] |= 0x0F if col < 16 else 0xF0
        poisoned = packed.at[-1].set(packed[-1] | jnp.asarray(lanes))
    else:
        poisoned = packed.at[-1, :, pad:].set(jnp.int8(-128))
    got = _product(x, poisoned, poisoned_scales, n, bits, tier)
    _check(got, x, q, d, mn)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(_product(x, packed, scales, n, bits, tier), np.float32))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_xla_fallback_agrees_with_the_kernel(bits):
    """float32 x (or no kernel) dequantizes into XLA's dot: within float32 rounding of the exact sum."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 96)), jnp.float32)
    q, d, mn = _blocks(rng, 96, 40, 32, bits)
    got = _product(x, *_packed(q, d, mn), 40, bits)
    assert got.dtype == jnp.float32
    exact = np.asarray(x, np.float64) @ np.asarray(Q.dequantize(q, d, mn), np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=1e-5, atol=1e-4)


def test_shape_errors():
    rng = np.random.default_rng(4)
    q, d, mn = _blocks(rng, 64, 40, 32, 4)
    packed, scales = _packed(q, d, mn)
    with pytest.raises(ValueError, match="disagree on K"):
        Q.matmul_q4(jnp.zeros((1, 32), jnp.bfloat16), packed, scales, 40)
    with pytest.raises(ValueError, match="strips"):
        Q.matmul_q4(jnp.zeros((1, 64), jnp.bfloat16), packed, scales, 80)
    with pytest.raises(ValueError, match="float16"):
        Q.matmul_q4(jnp.zeros((1, 64), jnp.bfloat16), packed, scales.astype(jnp.bfloat16), 40)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_exactly(type_name):
    """The blocks jaxserve keeps are the file's: q d (+ mn) equals the gguf package's dequantized
    values bit for bit."""
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((8, 96)) * rng.uniform(0.01, 2, (8, 1))).astype(np.float32)
    kind = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(w, kind)
    q, d, mn = gguf_file.decode_blocks(raw, type_name, 8, 96)
    back = np.asarray(Q.dequantize(jnp.asarray(q.T), jnp.asarray(d.T), None if mn is None else jnp.asarray(mn.T))).T
    np.testing.assert_array_equal(back, gguf.quants.dequantize(raw, kind))


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("bits", [4, 8])
def test_embedding_rows_of_a_block_quantized_head(backend, bits):
    """A tied head kept in blocks looks up dequantized rows (products.rows), equal to the rows of
    the dequantized [N, K] table, and multiplies as its transpose (products.head; on XLA the
    dequantized weight enters the dot in x's dtype, bfloat16, one more rounding)."""
    if backend == "cpu" and not Q.available():
        pytest.skip("needs the native kernel")
    rng = np.random.default_rng(8)
    q, d, mn = _blocks(rng, 64, 70, 32, bits)  # [K, N]: the head's transpose
    b = products.Blocks(q, d, mn, bits)
    w = products.CpuGroupWeight.of(b) if backend == "cpu" else products.GroupWeight.of(b)
    table = np.asarray(Q.dequantize(q, d, mn)).T  # [N, K]
    ids = jnp.asarray([[0, 69], [33, 16]])
    np.testing.assert_array_equal(np.asarray(products.rows(w, ids, jnp.float32)), table[np.asarray(ids)])
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    _check(products.head(x, w), x, q, d, mn, weight_rounding=2.0**-8 if backend == "xla" else 0.0)


@pytest.mark.parametrize("type_name, size", [("Q4_K", 144), ("Q6_K", 210)])
def test_gguf_k_quant_blocks_decode_exactly(type_name, size):
    """K-quant super-blocks (random bytes, finite scales) decode to 4-bit groups of 32 (Q4_K) or
    8-bit groups of 16 (Q6_K) with float32 scales whose q d (+ mn) is the gguf package's value
    bit for bit."""
    rng = np.random.default_rng(9)
    rows, supers = 3, 2
    b = rng.integers(0, 256, (rows, supers, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 0.05, (rows, supers, 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":
        b[..., 0:4] = scales  # d, dmin
    else:
        b[..., 208:210] = scales[..., :2]  # d
    raw = b.reshape(rows, -1)
    q, d, mn = gguf_file.decode_blocks(raw, type_name, rows, supers * 256)
    assert d.dtype == np.float32 and d.shape == (rows, supers * 256 // (32 if type_name == "Q4_K" else 16))
    assert q.dtype == (np.uint8 if type_name == "Q4_K" else np.int8)
    back = np.asarray(Q.dequantize(jnp.asarray(q.T), jnp.asarray(d.T), None if mn is None else jnp.asarray(mn.T))).T
    np.testing.assert_array_equal(back, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))


@each_tier
@pytest.mark.parametrize("bits, group", [(4, 32), (8, 16)])
@pytest.mark.parametrize("m", [1, 7, 13])
def test_float32_scales(bits, group, m, tier):
    """The K-quants' float32 scales (and minima): the same bound as float16 ones."""
    rng = np.random.default_rng(m + bits)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    for n in (33, 1536):
        q, d, mn = _blocks(rng, 256, n, group, bits)
        d = d.astype(jnp.float32) * jnp.float32(1 + 2**-13)  # off float16's grid
        mn = None if mn is None else mn.astype(jnp.float32) * jnp.float32(1 - 2**-13)
        packed, scales = _packed(q, d, mn)
        assert scales.dtype == jnp.float32
        _check(_product(x, packed, scales, n, bits, tier), x, q, d, mn)
