"""Small-batch bfloat16 products on the CPU through a native kernel (`cpu_matmul.cc`, an XLA FFI
custom call): `x @ w` for a Linear kernel w [K, N] and `x @ w.T` for an LM head w [N, K], either
one weight or one layer of a stacked [L, ...] weight.

A decode step multiplies a few rows by every weight of the model, so it streams the weights; XLA's
bfloat16 dot does that at ~10 GB/s on two cores at 16 rows and ~1.4 GB/s at one row (see
benchmarks/RESULTS.md), the kernel at close to the memory's rate. It needs AVX512-BF16 (Zen 4,
Sapphire Rapids and later); `available()` says whether this machine has it and the kernel built.
Above `MAX_ROWS` rows (prefill) XLA's blocked GEMM is the faster one, so `supports` says no.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.native import BuildError

log = logging.getLogger("jaxserve.kernels")

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "jaxserve_cpu_matmul"
MAX_ROWS = 32


@functools.cache
def _register() -> bool:
    """Build (or find) the kernel and register it with XLA once per process; False when the CPU
    lacks the instructions. Raises BuildError."""
    lib = native.load(SOURCE)
    if not lib.JaxserveMatmulSupported():
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveMatmul), platform="cpu")
    return True


def ensure_built() -> bool:
    """Build and register the kernel now; False when the CPU lacks AVX512-BF16; raises BuildError
    (with the compiler's message) when it does not build."""
    return _register()


@functools.cache
def available() -> bool:
    """Whether the kernel builds, loads and has its instructions here (logs why not, once)."""
    try:
        ok = _register()
    except BuildError as e:
        log.warning("native CPU products unavailable, using XLA's dot: %s", e)
        return False
    if not ok:
        log.info("native CPU products need AVX512-BF16, which this CPU lacks; using XLA's dot")
    return ok


def supports(x: jax.Array, w: jax.Array) -> bool:
    """Whether the kernel computes this product: bfloat16 both, 1..MAX_ROWS rows of x, K > 0,
    static shapes."""
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return False  # symbolic (exported) shapes: XLA's dot
    rows = int(np.prod(x.shape[:-1]))
    return (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and 0 < rows <= MAX_ROWS and x.shape[-1] > 0
            and available())


def _layer_of(x: jax.Array, w: jax.Array, layer: jax.Array | int | None, k_axis: int) -> jax.Array | None:
    """Checks the shapes (at trace time, for both paths) and returns the layer index clamped into
    [0, L) -- for the kernel and the fallback alike, so both read the same layer -- or None for a
    single weight."""
    if w.ndim != (2 if layer is None else 3):
        raise ValueError(f"weight of shape {w.shape} with layer={layer!r}: expected a 2-D weight, "
                         "or a stacked 3-D one with a layer index")
    if w.shape[k_axis] != x.shape[-1]:
        raise ValueError(f"x of shape {x.shape} and weight of shape {w.shape} disagree on K")
    return None if layer is None else jnp.clip(jnp.asarray(layer, jnp.int32).reshape(()), 0, w.shape[0] - 1)


def _call(x: jax.Array, w: jax.Array, layer: jax.Array | None, transposed: bool, n: int) -> jax.Array:
    layer = jnp.zeros((), jnp.int32) if layer is None else layer
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.bfloat16))(
        x, w, layer, transposed=transposed)


def matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] (or layer `layer` of w [L, K, N], clamped into [0, L)) -> [..., N], as
    `x @ w` would give it."""
    layer = _layer_of(x, w, layer, -2)
    if not supports(x, w):
        w = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
        return x @ w
    return _call(x, w, layer, False, w.shape[-1])


def matmul_transposed(x: jax.Array, w: jax.Array, layer: jax.Array | int | None = None) -> jax.Array:
    """x [..., K] @ w.T for w [N, K] (or layer `layer` of w [L, N, K], clamped into [0, L)) ->
    [..., N], as the einsum would give it."""
    layer = _layer_of(x, w, layer, -1)
    if not supports(x, w):
        w = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
        return jnp.einsum("...k,nk->...n", x, w)
    return _call(x, w, layer, True, w.shape[-2])
