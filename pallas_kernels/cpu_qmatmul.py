"""Block-quantized weights on the CPU: 4-bit and 8-bit values in groups of G rows along K, each
group with a float16 (or float32) scale and, for 4-bit, minimum per column, multiplied by a native
kernel (`cpu_qmatmul.cc`, an XLA FFI custom call) that reads the quantized bytes, so a decode step
streams ~0.6 (Q4, G = 32) or ~1.06 (Q8) bytes per weight instead of bfloat16's 2.

  Q4  w = q * d + mn, q in 0..15: GGUF's Q4_1 block (and Q4_0, whose mn is -8 d) kept as it is,
      and what --quantization int4 makes of a float checkpoint (`quantize_q4`)
  Q8  w = q * d, q in -127..127: GGUF's Q8_0 block

GGUF's K-quants fit too, with float32 scales (a float16 times a 6- or 8-bit integer per group is
exact in float32, not in float16): Q4_K is Q4 in groups of 32, Q6_K is Q8 in groups of 16.

Layouts (made once, at load): `pack_q4` / `pack_q8` put the values in strips of 32 columns as
`cpu_matmul.pack` does, `pack_scales` the scales beside them, [ceil(N / 32), K / G, R, 32]
(R = 2 for Q4: d then mn). The kernel's sums are float32 over the exact values, scaled per group,
and rounded to bfloat16 once (the reasoning is in cpu_qmatmul.cc). Where the kernel is not built
(neither AVX512-BF16 nor AVX2 with FMA: cpu_matmul.NEEDS) `matmul_q4` / `matmul_q8` dequantize and
run XLA's dot: correct, not fast. Built in the tiers of cpu_matmul (`TIERS`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.cpu_matmul import NEEDS, STRIP, TIERS, pack, target_name, unpack

SOURCE = Path(__file__).with_name("cpu_qmatmul.cc")
TARGET_Q4 = "jaxserve_cpu_matmul_q4"
TARGET_Q8 = "jaxserve_cpu_matmul_q8"


@functools.cache
def _register(tier: str = "native") -> bool:
    return native.register(SOURCE, "JaxserveQMatmulSupported",
                           {target_name(TARGET_Q4, tier): "JaxserveMatmulQ4",
                            target_name(TARGET_Q8, tier): "JaxserveMatmulQ8"}, TIERS[tier])


@functools.cache
def available(tier: str = "native") -> bool:
    """Whether the kernel builds, loads and has its instructions here (logs why not, once)."""
    return native.usable(lambda: _register(tier), "native block-quantized CPU products",
                         "dequantizing into XLA's dot", NEEDS)


def _check_groups(k: int, group: int) -> None:
    if group <= 0 or group % 2 or k % group:
        raise ValueError(f"K = {k} is not a whole number of groups of {group} (an even size)")


def quantize_q4(w: jax.Array, group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w [K, N] -> (q [K, N] uint8 in 0..15, d [K / G, N] float16, mn [K / G, N] float16) with
    w ~= q * d + mn: asymmetric per group of G rows and column, mn = the group's minimum and
    d = (max - min) / 15, both rounded to float16 first and q computed from the rounded values,
    so |w - (q * d + mn)| <= d / 2 up to float16's rounding of mn. A constant group has d = 0
    stored and q = 0 (its value is mn). Pure jnp, jit-friendly; w must be finite."""
    if w.ndim != 2:
        raise ValueError(f"weight of shape {w.shape}: expected a 2-D [K, N] weight")
    k, n = w.shape
    _check_groups(k, group)
    g = w.astype(jnp.float32).reshape(k // group, group, n)
    lo, hi = g.min(axis=1), g.max(axis=1)
    mn = lo.astype(jnp.float16)
    d = ((hi - mn.astype(jnp.float32)) / 15).astype(jnp.float16)
    d32 = d.astype(jnp.float32)
    safe = jnp.where(d32 > 0, d32, 1.0)
    q = jnp.clip(jnp.round((g - mn.astype(jnp.float32)[:, None]) / safe[:, None]), 0, 15)
    q = jnp.where((d32 > 0)[:, None], q, 0).astype(jnp.uint8)
    return q.reshape(k, n), d, mn


def quantize_q8(w: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """w [K, N] -> (q [K, N] int8 in -127..127, d [K / G, N] float16), w ~= q * d: symmetric per
    group and column, d = max |w| / 127 in float16 (GGUF's Q8_0 rule at G = 32)."""
    if w.ndim != 2:
        raise ValueError(f"weight of shape {w.shape}: expected a 2-D [K, N] weight")
    k, n = w.shape
    _check_groups(k, group)
    g = w.astype(jnp.float32).reshape(k // group, group, n)
    d = (jnp.abs(g).max(axis=1) / 127).astype(jnp.float16)
    d32 = d.astype(jnp.float32)
    q = jnp.clip(jnp.round(g / jnp.where(d32 > 0, d32, 1.0)[:, None]), -127, 127).astype(jnp.int8)
    return q.reshape(k, n), d


def dequantize(q: jax.Array, d: jax.Array, mn: jax.Array | None = None) -> jax.Array:
    """The float32 weight [K, N] of values q [K, N] and group scales d (and minima mn) [K / G, N]."""
    k, n = q.shape
    group = k // d.shape[0]
    w = q.astype(jnp.float32).reshape(k // group, group, n) * d.astype(jnp.float32)[:, None]
    if mn is not None:
        w = w + mn.astype(jnp.float32)[:, None]
    return w.reshape(k, n)


def pack_q4(q: jax.Array) -> jax.Array:
    """4-bit values q [K, N] (uint8, 0..15, K even) -> [ceil(N / 32), K / 2, 32] uint8: per strip
    and row pair (k, k + 1), byte j = q[k + j % 2, j // 2] | q[k + j % 2, 16 + j // 2] << 4
    (columns relative to the strip), the order the kernel's nibble lookup yields VDPBF16PS pairs."""
    k, n = q.shape
    if k % 2:
        raise ValueError(f"4-bit weight with K = {k}: K must be even")
    strips = pack(q.astype(jnp.uint8))  # [S, K, 32]
    s = strips.shape[0]
    pairs = strips.reshape(s, k // 2, 2, 2, 16)  # [S, pair, row in pair, column half, column]
    low, high = pairs[:, :, :, 0, :], pairs[:, :, :, 1, :]  # [S, pair, row in pair, 16]
    # byte j = 2 * column + row in pair
    return (low | (high << 4)).transpose(0, 1, 3, 2).reshape(s, k // 2, STRIP)


def unpack_q4(packed: jax.Array, n: int) -> jax.Array:
    """pack_q4's inverse: the values q [K, N]."""
    s, pairs, _ = packed.shape
    b = packed.reshape(s, pairs, 16, 2).transpose(0, 1, 3, 2)  # [S, pair, row in pair, column]
    both = jnp.concatenate([b & 15, b >> 4], axis=-1)  # [S, pair, row in pair, 32]
    return unpack(both.reshape(s, 2 * pairs, STRIP), n)


def pack_q8(q: jax.Array) -> jax.Array:
    """8-bit values q [K, N] int8 -> [ceil(N / 32), K, 32], cpu_matmul's int8 layout."""
    return pack(q.astype(jnp.int8))


def pack_scales(d: jax.Array, mn: jax.Array | None = None) -> jax.Array:
    """Group scales d (and minima mn) [K / G, N] -> [ceil(N / 32), K / G, R, 32] (R = 2 with mn: d
    then mn), N padded with zeros; float32 if d is (GGUF K-quants' exact scales), else float16."""
    dtype = jnp.float32 if d.dtype == jnp.float32 else jnp.float16
    parts = [d] if mn is None else [d, mn]
    strips = [pack(p.astype(dtype)) for p in parts]  # each [S, K / G, 32]
    return jnp.stack(strips, axis=2)


def unpack_scales(scales: jax.Array, n: int) -> tuple[jax.Array, jax.Array | None]:
    """pack_scales's inverse: (d, mn or None) [K / G, N]."""
    parts = [unpack(scales[:, :, r, :], n) for r in range(scales.shape[2])]
    return parts[0], (parts[1] if len(parts) > 1 else None)


def _check(x: jax.Array, packed: jax.Array, scales: jax.Array, n: int, rows_per_k: float, r: int, what: str) -> int:
    strips = -(-n // STRIP)
    if packed.ndim != 3 or packed.shape[0] != strips or packed.shape[2] != STRIP:
        raise ValueError(f"{what}: packed weight of shape {packed.shape} does not hold {n} columns in strips")
    k = x.shape[-1]
    if packed.shape[1] != int(k * rows_per_k):
        raise ValueError(f"{what}: x of shape {x.shape} and packed weight of shape {packed.shape} disagree on K")
    if (scales.ndim != 4 or scales.shape[0] != strips or scales.shape[2:] != (r, STRIP)
            or scales.dtype not in (jnp.float16, jnp.float32)):
        raise ValueError(f"{what}: scales of shape {scales.shape} ({scales.dtype}) are not [{strips}, K / G, {r}, 32] "
                         "float16 or float32")
    groups = scales.shape[1]
    if groups == 0 or k % groups or (k // groups) % 2:
        raise ValueError(f"{what}: K = {k} is not a whole number of {groups} groups of an even size")
    return k // groups


def _uses_kernel(x: jax.Array, packed: jax.Array, tier: str) -> bool:
    if not all(isinstance(d, int) for d in (*x.shape, *packed.shape)):
        return False  # symbolic (exported) shapes
    return x.dtype == jnp.bfloat16 and int(np.prod(x.shape[:-1])) > 0 and available(tier)


def matmul_q4(x: jax.Array, packed: jax.Array, scales: jax.Array, n: int, tier: str = "native") -> jax.Array:
    """x [..., K] @ (q * d + mn) -> [..., N] in x's dtype, for packed = pack_q4(q) and scales =
    pack_scales(d, mn) (`tier`: the kernel build, cpu_matmul.TIERS)."""
    return _matmul(x, packed, scales, n, 4, tier)


def matmul_q8(x: jax.Array, packed: jax.Array, scales: jax.Array, n: int, tier: str = "native") -> jax.Array:
    """x [..., K] @ (q * d) -> [..., N] in x's dtype, for packed = pack_q8(q), scales = pack_scales(d)."""
    return _matmul(x, packed, scales, n, 8, tier)


def _matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, n: int, bits: int, tier: str) -> jax.Array:
    what, dtype, target = ("matmul_q4", jnp.uint8, TARGET_Q4) if bits == 4 else ("matmul_q8", jnp.int8, TARGET_Q8)
    target = target_name(target, tier)
    _check(x, packed, scales, n, 0.5 if bits == 4 else 1, 2 if bits == 4 else 1, what)
    if packed.dtype != dtype:
        raise ValueError(f"{what}: packed weight of dtype {packed.dtype}: expected {jnp.dtype(dtype).name}")
    if _uses_kernel(x, packed, tier):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.bfloat16))(x, packed, scales)
    d, mn = unpack_scales(scales, n)
    return _dot(x, dequantize(unpack_q4(packed, n) if bits == 4 else unpack(packed, n), d, mn))


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """The fallback: float32 products of x and the dequantized weight, rounded to x's dtype once."""
    return jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w).astype(x.dtype)


def row_values_q4(packed: jax.Array, ids: jax.Array) -> jax.Array:
    """Column `ids` of the Q4 weight packed by pack_q4 (an embedding row when the weight is a
    head's transpose): its values q [..., K], uint8."""
    col = ids % STRIP
    b = packed[ids // STRIP, :, 2 * (col % 16)]  # [..., K / 2]: rows 2p, then 2p + 1 at byte + 1
    b2 = packed[ids // STRIP, :, 2 * (col % 16) + 1]
    shift = jnp.where(col >= 16, 4, 0)[..., None].astype(jnp.uint8)
    even, odd = (b >> shift) & 15, (b2 >> shift) & 15
    return jnp.stack([even, odd], axis=-1).reshape(*ids.shape, -1)


def row_scales(scales: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Column `ids`'s group scales (and minima) [..., K / G] from pack_scales' layout."""
    col = scales[ids // STRIP, :, :, ids % STRIP]  # [..., K / G, R]
    return col[..., 0], (col[..., 1] if scales.shape[2] > 1 else None)
