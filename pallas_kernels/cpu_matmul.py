"""Small-batch bfloat16 products on the CPU through a native kernel (`cpu_matmul.cc`, an XLA FFI
custom call): `x @ w` for a weight w [K, N] packed in strips by `pack` (done once, at start-up).

A decode step multiplies a few rows by every weight of the model, so it streams the weights; XLA's
bfloat16 dot does that at ~10 GB/s on two cores at 16 rows and ~1.4 GB/s at one row (see
benchmarks/RESULTS.md), the kernel at the memory's rate; on the packed layout it also beats XLA's
GEMM at prefill sizes, so it takes every row count. It is built for the best instructions this CPU
has: AVX512-BF16 (Zen 4, Sapphire Rapids and later), else AVX2 with FMA and F16C (x86-64-v3: every
x86 server CPU since Haswell and Zen 1), where `cpu_avx2.h` widens the stored values to float32 and
sums with FMAs, same layouts, same results to float32 rounding. `available()` says whether the
kernel built and has its instructions here, `isa()` which ones it uses. The tests also build the
AVX2 code on CPUs that have AVX512-BF16 (tier "avx2", `TIERS`), so both are checked on either.

int8 weights (`quantize_int8`, `pack`, `matmul_int8`): per output column, symmetric, w ~= q * scale.
The kernel's second entry point widens the int8 strips to bfloat16 exactly (|q| <= 127) inside
its loop, so it reads one byte per weight and sums as exactly as the bf16 kernel on q * scale (the
scale multiplies each float32 sum before the one rounding). On the 2-core Zen 4, weights streamed
from DRAM, us per product, bf16 kernel -> int8 kernel: 576 x 1536 at 1 row 57-60 -> 30-33, at 16
rows 92-94 -> 81; 1536 x 576 at 1 row 65-75 -> 35-38, at 16 rows 80-84 -> 80-85; level from 16 to
512 rows (the table, the alternatives measured and the command: "int8 weights" in cpu_matmul.cc).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

log = logging.getLogger("jaxserve.kernels")

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "jaxserve_cpu_matmul"
TARGET_INT8 = "jaxserve_cpu_matmul_int8"  # the int8 weight-only product (`matmul_int8`)
STRIP = 32  # columns per strip of a packed weight: one 64-byte cache line of bfloat16

# Builds of the product kernels (here and in cpu_qmatmul.py), by name -> their -D flags. "native"
# is what serving uses: the best instructions of this CPU. "avx2" is the AVX2 + FMA code even where
# AVX512-BF16 exists, a library and FFI targets of its own (names suffixed "_avx2"), for the tests.
TIERS: dict[str, tuple[str, ...]] = {"native": (), "avx2": ("-DJAXSERVE_FORCE_AVX2",)}
NEEDS = "AVX512-BF16, or AVX2 with FMA and F16C"  # what the CPU must have, for messages
ISA_NAMES = {2: "AVX512-BF16", 1: "AVX2"}  # JaxserveMatmulIsa() -> name


def target_name(target: str, tier: str) -> str:
    """The FFI target of `target` in the build `tier`."""
    if tier not in TIERS:
        raise ValueError(f"kernel tier must be one of {', '.join(TIERS)}; got {tier!r}")
    return target if tier == "native" else f"{target}_{tier}"


@functools.cache
def _register(tier: str = "native") -> bool:
    """Build (or find) the kernel and register it with XLA once per process; False when the CPU
    lacks the instructions. Raises BuildError."""
    return native.register(SOURCE, "JaxserveMatmulSupported",
                           {target_name(TARGET, tier): "JaxserveMatmul",
                            target_name(TARGET_INT8, tier): "JaxserveMatmulInt8"}, TIERS[tier])


def ensure_built(tier: str = "native") -> bool:
    """Build and register the kernel now; False when the CPU lacks the instructions (`NEEDS`);
    raises BuildError (with the compiler's message) when it does not build."""
    return _register(tier)


@functools.cache
def available(tier: str = "native") -> bool:
    """Whether the kernel builds, loads and has its instructions here (logs why not, once)."""
    return native.usable(lambda: _register(tier), "native CPU products", "using XLA's dot", NEEDS)


def isa(tier: str = "native") -> str | None:
    """The instructions the kernel of `tier` runs on here ("AVX512-BF16" or "AVX2"), None where
    it is not available."""
    if not available(tier):
        return None
    return ISA_NAMES[native.load(SOURCE, TIERS[tier]).JaxserveMatmulIsa()]


def pack(w: jax.Array) -> jax.Array:
    """A weight w [K, N] in the kernel's strip layout, [ceil(N / 32), K, 32] (N padded with zeros):
    strip s holds columns [32 s, 32 s + 32) of every row, so a product reads each strip as one
    contiguous run instead of one cache line per row ~N apart, which on two Zen 4 cores streams
    ~2x faster at one row (benchmarks/RESULTS.md). Any dtype: `pack(q)` of `quantize_int8`'s int8
    values is the int8 kernel's layout (a strip row is then 32 bytes, two rows to a cache line)."""
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


def uses_kernel(x: jax.Array, packed: jax.Array, tier: str = "native") -> bool:
    """Whether `matmul` runs the native kernel for these operands (else XLA's GEMM): bfloat16 both,
    at least one row, static shapes, and the kernel built here."""
    if not all(isinstance(d, int) for d in (*x.shape, *packed.shape)):
        return False  # symbolic (exported) shapes
    rows = int(np.prod(x.shape[:-1]))
    return x.dtype == jnp.bfloat16 and packed.dtype == jnp.bfloat16 and rows > 0 and available(tier)


def matmul(x: jax.Array, packed: jax.Array, n: int, tier: str = "native") -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] for `packed` = pack(w) (`tier`: the kernel build, TIERS)."""
    if packed.ndim != 3 or packed.shape[2] != STRIP or packed.shape[0] != -(-n // STRIP):
        raise ValueError(f"packed weight of shape {packed.shape} does not hold {n} columns in strips of {STRIP}")
    if packed.shape[1] != x.shape[-1]:
        raise ValueError(f"x of shape {x.shape} and packed weight of shape {packed.shape} disagree on K")
    if not uses_kernel(x, packed, tier):
        # XLA's GEMM on the strips: a contraction over K, the strips and their columns kept as
        # output axes, then the padding columns dropped.
        out = jnp.einsum("...k,skc->...sc", x, packed)
        return out.reshape(*x.shape[:-1], -1)[..., :n]
    # Every row count: with each strip contiguous the kernel also beats XLA's GEMM at prefill sizes
    # (512 rows x 576 x 1536: 2.2 ms vs 2.6 ms on two Zen 4 cores), unlike on the [K, N] layout.
    return jax.ffi.ffi_call(target_name(TARGET, tier), jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.bfloat16))(
        x, packed)


def quantize_int8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [K, N] (any float dtype) -> (q [K, N] int8, scale [N] float32), w ~= q * scale: symmetric
    per output channel, scale = max_k |w[k, n]| / 127 (1.0 for a column of zeros, so nothing
    divides by zero), q = w / scale rounded half to even, in [-127, 127]; in float32, so
    |w - q * scale| <= scale / 2 up to float32 rounding. -128 is never used: the range stays
    symmetric. Pure jnp (any backend), jit-friendly; w must be finite."""
    if w.ndim != 2:
        raise ValueError(f"weight of shape {w.shape}: expected a 2-D [K, N] weight")
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=0, initial=0.0)  # initial: K = 0 gives zero columns
    scale = jnp.where(amax > 0, amax / 127, jnp.float32(1.0))
    q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
    return q, scale


def uses_kernel_int8(x: jax.Array, packed_q: jax.Array, tier: str = "native") -> bool:
    """Whether `matmul_int8` runs the native kernel for these operands (else XLA's GEMM): x
    bfloat16, the weight int8, at least one row, static shapes, and the kernel built here."""
    if not all(isinstance(d, int) for d in (*x.shape, *packed_q.shape)):
        return False  # symbolic (exported) shapes
    rows = int(np.prod(x.shape[:-1]))
    return x.dtype == jnp.bfloat16 and packed_q.dtype == jnp.int8 and rows > 0 and available(tier)


def matmul_int8(x: jax.Array, packed_q: jax.Array, scale: jax.Array, n: int, tier: str = "native") -> jax.Array:
    """x [..., K] @ (q * scale) -> [..., N] in x's dtype, for `packed_q` = pack(q) and `scale` [N]
    float32 from `quantize_int8` (unpadded: the kernel masks the last strip's scales). The sums are
    float32 and the scale multiplies each after the contraction, before the one rounding to x's
    dtype."""
    if packed_q.ndim != 3 or packed_q.shape[2] != STRIP or packed_q.shape[0] != -(-n // STRIP):
        raise ValueError(f"packed weight of shape {packed_q.shape} does not hold {n} columns in strips of {STRIP}")
    if packed_q.shape[1] != x.shape[-1]:
        raise ValueError(f"x of shape {x.shape} and packed weight of shape {packed_q.shape} disagree on K")
    if packed_q.dtype != jnp.int8:
        raise ValueError(f"packed weight of dtype {packed_q.dtype}: expected int8 (pack(quantize_int8(w)[0]))")
    if scale.shape != (n,):
        raise ValueError(f"scale of shape {scale.shape}: expected ({n},), one per output column")
    if not uses_kernel_int8(x, packed_q, tier):
        return _matmul_int8_xla(x, packed_q, scale, n)
    return jax.ffi.ffi_call(target_name(TARGET_INT8, tier), jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.bfloat16))(
        x, packed_q, scale.astype(jnp.float32))


def _matmul_int8_xla(x: jax.Array, packed_q: jax.Array, scale: jax.Array, n: int) -> jax.Array:
    """matmul_int8 on XLA's GEMM (where the kernel is not built, or x is not bfloat16): the int8
    values converted to x's dtype (exact: |q| <= 127 fits bfloat16's 8 bits) feed a float32
    contraction over the strips, then the scale, then one rounding to x's dtype, as the kernel.
    A correctness path, not a fast one: XLA:CPU materializes the converted weight, so 576 x 1536
    takes ~0.7-1.2 ms at 1-16 rows (the kernel ~0.03-0.08)."""
    out = jnp.einsum("...k,skc->...sc", x, packed_q.astype(x.dtype), preferred_element_type=jnp.float32)
    out = out.reshape(*x.shape[:-1], -1)[..., :n] * scale.astype(jnp.float32)
    return out.astype(x.dtype)
