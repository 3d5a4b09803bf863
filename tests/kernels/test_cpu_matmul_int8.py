"""The int8 weight-only product (`cpu_matmul.quantize_int8`, `matmul_int8`, the kernel's second entry
point in `pallas_kernels/cpu_matmul.cc`) against float64 sums over the dequantized weight.

Every |q| <= 127 is exact in bfloat16 and float32, so the kernel computes float32 products and
sums of the exact values q * x, multiplies each sum by its column's scale in float32 and rounds
once to bfloat16. Each output must therefore lie within one bfloat16 rounding of the exact sum
(2^-8 of its magnitude) plus float32 error: K + 2 roundings of 2^-24 of sum_k |x_k| |q_k scale|
(the pairwise adds, the scale's multiply, and the bf16 rounding of that error). A wrong column, a
wrong scale, a dropped row of K or a stray padding byte is far outside that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_tiers import NO_KERNEL, PRODUCT_TIERS

from pallas_kernels import cpu_matmul

# Each test of the kernel runs in every build this machine has (kernel_tiers: AVX512-BF16, AVX2).
each_tier = pytest.mark.parametrize("tier", PRODUCT_TIERS)
needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason=NO_KERNEL)


def _bf16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _quantized(rng, k, n):
    """A [K, N] weight of mixed column scales, quantized and packed: (packed q, scale, q)."""
    w = rng.standard_normal((k, n)) * rng.uniform(0.01, 2.0, n)
    q, scale = jax.jit(cpu_matmul.quantize_int8)(jnp.asarray(w, jnp.float32))
    return jax.jit(cpu_matmul.pack)(q), scale, q


def _bound(x, q, scale, rounding=2.0**-8):
    """The exact x @ (q * scale) in float64, and how far a result rounded once to a format of unit
    roundoff `rounding` (bfloat16: 2^-8) may lie from it (the module doc)."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(q, np.float64) * np.asarray(scale, np.float64)
    exact = x64 @ w64
    magnitude = np.abs(x64) @ np.abs(w64)
    return exact, rounding * np.abs(exact) + (x64.shape[-1] + 2) * 2.0**-24 * magnitude + 1e-30


def _check(got, x, q, scale):
    """got ~ x @ (q * scale) to one bfloat16 rounding plus float32 error."""
    exact, bound = _bound(x, q, scale)
    got = np.asarray(got, np.float64)
    assert got.shape == exact.shape
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)


_matmul = jax.jit(cpu_matmul.matmul_int8, static_argnums=(3, 4))


def test_quantize_exact_on_a_hand_made_weight():
    """scale = max |w| / 127 per column (1.0 for a zero column), q = w / scale rounded half to even;
    a column whose largest magnitude is negative maps it to -127."""
    w = jnp.asarray([[127.0, 0.0, -254.0, 0.5],
                     [2.5, 0.0, 1.0, -0.2],
                     [-3.5, 0.0, 3.0, 0.1],
                     [0.5, 0.0, 100.0, 0.0]], jnp.float32)
    q, scale = cpu_matmul.quantize_int8(w)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and q.shape == (4, 4) and scale.shape == (4,)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray([1.0, 1.0, 2.0, np.float32(0.5) / np.float32(127)],
                                                                np.float32))
    np.testing.assert_array_equal(np.asarray(q), [[127, 0, -127, 127],
                                                  [2, 0, 0, -51],  # 2.5 -> 2, 0.5 -> 0: half to even
                                                  [-4, 0, 2, 25],  # -3.5 -> -4, 1.5 -> 2; -50.8, 25.4
                                                  [0, 0, 50, 0]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_round_trip_within_half_a_step(dtype):
    """|w - q * scale| <= scale / 2 (plus the float32 rounding of w / scale: at most 127 * 2^-24
    of a step), q in [-127, 127], and each column's largest |w| maps to +-127."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((300, 70)) * rng.uniform(1e-3, 10.0, 70), dtype)
    q, scale = jax.jit(cpu_matmul.quantize_int8)(w)
    w64, q64, s64 = np.asarray(w, np.float64), np.asarray(q, np.float64), np.asarray(scale, np.float64)
    assert np.abs(q64).max() <= 127
    np.testing.assert_array_equal(np.abs(q64).max(axis=0), np.full(70, 127))
    np.testing.assert_allclose(s64, np.abs(w64).max(axis=0) / 127, rtol=2**-23)
    assert np.all(np.abs(w64 - q64 * s64) <= s64 * (0.5 + 2**-16))


def test_quantize_empty_and_bad_shapes():
    q, scale = cpu_matmul.quantize_int8(jnp.zeros((0, 3), jnp.float32))
    assert q.shape == (0, 3) and np.asarray(scale).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="2-D"):
        cpu_matmul.quantize_int8(jnp.zeros((2, 3, 4)))


def test_pack_is_the_int8_layout():
    """pack() of int8 values: strip s holds columns [32 s, 32 s + 32), the padding zeros."""
    q = jnp.asarray(np.arange(3 * 70).reshape(3, 70) % 255 - 127, jnp.int8)
    packed = cpu_matmul.pack(q)
    assert packed.dtype == jnp.int8 and packed.shape == (3, 3, 32)
    np.testing.assert_array_equal(np.asarray(packed[2, :, :6]), np.asarray(q[:, 64:]))
    assert not np.asarray(packed[2, :, 6:]).any()
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(packed, 70)), np.asarray(q))


# Rows around the 12-row pass and the equal passes above it (13 = 7 + 6, 25 = 9 + 8 + 8, 64 = 6 x
# 11 minus 2); K of one row, odd (the last row pairs with zeros) and even; N inside one strip, on
# its edge, one past it, a padded last strip and a full layer.
M_VALUES = [1, 2, 11, 12, 13, 25, 64]
K_VALUES = [1, 31, 64, 577]
N_VALUES = [1, 31, 32, 33, 95, 1536]


@each_tier
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("k", K_VALUES)
def test_products_match_float64_sums(m, k, tier):
    rng = np.random.default_rng(m * 1000 + k)
    x = _bf16(rng, m, k)
    for n in N_VALUES:
        packed, scale, q = _quantized(rng, k, n)
        assert cpu_matmul.uses_kernel_int8(x, packed, tier)
        got = _matmul(x, packed, scale, n, tier)
        assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
        _check(got, x, q, scale)


@each_tier
def test_prefill_rows(tier):
    """Hundreds of rows: many passes over each strip from the kept pairs."""
    rng = np.random.default_rng(11)
    x = _bf16(rng, 203, 130)
    packed, scale, q = _quantized(rng, 130, 70)
    _check(_matmul(x, packed, scale, 70, tier), x, q, scale)


@each_tier
def test_leading_dims_are_rows(tier):
    rng = np.random.default_rng(7)
    x = _bf16(rng, 2, 3, 96)
    packed, scale, q = _quantized(rng, 96, 40)
    got = cpu_matmul.matmul_int8(x, packed, scale, 40, tier)
    assert got.shape == (2, 3, 40) and got.dtype == jnp.bfloat16
    _check(got.reshape(6, 40), x.reshape(6, 96), q, scale)


@each_tier
@pytest.mark.parametrize("m", [1, 13])  # one pass; two, the second from the kept pairs
def test_padding_bytes_are_never_read_into_outputs(m, tier):
    """Garbage in the last strip's padding columns (as no pack() makes, but a buffer reused could
    hold) leaves the N valid outputs exact and finite: the kernel reads only N scales and stores
    only N columns."""
    rng = np.random.default_rng(5)
    k, n = 33, 45
    x = _bf16(rng, m, k)
    packed, scale, q = _quantized(rng, k, n)
    garbage = jnp.asarray(rng.integers(-128, 128, (k, 32 - n % 32)), jnp.int8)
    poisoned = packed.at[-1, :, n % 32:].set(garbage)
    assert np.asarray(poisoned[-1, :, n % 32:]).any()
    got = _matmul(x, poisoned, scale, n, tier)
    _check(got, x, q, scale)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(_matmul(x, packed, scale, n, tier), np.float32))


@each_tier
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (13, 577, 95), (25, 64, 33)])
def test_xla_fallback_agrees_with_the_kernel(m, k, n, tier):
    """The fallback (no kernel, or x not bfloat16) rounds the same float32 sums once: both within
    the bound of the exact sum, so within twice it of each other."""
    rng = np.random.default_rng(m + k + n)
    x = _bf16(rng, m, k)
    packed, scale, q = _quantized(rng, k, n)
    kernel = _matmul(x, packed, scale, n, tier)
    xla = jax.jit(cpu_matmul._matmul_int8_xla, static_argnums=3)(x, packed, scale, n)
    _check(kernel, x, q, scale)
    _check(xla, x, q, scale)
    _, bound = _bound(x, q, scale)
    assert np.all(np.abs(np.asarray(kernel, np.float64) - np.asarray(xla, np.float64)) <= 2 * bound)


def test_float32_x_goes_to_xla():
    """float32 activations are XLA's GEMM on the strips, kept in float32."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    packed, scale, q = _quantized(rng, 64, 40)
    assert not cpu_matmul.uses_kernel_int8(x, packed)
    got = cpu_matmul.matmul_int8(x, packed, scale, 40)
    assert got.dtype == jnp.float32 and got.shape == (4, 40)
    exact, bound = _bound(x, q, scale, rounding=2.0**-24)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)


@needs_kernel
def test_inside_a_jitted_function():
    """The custom call composes with other ops under jit (a residual MLP-shaped step)."""
    rng = np.random.default_rng(9)
    x = _bf16(rng, 3, 64)
    up, up_scale, up_q = _quantized(rng, 64, 96)
    down, down_scale, down_q = _quantized(rng, 96, 64)

    @jax.jit
    def step(x, up, up_scale, down, down_scale):
        h = jax.nn.relu(cpu_matmul.matmul_int8(x, up, up_scale, 96))
        return x + cpu_matmul.matmul_int8(h, down, down_scale, 64)

    got = step(x, up, up_scale, down, down_scale)
    pre = cpu_matmul.matmul_int8(x, up, up_scale, 96)
    _check(pre, x, up_q, up_scale)
    h = jax.nn.relu(pre)
    _check(cpu_matmul.matmul_int8(h, down, down_scale, 64), h, down_q, down_scale)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(x + cpu_matmul.matmul_int8(h, down, down_scale, 64), np.float32))


def test_edges_and_bad_shapes():
    """K = 0 (zeros), and operands that do not fit together (refused while tracing)."""
    rng = np.random.default_rng(5)
    empty_q, empty_scale = cpu_matmul.quantize_int8(jnp.zeros((0, 5), jnp.float32))
    empty = _matmul(jnp.zeros((3, 0), jnp.bfloat16), cpu_matmul.pack(empty_q), empty_scale, 5)
    np.testing.assert_array_equal(np.asarray(empty, np.float32), np.zeros((3, 5)))
    x = _bf16(rng, 4, 16)
    packed, scale, _ = _quantized(rng, 16, 8)
    with pytest.raises(ValueError, match="disagree on K"):
        cpu_matmul.matmul_int8(_bf16(rng, 4, 8), packed, scale, 8)
    with pytest.raises(ValueError, match="does not hold 40 columns"):
        cpu_matmul.matmul_int8(x, packed, scale, 40)
    with pytest.raises(ValueError, match="expected int8"):
        cpu_matmul.matmul_int8(x, packed.astype(jnp.bfloat16), scale, 8)
    with pytest.raises(ValueError, match=r"expected \(8,\)"):
        cpu_matmul.matmul_int8(x, packed, jnp.pad(scale, (0, 24)), 8)  # padded scales are refused
