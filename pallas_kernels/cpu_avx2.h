// The products of cpu_matmul.cc and cpu_qmatmul.cc for x86 CPUs without AVX512-BF16 but with AVX2,
// FMA and F16C (x86-64-v3: Intel since Haswell, AMD since Zen 1): the same FFI targets, the same
// packed layouts and the same results, computed with float32 fused multiply-adds. native.py hashes
// this header with each kernel's source, so editing it rebuilds both.
//
// Why: without a native product a decode step runs XLA:CPU's float32 dot over float32 weights, so
// one token streams 4 bytes per weight (SmolLM2: 540 MB); these read the stored bytes, 2 (bf16),
// 1 (int8, Q8) or ~0.56 (Q4 with its scales) per weight, and widen them to float32 in registers.
//
// How: each strip of 32 columns is taken as two halves of 16 (two ymm of float32 per row). Per row
// of the weight, the 16 values of a half are widened to float32 exactly (bf16: a shift; int8: sign extension and a
// convert; Q4: the row's nibbles picked out of its row pair's 32 bytes, then widened), and every
// row of the pass adds x[m, k] * w[k, :] into its group partial sum with one FMA per 8 columns. At
// the end of a group of G rows the partial sums are scaled by the group's d (and the group's sum of
// x times its minimum is added), as the AVX512 kernels do; an unquantized or per-column-scaled
// weight is one group of K rows. One or two rows widen the values as they go (one row takes both
// halves of a strip in one pass: `q4_one_row`, `int8_one_row`, `bf16_one_row`; two rows of a Q4
// weight widen each vector once for both: `q4_two_rows`); more take the half strip widened once
// (K x 64 bytes, in L1/L2), six rows at a time (`strips`).
//
// Exactness: every stored value widens to float32 exactly, products and sums are float32 (in a
// different order than XLA's dot), scales are applied once per group in float32, and the output is
// rounded to bfloat16 to nearest even once: the same contract as the AVX512 kernels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"

namespace jaxserve::avx2 {

constexpr int kStrip = 32;  // columns per strip of a packed weight
constexpr int kHalf = 16;   // columns per half strip: two ymm of float32

inline __m256 bf16x8(const uint16_t* p) {  // 8 bfloat16 -> 8 float32, exact
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline __m256 s8x8(__m128i v) {  // the low 8 int8 of v -> 8 float32, exact
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

inline __m256 u16x8(__m128i v) {  // 8 uint16 -> 8 float32, exact
  return _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(v));
}

// 8 float32 -> 8 bfloat16, rounded to nearest even as XLA's convert does (NaN stays a quiet NaN,
// overflow rounds to infinity, subnormals are kept).
inline __m128i to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {  // 16 float16 -> float32
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

// ---- the stored forms of a strip: row k's 16 values of half h, widened to float32 ------------

// Each gives rows k and k + 1 (`pair`, k even) and a last odd row (`row`) of half h of its strip.
struct Bf16Rows {  // [S, K, 32] bfloat16
  static constexpr int64_t kRowBytes = 64;
  const uint16_t* w;  // the strip
  void row(int64_t k, int h, __m256& lo, __m256& hi) const {
    const uint16_t* p = w + k * kStrip + h * kHalf;
    lo = bf16x8(p);
    hi = bf16x8(p + 8);
  }
  void pair(int64_t k, int h, __m256 (&v)[4]) const {
    row(k, h, v[0], v[1]);
    row(k + 1, h, v[2], v[3]);
  }
};

struct Int8Rows {  // [S, K, 32] int8 (cpu_matmul's int8 weights, GGUF Q8_0 / Q6_K values)
  static constexpr int64_t kRowBytes = 32;
  const int8_t* w;
  void row(int64_t k, int h, __m256& lo, __m256& hi) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kStrip + h * kHalf));
    lo = s8x8(v);
    hi = s8x8(_mm_srli_si128(v, 8));
  }
  void pair(int64_t k, int h, __m256 (&v)[4]) const {
    row(k, h, v[0], v[1]);
    row(k + 1, h, v[2], v[3]);
  }
};

struct Q4Pairs {  // [S, K / 2, 32] bytes: byte j of pair p = q[2p + j % 2][j / 2] | q[2p + j % 2][16 + j / 2] << 4
  static constexpr int64_t kRowBytes = 16;
  const uint8_t* w;
  // The pair's 32 bytes as 16-bit lanes hold, in lane c, row k's byte (low) and row k + 1's (high)
  // of column c of both halves; the half's nibble is the low (h = 0) or the high one.
  void pair(int64_t k, int h, __m256 (&v)[4]) const {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k / 2) * kStrip));
    const __m256i nibbles = _mm256_srli_epi16(bytes, 4 * h);
    const __m256i q0 = _mm256_and_si256(nibbles, _mm256_set1_epi16(15));
    const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(nibbles, 8), _mm256_set1_epi16(15));
    v[0] = u16x8(_mm256_castsi256_si128(q0));
    v[1] = u16x8(_mm256_extracti128_si256(q0, 1));
    v[2] = u16x8(_mm256_castsi256_si128(q1));
    v[3] = u16x8(_mm256_extracti128_si256(q1, 1));
  }
  void row(int64_t k, int h, __m256& lo, __m256& hi) const {  // never reached: 4-bit K is even
    __m256 v[4];
    pair(k & ~int64_t{1}, h, v);
    lo = (k & 1) ? v[2] : v[0];
    hi = (k & 1) ? v[3] : v[1];
  }
};

// ---- the product ---------------------------------------------------------------------------------

// out[M, N] = x[M, K] @ W, W in strips of the stored form `Rows`, in groups of `group` rows along K,
// each group of each column scaled by d (and shifted by mn), both [S, K / G, R, 32] of type S; or,
// without groups (scales == nullptr), one group of K rows scaled per column by col_scale [N] (or 1).
struct Problem {
  const float* x;          // [M, K] float32 (the caller widens bf16 x once)
  const float* xsum;       // [M, K / G]: x summed over each group, for mn (nullptr without)
  const uint8_t* w;        // the packed weight
  const void* scales;      // [S, K / G, R, 32] float16 or float32, or nullptr
  const float* col_scale;  // [N] or nullptr
  uint16_t* out;           // [M, N] bfloat16
  int64_t m, k, n, group;
  int scale_rows;          // R: 1 (d) or 2 (d, mn)
};

// Rows a pass that widens the stored values takes (at most 2: each keeps four chains of partial
// sums, 4 ymm, beside the weight's 4 and the broadcasts), and rows per pass over widened values
// (one chain of 2 ymm per row: 12 accumulators for six, the weight's 2 and the broadcasts).
constexpr int kFusedRows = 2;
constexpr int kPassRows = 6;

// This thread's room for a half strip's widened values (K x 16 float32).
inline float* kept_values(int64_t k) {
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(k) * kHalf + 16;
  if (scratch.size() < need) scratch.resize(need);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
}

// Where a pass gets row k's widened values: from the stored strip, or from the half strip widened
// once into scratch (`widen_half_strip`).
template <typename Rows>
struct Widen {
  Rows rows;
  int h;
  void pair(int64_t k, __m256 (&v)[4]) const { rows.pair(k, h, v); }
  void row(int64_t k, __m256& lo, __m256& hi) const { rows.row(k, h, lo, hi); }
};
struct Kept {
  const float* kept;
  void pair(int64_t k, __m256 (&v)[4]) const {
    for (int i = 0; i < 4; ++i) v[i] = _mm256_load_ps(kept + k * kHalf + 8 * i);
  }
  void row(int64_t k, __m256& lo, __m256& hi) const {
    lo = _mm256_load_ps(kept + k * kHalf);
    hi = _mm256_load_ps(kept + k * kHalf + 8);
  }
};

// Row m's sums of the 16 columns from n0 (lo: n0..n0+7, hi: the next 8) into out: times the
// per-column scale if any, rounded to bfloat16; columns past N (the last strip's padding) are not
// written.
inline void store_half(const Problem& p, int64_t m, int64_t n0, __m256 lo, __m256 hi) {
  const int64_t cols = std::min<int64_t>(kHalf, p.n - n0);
  if (p.col_scale != nullptr) {
    alignas(32) float scale[kHalf] = {};
    std::memcpy(scale, p.col_scale + n0, sizeof(float) * cols);  // [N]: not padded
    lo = _mm256_mul_ps(lo, _mm256_load_ps(scale));
    hi = _mm256_mul_ps(hi, _mm256_load_ps(scale + 8));
  }
  const __m256i o = _mm256_set_m128i(to_bf16x8(hi), to_bf16x8(lo));
  uint16_t* dst = p.out + m * p.n + n0;
  if (cols == kHalf) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), o);
  } else {
    alignas(32) uint16_t tmp[kHalf];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), o);
    std::memcpy(dst, tmp, sizeof(uint16_t) * cols);
  }
}

// t += group g's partial sums p of rows [m0, m0 + MB) x half h of strip s (lo: columns 0-7, hi:
// 8-15) times the group's d, plus each row's sum over the group times its minimum (scale_rows 2).
template <int MB, typename S>
inline void add_scaled_half(const Problem& p, int64_t s, int h, int64_t g, int64_t m0, const __m256* plo,
                            const __m256* phi, __m256* tlo, __m256* thi) {
  const int64_t groups = p.k / p.group;
  const S* gs = static_cast<const S*>(p.scales) + ((s * groups + g) * p.scale_rows) * kStrip + h * kHalf;
  __m256 d0, d1;
  load16(gs, d0, d1);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    tlo[m] = _mm256_fmadd_ps(plo[m], d0, tlo[m]);
    thi[m] = _mm256_fmadd_ps(phi[m], d1, thi[m]);
  }
  if (p.scale_rows == 2) {
    __m256 n0, n1;
    load16(gs + kStrip, n0, n1);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xs = _mm256_set1_ps(p.xsum[(m0 + m) * groups + g]);
      tlo[m] = _mm256_fmadd_ps(xs, n0, tlo[m]);
      thi[m] = _mm256_fmadd_ps(xs, n1, thi[m]);
    }
  }
}

// Rows [m0, m0 + MB) x half h of strip s: sums over K, scaled per group, rounded into out.
template <int MB, typename S, typename Source>
void half_strip(const Problem& p, int64_t s, int h, int64_t m0, const Source& src) {
  const int64_t groups = p.scales != nullptr ? p.k / p.group : 1;
  const int64_t group = p.scales != nullptr ? p.group : p.k;
  const float* x = p.x + m0 * p.k;
  __m256 tlo[MB], thi[MB];  // running totals
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) tlo[m] = thi[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 plo[MB], phi[MB];  // this group's partial sums
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) plo[m] = phi[m] = _mm256_setzero_ps();
    const int64_t end = (g + 1) * group;
    int64_t k = g * group;
    if constexpr (MB <= 2) {
      // Rows k and k + 1 go to sums of their own: a row's FMAs then form four independent chains,
      // not two (an FMA waits ~4 cycles for the last), and the pair is what Q4 stores.
      __m256 qlo[MB], qhi[MB];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) qlo[m] = qhi[m] = _mm256_setzero_ps();
      for (; k + 1 < end; k += 2) {
        __m256 w[4];
        src.pair(k, w);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const __m256 a0 = _mm256_broadcast_ss(x + m * p.k + k), a1 = _mm256_broadcast_ss(x + m * p.k + k + 1);
          plo[m] = _mm256_fmadd_ps(a0, w[0], plo[m]);
          phi[m] = _mm256_fmadd_ps(a0, w[1], phi[m]);
          qlo[m] = _mm256_fmadd_ps(a1, w[2], qlo[m]);
          qhi[m] = _mm256_fmadd_ps(a1, w[3], qhi[m]);
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) plo[m] = _mm256_add_ps(plo[m], qlo[m]), phi[m] = _mm256_add_ps(phi[m], qhi[m]);
    }
    // Three to six rows already keep 6-12 chains; and an odd K's last row.
    for (; k < end; ++k) {
      __m256 wlo, whi;
      src.row(k, wlo, whi);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 a = _mm256_broadcast_ss(x + m * p.k + k);
        plo[m] = _mm256_fmadd_ps(a, wlo, plo[m]);
        phi[m] = _mm256_fmadd_ps(a, whi, phi[m]);
      }
    }
    if (p.scales == nullptr) {
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) tlo[m] = plo[m], thi[m] = phi[m];
      break;
    }
    add_scaled_half<MB, S>(p, s, h, g, m0, plo, phi, tlo, thi);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) store_half(p, m0 + m, s * kStrip + h * kHalf, tlo[m], thi[m]);
}

template <typename S, typename Source>
void half_strip_rows(const Problem& p, int64_t s, int h, int64_t m0, int64_t rows, const Source& src) {
  switch (rows) {
    case 1: half_strip<1, S>(p, s, h, m0, src); break;
    case 2: half_strip<2, S>(p, s, h, m0, src); break;
    case 3: half_strip<3, S>(p, s, h, m0, src); break;
    case 4: half_strip<4, S>(p, s, h, m0, src); break;
    case 5: half_strip<5, S>(p, s, h, m0, src); break;
    default: half_strip<6, S>(p, s, h, m0, src); break;
  }
}

// Half strip h's stored rows widened into keep (K x 16 float32, the layout Kept reads) for the
// passes over it.
template <typename Rows>
void widen_half_strip(const Rows& stored, int h, int64_t k, float* keep) {
  int64_t i = 0;
  for (; i + 1 < k; i += 2) {
    __m256 v[4];
    stored.pair(i, h, v);
    for (int j = 0; j < 4; ++j) _mm256_store_ps(keep + i * kHalf + 8 * j, v[j]);
  }
  if (i < k) {
    __m256 lo, hi;
    stored.row(i, h, lo, hi);
    _mm256_store_ps(keep + i * kHalf, lo);
    _mm256_store_ps(keep + i * kHalf + 8, hi);
  }
}

// t += group g's 32 partial sums (columns in order) of strip s times the group's d, plus the row's
// sum over the group times its minimum (scale_rows 2), as half_strip does per half.
template <typename S>
inline void add_scaled_group(const Problem& p, int64_t s, int64_t g, const __m256 (&part)[4], __m256 (&t)[4]) {
  const S* gs = static_cast<const S*>(p.scales) + ((s * (p.k / p.group) + g) * p.scale_rows) * kStrip;
  __m256 d[4];
  load16(gs, d[0], d[1]);
  load16(gs + kHalf, d[2], d[3]);
  for (int c = 0; c < 4; ++c) t[c] = _mm256_fmadd_ps(part[c], d[c], t[c]);
  if (p.scale_rows == 2) {
    __m256 mn[4];
    load16(gs + kStrip, mn[0], mn[1]);
    load16(gs + kStrip + kHalf, mn[2], mn[3]);
    const __m256 xs = _mm256_set1_ps(p.xsum[g]);
    for (int c = 0; c < 4; ++c) t[c] = _mm256_fmadd_ps(xs, mn[c], t[c]);
  }
}

// Strip s of a one-row product's output, its 32 sums t (columns in order); the last strip's
// padding half is not written.
inline void store_one_row(const Problem& p, int64_t s, const __m256 (&t)[4]) {
  for (int h = 0; h < 2 && s * kStrip + h * kHalf < p.n; ++h) store_half(p, 0, s * kStrip + h * kHalf, t[2 * h], t[2 * h + 1]);
}

// A half strip's sums held as its even and its odd columns -> columns 0-7 and 8-15.
inline void in_order(__m256 even, __m256 odd, __m256& first, __m256& second) {
  const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  // 0-3 | 8-11, 4-7 | 12-15
  first = _mm256_permute2f128_ps(lo, hi, 0x20);
  second = _mm256_permute2f128_ps(lo, hi, 0x31);
}

// Nibble i of each 32-bit lane of a Q4 row pair's bytes, masked where it lies rather than shifted
// down: (q << 4i) converts to float32 exactly (four significant bits), and a sum of x times it is
// 2^4i times the sum of x times q, to the bit (a power of two commutes with rounding while nothing
// overflows or goes subnormal: |x| < 2^100). The one- and two-row passes scale such sums back by
// 2^-4i, also exact, before they combine. Nibble 7 is shifted down (in place it would not fit an
// int32). One instruction fewer per vector than shifting and masking.
alignas(32) inline constexpr uint32_t kNibbleMasks[7][8] = {
    {15u, 15u, 15u, 15u, 15u, 15u, 15u, 15u},
    {15u << 4, 15u << 4, 15u << 4, 15u << 4, 15u << 4, 15u << 4, 15u << 4, 15u << 4},
    {15u << 8, 15u << 8, 15u << 8, 15u << 8, 15u << 8, 15u << 8, 15u << 8, 15u << 8},
    {15u << 12, 15u << 12, 15u << 12, 15u << 12, 15u << 12, 15u << 12, 15u << 12, 15u << 12},
    {15u << 16, 15u << 16, 15u << 16, 15u << 16, 15u << 16, 15u << 16, 15u << 16, 15u << 16},
    {15u << 20, 15u << 20, 15u << 20, 15u << 20, 15u << 20, 15u << 20, 15u << 20, 15u << 20},
    {15u << 24, 15u << 24, 15u << 24, 15u << 24, 15u << 24, 15u << 24, 15u << 24, 15u << 24}};

// Nibble i (0-7) of every lane of b as float32, times 2^4i for i < 7 (see kNibbleMasks).
inline __m256 q4_nibble(__m256i b, int i) {
  if (i == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(kNibbleMasks[i]))));
}

// A sum of nibble i's products back to the sum of x times q.
inline __m256 q4_unscale(__m256 sum, int i) {
  return i == 0 || i == 7 ? sum : _mm256_mul_ps(sum, _mm256_set1_ps(1.0f / static_cast<float>(1 << (4 * i))));
}

// One row times strip s of a Q4 weight (Q4Pairs, groups of an even number of rows), both halves in
// one pass: each 32-bit lane of a row pair's 32 bytes holds two columns' nibbles of both rows and
// both halves, so eight masks give eight vectors of float32 (rows k, k + 1; even, odd columns;
// low, high half; kNibbleMasks) with no shuffles, into eight independent chains of FMAs (the two-row
// `half_strip` pass keeps four, and an FMA waits ~4 cycles for the last). The even / odd columns
// are put back in order once per group, before its scales. Sums in the same order as half_strip's.
template <typename S>
void q4_one_row(const Problem& p, int64_t s) {
  const int64_t groups = p.k / p.group;
  const uint8_t* w = p.w + s * p.k * Q4Pairs::kRowBytes;
  __m256 t[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 2) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kHalf));
      const __m256 x0 = _mm256_broadcast_ss(p.x + k), x1 = _mm256_broadcast_ss(p.x + k + 1);
      a[0] = _mm256_fmadd_ps(x0, q4_nibble(b, 0), a[0]);  // row k, even columns, low half
      a[1] = _mm256_fmadd_ps(x0, q4_nibble(b, 1), a[1]);  // row k, even, high half
      a[2] = _mm256_fmadd_ps(x1, q4_nibble(b, 2), a[2]);  // row k + 1, even, low
      a[3] = _mm256_fmadd_ps(x1, q4_nibble(b, 3), a[3]);
      a[4] = _mm256_fmadd_ps(x0, q4_nibble(b, 4), a[4]);  // row k, odd, low
      a[5] = _mm256_fmadd_ps(x0, q4_nibble(b, 5), a[5]);
      a[6] = _mm256_fmadd_ps(x1, q4_nibble(b, 6), a[6]);
      a[7] = _mm256_fmadd_ps(x1, q4_nibble(b, 7), a[7]);
    }
    for (int i = 0; i < 8; ++i) a[i] = q4_unscale(a[i], i);
    __m256 part[4];  // columns 0-7, 8-15, 16-23, 24-31
    for (int h = 0; h < 2; ++h)
      in_order(_mm256_add_ps(a[h], a[2 + h]), _mm256_add_ps(a[4 + h], a[6 + h]), part[2 * h], part[2 * h + 1]);
    add_scaled_group<S>(p, s, g, part, t);
  }
  store_one_row(p, s, t);
}

// Two rows times half h of strip s of a Q4 weight: the lanes of q4_one_row, half h's four nibbles
// (rows k, k + 1; even, odd columns), each widened once into both rows' chains: eight chains of
// FMAs, as one row's (the half_strip pass widens through 16-bit lanes and extracts, twice the
// instructions per vector). Sums in half_strip's order.
template <typename S, int h>
void q4_two_rows(const Problem& p, int64_t s) {
  const int64_t groups = p.k / p.group;
  const uint8_t* w = p.w + s * p.k * Q4Pairs::kRowBytes;
  __m256 tlo[2], thi[2];
  for (int m = 0; m < 2; ++m) tlo[m] = thi[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 a[2][4];  // per row: row k's even columns, row k + 1's even, row k's odd, row k + 1's odd
    for (int m = 0; m < 2; ++m)
      for (int j = 0; j < 4; ++j) a[m][j] = _mm256_setzero_ps();
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 2) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kHalf));
      __m256 x[2][2];
      for (int m = 0; m < 2; ++m)
        for (int r = 0; r < 2; ++r) x[m][r] = _mm256_broadcast_ss(p.x + m * p.k + k + r);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 v = q4_nibble(b, 2 * j + h);
        a[0][j] = _mm256_fmadd_ps(x[0][j % 2], v, a[0][j]);
        a[1][j] = _mm256_fmadd_ps(x[1][j % 2], v, a[1][j]);
      }
    }
    __m256 lo[2], hi[2];
    for (int m = 0; m < 2; ++m) {
      for (int j = 0; j < 4; ++j) a[m][j] = q4_unscale(a[m][j], 2 * j + h);
      in_order(_mm256_add_ps(a[m][0], a[m][1]), _mm256_add_ps(a[m][2], a[m][3]), lo[m], hi[m]);
    }
    add_scaled_half<2, S>(p, s, h, g, 0, lo, hi, tlo, thi);
  }
  for (int m = 0; m < 2; ++m) store_half(p, m, s * kStrip + h * kHalf, tlo[m], thi[m]);
}

// The group loop of a one-row pass over strip s: `add_row(k, x, a)` adds x times weight row k of
// the strip into four accumulators a[0..3], both halves at once; consecutive rows alternate between
// two sets of four (eight independent chains of FMAs: an FMA waits ~4 cycles for the last, and the
// half-strip pass keeps four), summed at the group's end, where `in_columns(sum, part)` turns the
// four sums into columns 0-7, 8-15, 16-23, 24-31. Sums in half_strip's order.
template <typename S, typename AddRow, typename InColumns>
void one_row(const Problem& p, int64_t s, AddRow add_row, InColumns in_columns) {
  const int64_t groups = p.scales != nullptr ? p.k / p.group : 1;
  const int64_t group = p.scales != nullptr ? p.group : p.k;
  __m256 t[4];
  for (int c = 0; c < 4; ++c) t[c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
    const int64_t end = (g + 1) * group;
    int64_t k = g * group;
    for (; k + 1 < end; k += 2) {
      add_row(k, _mm256_broadcast_ss(p.x + k), a);
      add_row(k + 1, _mm256_broadcast_ss(p.x + k + 1), a + 4);
    }
    if (k < end) add_row(k, _mm256_broadcast_ss(p.x + k), a);  // an odd group's last row
    __m256 sum[4], part[4];
    for (int c = 0; c < 4; ++c) sum[c] = _mm256_add_ps(a[c], a[4 + c]);
    in_columns(sum, part);
    if (p.scales == nullptr) {
      for (int c = 0; c < 4; ++c) t[c] = part[c];
      break;
    }
    add_scaled_group<S>(p, s, g, part, t);
  }
  store_one_row(p, s, t);
}

// One row times strip s of a bfloat16 weight (Bf16Rows). Each 32-bit lane of a weight row holds
// two columns' bfloat16: shifted left it is the even column's float32, masked the odd one's (no
// shuffles). Accumulators: half h's even (2 h) and odd (2 h + 1) columns.
template <typename S>
void bf16_one_row(const Problem& p, int64_t s) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(p.w) + s * p.k * kStrip;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto add_row = [&](int64_t k, __m256 x, __m256* a) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kStrip + h * kHalf));
      a[2 * h] = _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), a[2 * h]);
      a[2 * h + 1] = _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_and_si256(v, high)), a[2 * h + 1]);
    }
  };
  one_row<S>(p, s, add_row, [](const __m256 (&sum)[4], __m256 (&part)[4]) {
    in_order(sum[0], sum[1], part[0], part[1]);
    in_order(sum[2], sum[3], part[2], part[3]);
  });
}

// One row times strip s of an int8 weight (Int8Rows: GGUF Q8_0 / Q6_K values, cpu_matmul's int8):
// each weight row sign-extended straight from memory as four vectors of eight columns (the
// half-strip pass re-reads the row for its second half, through a shuffle more).
template <typename S>
void int8_one_row(const Problem& p, int64_t s) {
  const int8_t* w = reinterpret_cast<const int8_t*>(p.w) + s * p.k * kStrip;
  const auto add_row = [&](int64_t k, __m256 x, __m256* a) {
    for (int c = 0; c < 4; ++c) {  // columns 8c..8c+7
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * kStrip + 8 * c));
      a[c] = _mm256_fmadd_ps(x, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), a[c]);
    }
  };
  one_row<S>(p, s, add_row, [](const __m256 (&sum)[4], __m256 (&part)[4]) {
    for (int c = 0; c < 4; ++c) part[c] = sum[c];
  });
}

// Strips [s0, s1), every row. One or two rows: one pass per half strip, widening the stored values
// as it goes. More: the half strip is widened once into this thread's scratch (K x 64 bytes, in
// L1/L2) and the rows run over it six at a time (12 accumulators: the FMA units' fill, and a third
// of the scratch reads per FMA of two-row passes).
template <typename Rows, typename S>
void strips(const Problem& p, int64_t s0, int64_t s1) {
  if constexpr (std::is_same_v<Rows, Q4Pairs>) {
    if (p.m == 1 && p.scales != nullptr && p.group % 2 == 0) {
      for (int64_t s = s0; s < s1; ++s) q4_one_row<S>(p, s);
      return;
    }
    if (p.m == 2 && p.scales != nullptr && p.group % 2 == 0) {
      for (int64_t s = s0; s < s1; ++s) {
        q4_two_rows<S, 0>(p, s);
        if (s * kStrip + kHalf < p.n) q4_two_rows<S, 1>(p, s);  // not the last strip's padding half
      }
      return;
    }
  }
  if constexpr (std::is_same_v<Rows, Int8Rows>) {
    if (p.m == 1) {
      for (int64_t s = s0; s < s1; ++s) int8_one_row<S>(p, s);
      return;
    }
  }
  if constexpr (std::is_same_v<Rows, Bf16Rows>) {
    if (p.m == 1) {
      for (int64_t s = s0; s < s1; ++s) bf16_one_row<S>(p, s);
      return;
    }
  }
  float* keep = p.m > kFusedRows ? kept_values(p.k) : nullptr;
  const int64_t strip_bytes = p.k * Rows::kRowBytes;
  for (int64_t s = s0; s < s1; ++s) {
    const Rows stored{reinterpret_cast<decltype(Rows::w)>(p.w + s * strip_bytes)};
    for (int h = 0; h < 2; ++h) {
      if (s * kStrip + h * kHalf >= p.n) break;  // the last strip's padding half
      if (keep == nullptr) {
        half_strip_rows<S>(p, s, h, 0, p.m, Widen<Rows>{stored, h});
        continue;
      }
      widen_half_strip(stored, h, p.k, keep);
      for (int64_t m0 = 0; m0 < p.m; m0 += kPassRows)
        half_strip_rows<S>(p, s, h, m0, std::min<int64_t>(kPassRows, p.m - m0), Kept{keep});
    }
  }
}

// x [M, K] bfloat16 -> float32; and, for a weight with minima, x summed over each group of G rows.
inline void widen_x(const uint16_t* x, int64_t m, int64_t k, float* out) {
  const int64_t total = m * k;
  int64_t i = 0;
  for (; i + 8 <= total; i += 8) _mm256_storeu_ps(out + i, bf16x8(x + i));
  for (; i < total; ++i) out[i] = bf16_to_float(x[i]);
}

inline void group_sums(const float* x, int64_t m, int64_t k, int64_t group, float* out) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      float sum = 0.0f;
      for (int64_t i = 0; i < group; ++i) sum += x[r * k + g * group + i];
      out[r * (k / group) + g] = sum;
    }
}

// The whole product over XLA's thread pool, tasks of whole strips (cpu_matmul.cc's sizing: about
// 8 tasks per thread, at least ~64 KB of weight each). x is bfloat16 [M, K].
template <typename Rows, typename S, typename Pool>
void product(Problem p, const uint16_t* x_bf16, Pool& pool) {
  std::vector<float> xf(static_cast<size_t>(p.m * p.k)), xsum;
  widen_x(x_bf16, p.m, p.k, xf.data());
  p.x = xf.data();
  if (p.scales != nullptr && p.scale_rows == 2) {
    xsum.resize(static_cast<size_t>(p.m * (p.k / p.group)));
    group_sums(p.x, p.m, p.k, p.group, xsum.data());
    p.xsum = xsum.data();
  }
  const int64_t strips_total = (p.n + kStrip - 1) / kStrip;
  const int64_t strip_bytes = p.k * Rows::kRowBytes;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(strip_bytes, 1)),
                                          strips_total / (8 * threads));
  jaxserve::parallel_for(pool, (strips_total + chunk - 1) / chunk, [p, chunk, strips_total](int64_t i) {
    strips<Rows, S>(p, i * chunk, std::min(strips_total, (i + 1) * chunk));
  });
}

}  // namespace jaxserve::avx2
