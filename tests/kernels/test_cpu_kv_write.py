"""The native CPU KV write (`pallas_kernels/cpu_kv_write.cc`): bit for bit `write_kv`'s result for
every cache dtype the engine makes (float32, bfloat16, both 8-bit floats), on a stacked cache and
on one layer's pages, with padding, slots past the cache and a layer past the stack dropped; and
done in place, the donated cache's buffer coming back as the result."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import cpu_kv_write, write_kv

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2]
SHAPE = (3, 2, 5, 4, 16)  # layers, kv_heads, pages, page_size, head_dim
SLOTS = np.array([3, -1, 19, 0, 20, 7, 12], np.int32)  # 20: past the 5 x 4 slots; -1: padding


def bits(x: jax.Array) -> np.ndarray:
    """The array's bytes as unsigned integers: equality that also holds for NaN payloads."""
    return np.asarray(x).view(f"u{jnp.dtype(x.dtype).itemsize}")


def cache(rng: np.random.Generator, dtype, shape=SHAPE) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * 4, jnp.float32).astype(dtype)


@pytest.fixture(autouse=True)
def _built():
    assert cpu_kv_write.available(), "the native CPU KV write did not build (see the log)"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layer", [0, 2, 3])  # 3: past the stack, nothing written
def test_equals_write_kv_on_a_stacked_cache(dtype, layer):
    rng = np.random.default_rng(layer)
    k, v = cache(rng, dtype), cache(rng, dtype)
    # float32 inputs, with values beyond an 8-bit format's range: both writes round and saturate.
    k_new = jnp.asarray(rng.standard_normal((len(SLOTS), SHAPE[1], SHAPE[4])) * 1e3, jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((len(SLOTS), SHAPE[1], SHAPE[4])), jnp.float32)
    expected = write_kv(k, v, k_new, v_new, SLOTS, layer=layer)
    got = jax.jit(cpu_kv_write.write_kv_cpu)(k, v, k_new, v_new, jnp.asarray(SLOTS), layer=jnp.int32(layer))
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(bits(g), bits(e))
    if layer == 3:
        np.testing.assert_array_equal(bits(got[0]), bits(k))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
def test_equals_write_kv_on_one_layers_pages(dtype):
    rng = np.random.default_rng(7)
    k, v = cache(rng, dtype, SHAPE[1:]), cache(rng, dtype, SHAPE[1:])
    k_new = jnp.asarray(rng.standard_normal((len(SLOTS), SHAPE[1], SHAPE[4])), dtype)
    v_new = jnp.asarray(rng.standard_normal((len(SLOTS), SHAPE[1], SHAPE[4])), dtype)
    for e, g in zip(write_kv(k, v, k_new, v_new, SLOTS), cpu_kv_write.write_kv_cpu(k, v, k_new, v_new, SLOTS)):
        assert g.shape == SHAPE[1:]
        np.testing.assert_array_equal(bits(g), bits(e))


def test_writes_the_donated_cache_in_place():
    rng = np.random.default_rng(3)
    k, v = cache(rng, jnp.float8_e4m3fn), cache(rng, jnp.float8_e4m3fn)
    pointers = k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()
    new = jnp.ones((len(SLOTS), SHAPE[1], SHAPE[4]), jnp.float32)
    f = jax.jit(functools.partial(cpu_kv_write.write_kv_cpu, layer=1), donate_argnums=(0, 1))
    k_out, v_out = f(k, v, new, new, jnp.asarray(SLOTS))
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    assert float(k_out[1, :, 0, 3].astype(jnp.float32).min()) == 1.0  # slot 3: page 0, offset 3


def test_the_cpu_backend_writes_natively_and_the_others_scatter():
    assert pallas_kernels.get_kv_write("cpu") is cpu_kv_write.write_kv_cpu
    for backend in ("reference", "pallas_gpu", "pallas_tpu"):
        assert pallas_kernels.get_kv_write(backend) is write_kv
    with pytest.raises(ValueError, match="attention backend must be one of"):
        pallas_kernels.get_kv_write("cuda")
