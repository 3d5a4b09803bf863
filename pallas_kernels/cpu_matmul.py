"""Small-batch bfloat16 products on the CPU through a native kernel (`cpu_matmul.cc`, an XLA FFI
custom call): `x @ w` for a weight w [K, N] packed in strips by `pack` (done once, at start-up).

A decode step multiplies a few rows by every weight of the model, so it streams the weights; XLA's
bfloat16 dot does that at ~10 GB/s on two cores at 16 rows and ~1.4 GB/s at one row (see
benchmarks/RESULTS.md), the kernel at the memory's rate; on the packed layout it also beats XLA's
GEMM at prefill sizes, so it takes every row count. It needs AVX512-BF16 (Zen 4, Sapphire Rapids
and later); `available()` says whether this machine has it and the kernel built.
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
STRIP = 32  # columns per strip of a packed weight: one 64-byte cache line of bfloat16


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


def pack(w: jax.Array) -> jax.Array:
    """A weight w [K, N] in the kernel's strip layout, [ceil(N / 32), K, 32] (N padded with zeros):
    strip s holds columns [32 s, 32 s + 32) of every row, so a product reads each strip as one
    contiguous run instead of one cache line per row ~N apart, which on two Zen 4 cores streams
    ~2x faster at one row (benchmarks/RESULTS.md)."""
    if w.ndim != 2:
        raise ValueError(f"weight of shape {w.shape}: expected a 2-D [K, N] weight")
    k, n = w.shape
    strips = -(-n // STRIP)
    padded = jnp.pad(w, ((0, 0), (0, strips * STRIP - n)))
    return padded.reshape(k, strips, STRIP).transpose(1, 0, 2)


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """pack's inverse: the [K, N] weight."""
    strips, k, _ = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, strips * STRIP)[:, :n]


def uses_kernel(x: jax.Array, packed: jax.Array) -> bool:
    """Whether `matmul` runs the native kernel for these operands (else XLA's GEMM): bfloat16 both,
    at least one row, static shapes, and the kernel built here."""
    if not all(isinstance(d, int) for d in (*x.shape, *packed.shape)):
        return False  # symbolic (exported) shapes
    rows = int(np.prod(x.shape[:-1]))
    return x.dtype == jnp.bfloat16 and packed.dtype == jnp.bfloat16 and rows > 0 and available()


def matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] for `packed` = pack(w)."""
    if packed.ndim != 3 or packed.shape[2] != STRIP or packed.shape[0] != -(-n // STRIP):
        raise ValueError(f"packed weight of shape {packed.shape} does not hold {n} columns in strips of {STRIP}")
    if packed.shape[1] != x.shape[-1]:
        raise ValueError(f"x of shape {x.shape} and packed weight of shape {packed.shape} disagree on K")
    if not uses_kernel(x, packed):
        # XLA's GEMM on the strips: a contraction over K, the strips and their columns kept as
        # output axes, then the padding columns dropped.
        out = jnp.einsum("...k,skc->...sc", x, packed)
        return out.reshape(*x.shape[:-1], -1)[..., :n]
    # Every row count: with each strip contiguous the kernel also beats XLA's GEMM at prefill sizes
    # (512 rows x 576 x 1536: 2.2 ms vs 2.6 ms on two Zen 4 cores), unlike on the [K, N] layout.
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.bfloat16))(x, packed)
