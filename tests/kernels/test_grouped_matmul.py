"""The mixture-of-experts grouped matmul: the GPU kernel (in the Pallas interpreter) against its
reference, the reference against the CPU loop the model runs, and the tile table both kernels'
grids come from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.moe import _grouped_loop
from pallas_kernels.gpu_grouped_matmul import (
    block_rows_for,
    grouped_matmul_gpu,
    grouped_matmul_reference,
    supports,
    tile_table,
    validate_inputs,
)

# Expert row counts: empty experts, one expert taking every row, an expert spanning several
# tiles with a partial last one, and rows past the last expert's (the caller's padding).
COUNTS = [[5, 0, 3, 0, 0, 9, 1, 2], [0] * 7 + [40], [17, 0, 33, 1, 0, 0, 0, 2], [1] * 8]


def _case(counts: list[int], k: int, n: int, dtype, extra_rows: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = sum(counts) + extra_rows
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(counts), k, n)) * 0.2, dtype)
    return x, jnp.asarray(counts, jnp.int32), w


def _dense(x, counts, w) -> np.ndarray:
    """Each row times its expert's kernel, in float64 on the host."""
    expert_of = np.repeat(np.arange(len(counts)), np.asarray(counts))
    xs = np.asarray(x, np.float64)[: len(expert_of)]
    return np.einsum("rk,rkn->rn", xs, np.asarray(w, np.float64)[expert_of])


@pytest.mark.parametrize("counts", COUNTS)
def test_reference_equals_each_row_times_its_expert(counts):
    x, c, w = _case(counts, 32, 48, jnp.float32)
    ref = np.asarray(grouped_matmul_reference(x, c, w))
    np.testing.assert_allclose(ref[: sum(counts)], _dense(x, counts, w), rtol=1e-5, atol=1e-5)
    assert not ref[sum(counts):].any()  # rows past the last expert's: zero


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_kernel_equals_reference(counts, dtype, tol):
    x, c, w = _case(counts, 64, 96, dtype)
    got = np.asarray(grouped_matmul_gpu(x, c, w), np.float32)[: sum(counts)]  # the real kernel on a GPU
    want = np.asarray(grouped_matmul_reference(x, c, w), np.float32)[: sum(counts)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # And the CPU loop the model runs on this platform computes the same products.
    loop = np.asarray(jax.jit(_grouped_loop)(x, c, w), np.float32)[: sum(counts)]
    np.testing.assert_allclose(loop, want, rtol=tol, atol=tol)


def test_small_tiles_of_many_experts():
    """Tiles of 16 rows over 8 experts of 1-40 rows, blocks of K and N smaller than the widths."""
    x, c, w = _case([40, 1, 16, 17, 0, 2, 31, 5], 128, 256, jnp.float32, extra_rows=0, seed=3)
    got = np.asarray(grouped_matmul_gpu(x, c, w, block_rows=16))
    np.testing.assert_allclose(got, _dense(x, [40, 1, 16, 17, 0, 2, 31, 5], w), rtol=1e-4, atol=1e-4)


def test_tile_table():
    expert, first, rows = (np.asarray(a) for a in tile_table(jnp.asarray([5, 0, 20, 16], jnp.int32), 16, 8))
    # expert 0: rows 0-4; expert 2: rows 5-20 then 21-24; expert 3: rows 25-40; then empty tiles.
    assert rows.tolist() == [5, 16, 4, 16, 0, 0, 0, 0]
    assert first[:4].tolist() == [0, 5, 21, 25]
    assert expert[:4].tolist() == [0, 2, 2, 3] and (expert < 4).all()
    assert block_rows_for(8, 128) == 16 and block_rows_for(4096, 128) == 32 and block_rows_for(1 << 20, 8) == 64


def test_validation():
    assert supports(2048, 768) and supports(32, 48) and not supports(40, 64) and not supports(64, 8)
    x, c, w = _case([2, 2], 32, 32, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        validate_inputs(x[:, :24], c, w[:, :24])
    with pytest.raises(ValueError, match="disagree"):
        validate_inputs(x, c[:1], w)
    with pytest.raises(ValueError, match="integers"):
        validate_inputs(x, c.astype(jnp.float32), w)


@pytest.mark.parametrize("counts", COUNTS[:2])
def test_int8_weights_and_their_scales(counts):
    """--quantization int8's experts: int8 values widened in the kernel, each column scaled by its
    expert's scale; the CPU loop and XLA's ragged dot path (ExpertInt8Weight) agree."""
    from jaxserve.models.moe import _grouped_ragged
    from jaxserve.models.products import ExpertInt8Weight

    x, c, w = _case(counts, 64, 96, jnp.float32, seed=5)
    q = ExpertInt8Weight.quantize(w)
    dequantized = np.asarray(q.q, np.float32) * np.asarray(q.scale)[:, None, :]
    assert np.abs(dequantized - np.asarray(w)).max() <= np.asarray(q.scale).max() / 2 + 1e-7
    want = _dense(x, counts, dequantized)
    n = sum(counts)
    got = np.asarray(grouped_matmul_gpu(x, c, q.q, scale=q.scale))[:n]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grouped_matmul_reference(x, c, q.q, q.scale))[:n], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jax.jit(_grouped_loop)(x, c, q))[:n], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="int8 weights need their scales"):
        validate_inputs(x, c, q.q)
    # XLA's ragged dot with int8 values (the TPU path), here on the CPU's dense lowering.
    np.testing.assert_allclose(np.asarray(jax.jit(_grouped_ragged)(x, c, q))[:n], want, rtol=1e-4, atol=1e-4)
