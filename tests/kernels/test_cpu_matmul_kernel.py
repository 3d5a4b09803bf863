"""The native CPU product kernel (`pallas_kernels/cpu_matmul.cc`) against float64 sums of the same
bfloat16 inputs (the decoder and the engine on it: tests/engine/test_matmul_backend.py), in every
build this machine runs (kernel_tiers: AVX512-BF16 and AVX2).

The kernel adds float32 products in its own order and rounds once to bfloat16, so each output must
lie within one bfloat16 rounding (2^-8 relative) plus float32 summation error of the exact sum; a
wrong column order or a dropped tail is far outside that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_tiers import PRODUCT_TIERS

from pallas_kernels import cpu_matmul


def _bf16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _check(got, x, w_kn):
    """got ~ x @ w_kn (w_kn [K, N]) to one bfloat16 rounding plus float32 summation error."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w_kn, np.float64)
    exact = x64 @ w64
    magnitude = np.abs(x64) @ np.abs(w64)  # bounds the float32 summation error (K * 2^-24 * this)
    got = np.asarray(got, np.float64)
    assert got.shape == exact.shape and got.dtype == np.float64
    bound = 2.0**-8 * np.abs(exact) + x64.shape[-1] * 2.0**-24 * magnitude + 1e-30
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)


def _packed(w):
    return jax.jit(cpu_matmul.pack)(w)


# Rows: 1 (a decode step of one sequence: a pass of its own, also over an odd K), counts around the
# 12-row pass, and prefill sizes (the kernel takes every row count). K and N: multiples of the 32-wide strips, odd K (the last row pairs
# with zeros) and N not a multiple of 32 (a padded last strip, stored masked).
SHAPES = [(1, 576, 1536), (1, 577, 100), (3, 64, 96), (8, 1536, 576), (9, 577, 100), (12, 64, 64), (13, 96, 32),
          (16, 576, 192), (17, 31, 33), (25, 64, 96), (32, 576, 576), (5, 7, 1), (64, 96, 40), (203, 130, 70)]


@pytest.mark.parametrize("tier", PRODUCT_TIERS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_products_match_float64_sums(m, k, n, tier):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = _bf16(rng, m, k), _bf16(rng, k, n)
    assert cpu_matmul.uses_kernel(x, _packed(w), tier)
    got = jax.jit(cpu_matmul.matmul, static_argnums=(2, 3))(x, _packed(w), n, tier)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    _check(got, x, w)


def test_pack_layout():
    """Strip s holds columns [32 s, 32 s + 32) of every row, contiguous; the padding is zeros;
    unpack gives the weight back."""
    w = jnp.arange(3 * 70, dtype=jnp.float32).reshape(3, 70).astype(jnp.bfloat16)
    packed = cpu_matmul.pack(w)
    assert packed.shape == (3, 3, 32)
    np.testing.assert_array_equal(np.asarray(packed[1, 2]), np.asarray(w[2, 32:64]))
    np.testing.assert_array_equal(np.asarray(packed[2, :, :6]), np.asarray(w[:, 64:]))
    assert not np.asarray(packed[2, :, 6:], np.float32).any()
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(packed, 70)), np.asarray(w))


@pytest.mark.parametrize("tier", PRODUCT_TIERS)
def test_leading_dims_are_rows(tier):
    """x [..., K] with several leading dims: they are flattened into rows and restored."""
    rng = np.random.default_rng(7)
    m, k, n = 6, 96, 64
    x, w = _bf16(rng, 2, 3, k), _bf16(rng, k, n)
    got = cpu_matmul.matmul(x, _packed(w), n, tier)
    assert got.shape == (2, 3, n)
    _check(got.reshape(m, n), x.reshape(m, k), w)


def test_what_the_kernel_does_not_cover_goes_to_xla():
    """float32 operands are XLA's GEMM on the strips: bit-identical to x @ w."""
    rng = np.random.default_rng(3)
    x32, w32 = _bf16(rng, 4, 64).astype(jnp.float32), _bf16(rng, 64, 40).astype(jnp.float32)
    assert not cpu_matmul.uses_kernel(x32, cpu_matmul.pack(w32))
    np.testing.assert_array_equal(np.asarray(cpu_matmul.matmul(x32, cpu_matmul.pack(w32), 40)),
                                  np.asarray(x32 @ w32))


@pytest.mark.parametrize("tier", PRODUCT_TIERS)
def test_edges_and_bad_shapes(tier):
    """K = 0 (zeros), and shapes that do not fit together (refused while tracing)."""
    rng = np.random.default_rng(5)
    empty = jax.jit(cpu_matmul.matmul, static_argnums=(2, 3))(jnp.zeros((3, 0), jnp.bfloat16),
                                                              cpu_matmul.pack(jnp.zeros((0, 5), jnp.bfloat16)), 5, tier)
    np.testing.assert_array_equal(np.asarray(empty, np.float32), np.zeros((3, 5)))
    w = _bf16(rng, 16, 8)
    x = _bf16(rng, 4, 16)
    with pytest.raises(ValueError, match="2-D"):
        cpu_matmul.pack(jnp.stack([w, w]))  # a stacked weight
    with pytest.raises(ValueError, match="disagree on K"):
        cpu_matmul.matmul(x, cpu_matmul.pack(w.T), 16)  # [8, 16]: K = 8, not 16
    with pytest.raises(ValueError, match="does not hold 40 columns"):
        cpu_matmul.matmul(x, cpu_matmul.pack(w), 40)
