"""Small-batch bfloat16 products on the CPU through a native kernel (`cpu_matmul.cc`, an XLA FFI
custom call): `x @ w` for a Linear kernel w [K, N] and `x @ w.T` for an LM head w [N, K].

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


def _check_shapes(x: jax.Array, w: jax.Array, k_axis: int) -> None:
    """Refuses, while tracing and for the kernel and the fallback alike, shapes that do not fit."""
    if w.ndim != 2:
        raise ValueError(f"weight of shape {w.shape}: expected a 2-D weight")
    if w.shape[k_axis] != x.shape[-1]:
        raise ValueError(f"x of shape {x.shape} and weight of shape {w.shape} disagree on K")


def _call(x: jax.Array, w: jax.Array, transposed: bool, n: int) -> jax.Array:
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.bfloat16))(
        x, w, transposed=transposed)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N], as `x @ w` would give it."""
    _check_shapes(x, w, 0)
    if not supports(x, w):
        return x @ w
    return _call(x, w, False, w.shape[1])


def matmul_transposed(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w.T for w [N, K] -> [..., N], as the einsum would give it."""
    _check_shapes(x, w, 1)
    if not supports(x, w):
        return jnp.einsum("...k,nk->...n", x, w)
    return _call(x, w, True, w.shape[0])
