// Small-batch products for the CPU: out[M, N] = x[M, K] @ W in bfloat16 with float32 accumulation,
// for a weight W [K, N] packed in strips (pack() in cpu_matmul.py): [ceil(N / 32), K, 32], strip s
// holding columns [32 s, 32 s + 32) of every row, N padded with zeros. One XLA FFI custom call,
// built on first use by cpu_matmul.py (-march=native) and only used where the CPU has AVX512-BF16.
//
// Why it exists: a decode step multiplies a few rows (one per running sequence) by every weight of
// the model, so it is a stream over the weights. XLA:CPU's bfloat16 dot reaches ~10 GB/s of weight
// at 16 rows on two Zen 4 cores and ~1.4 GB/s at one row; this kernel feeds the weight to VDPBF16PS
// (pairs of bf16 products added into float32) as one contiguous stream per strip, so one row runs
// at the memory's rate. Why strips: read from a plain [K, N] weight, a strip is one cache line per
// row, N elements apart, and one row reached 17 GB/s where the packed strips reach ~40 GB/s
// (benchmarks/RESULTS.md); the packed kernel also beats XLA's GEMM at prefill sizes.
//
// Layout of the work: for each strip, rows k and k+1 are loaded as whole cache lines and
// interleaved (bf16 pairs along K, what VDPBF16PS takes), then multiplied into up to 12 query rows
// at once; more rows reuse the strip from L2. Runs of strips are shared out over XLA's CPU thread
// pool.
//
// Rounding: every product and partial sum is float32 (VDPBF16PS adds the two products of a pair
// before the accumulator, and treats bf16 denormals as zero); the output is rounded to bfloat16 to
// nearest even, as XLA's convert does. Sums run in a different order than XLA's dot, so results
// agree to float32 rounding before the final bf16 rounding, not bit for bit.
//
// A second entry point, JaxserveMatmulInt8, multiplies by an int8 weight quantized per output column
// (w ~= q * scale; the same strips, one byte per element): see "int8 weights" below.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_parallel.h"
#if JAXSERVE_AVX2
#include "cpu_avx2.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Whether this build has the instructions the kernel needs; cpu_matmul.py asks before using it.
extern "C" int JaxserveMatmulSupported() { return JAXSERVE_BF16_DOT || JAXSERVE_AVX2; }
// Which instructions this build uses: 2 AVX512-BF16, 1 AVX2 + FMA (cpu_avx2.h), 0 none.
extern "C" int JaxserveMatmulIsa() { return JAXSERVE_BF16_DOT ? 2 : JAXSERVE_AVX2 ? 1 : 0; }

namespace {

struct Problem {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [ceil(N / 32), K, 32]
  uint16_t* out;      // [M, N]
  int64_t m, k, n;
};

struct ProblemInt8 {
  const uint16_t* x;   // [M, K] bfloat16
  const int8_t* w;     // q [ceil(N / 32), K, 32]
  const float* scale;  // [N]: not padded, the last strip's loads are masked
  uint16_t* out;       // [M, N] bfloat16
  int64_t m, k, n;
};

constexpr int kStrip = 32;  // columns per strip of the packed weight: one cache line of bf16

#if JAXSERVE_BF16_DOT

constexpr int kRowsPerPass = 12;  // query rows per pass over a strip: 2 x 12 accumulators + temporaries fit 32 zmm
constexpr int kPrefetchRows = 8;  // weight rows fetched ahead of the loads

inline int32_t load_pair(const uint16_t* p) {  // two adjacent bf16 as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Rows [m0, m0 + MB) x columns [n0, n0 + 32) of x @ W: the strip starting at column n0, K rows of 32.
template <int MB>
void strip(const Problem& p, int64_t n0, int64_t m0) {
  const int64_t cols = std::min<int64_t>(kStrip, p.n - n0);
  const __mmask32 col_mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  __m512 lo[MB], hi[MB];  // the interleave puts columns {0-3, 8-11, 16-19, 24-27} in lo, the rest in hi
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  const uint16_t* w = p.w + n0 * p.k;  // the strip: K rows of 32
  const uint16_t* x = p.x + m0 * p.k;
  constexpr int64_t n = kStrip;
  int64_t k = 0;
  for (; k + 1 < p.k; k += 2) {
    const int64_t ahead = std::min<int64_t>(k + kPrefetchRows, p.k - 2);  // stays inside the weight
    _mm_prefetch(reinterpret_cast<const char*>(w + ahead * n), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (ahead + 1) * n), _MM_HINT_T0);
    const __m512i r0 = _mm512_maskz_loadu_epi16(col_mask, w + k * n);
    const __m512i r1 = _mm512_maskz_loadu_epi16(col_mask, w + (k + 1) * n);
    const __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
    const __m512bh ph = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(load_pair(x + m * p.k + k));
      lo[m] = _mm512_dpbf16_ps(lo[m], a, pl);
      hi[m] = _mm512_dpbf16_ps(hi[m], a, ph);
    }
  }
  if (k < p.k) {  // odd K: the last row pairs with zeros
    const __m512i r0 = _mm512_maskz_loadu_epi16(col_mask, w + k * n);
    const __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(r0, _mm512_setzero_si512());
    const __m512bh ph = (__m512bh)_mm512_unpackhi_epi16(r0, _mm512_setzero_si512());
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[m * p.k + k]));
      lo[m] = _mm512_dpbf16_ps(lo[m], a, pl);
      hi[m] = _mm512_dpbf16_ps(hi[m], a, ph);
    }
  }
  const __mmask16 mask0 = static_cast<__mmask16>(col_mask), mask1 = static_cast<__mmask16>(col_mask >> 16);
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) {
    uint16_t* dst = p.out + (m0 + m) * p.n + n0;
    const __m256bh o0 = _mm512_cvtneps_pbh(jaxserve::pairs_first_half(lo[m], hi[m]));
    const __m256bh o1 = _mm512_cvtneps_pbh(jaxserve::pairs_second_half(lo[m], hi[m]));
    _mm256_mask_storeu_epi16(dst, mask0, (__m256i)o0);
    _mm256_mask_storeu_epi16(dst + 16, mask1, (__m256i)o1);
  }
}

void strip_all_rows(const Problem& p, int64_t n0) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kRowsPerPass) {
    switch (std::min<int64_t>(kRowsPerPass, p.m - m0)) {
      case 1: strip<1>(p, n0, m0); break;
      case 2: strip<2>(p, n0, m0); break;
      case 3: strip<3>(p, n0, m0); break;
      case 4: strip<4>(p, n0, m0); break;
      case 5: strip<5>(p, n0, m0); break;
      case 6: strip<6>(p, n0, m0); break;
      case 7: strip<7>(p, n0, m0); break;
      case 8: strip<8>(p, n0, m0); break;
      case 9: strip<9>(p, n0, m0); break;
      case 10: strip<10>(p, n0, m0); break;
      case 11: strip<11>(p, n0, m0); break;
      default: strip<12>(p, n0, m0); break;
    }
  }
}

// Strips per task, for `strips` strips of `strip_bytes` each: about 8 tasks per thread so threads
// that start late still get a share, and at least ~64 KB of weight so the pool's overhead stays small.
int64_t strips_per_task(int64_t strips, int64_t threads, int64_t strip_bytes) {
  const int64_t min_strips = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(strip_bytes, 1));
  return std::max<int64_t>(min_strips, strips / (8 * std::max<int64_t>(threads, 1)));
}

template <typename Pool>
void run_all(const Problem& p, Pool& pool) {
  const int64_t strips = (p.n + kStrip - 1) / kStrip;
  const int64_t chunk = strips_per_task(strips, pool.num_threads(), p.k * kStrip * 2);  // bf16: 2 bytes each
  jaxserve::parallel_for(pool, (strips + chunk - 1) / chunk, [p, chunk, strips](int64_t i) {
    for (int64_t s = i * chunk; s < std::min(strips, (i + 1) * chunk); ++s) strip_all_rows(p, s * kStrip);
  });
}

// ---- int8 weights ------------------------------------------------------------------------------
//
// out = (x @ q) * scale for q int8 [ceil(N / 32), K, 32] (pack() of quantize_int8's values) and a
// float32 scale per column: a decode step streams half the bytes of bf16.
//
// Every |q| <= 127 is exact in bfloat16 (7 significant bits), so the strip rows are widened to
// float32 (vpmovsxbd + vcvtdq2ps, exact), paired into bf16 (r_k[d], r_k+1[d]) by one vpermt2w that
// picks the float32s' high halves (their low halves are zero: truncation is exact), and fed to
// VDPBF16PS as in the bf16 kernel; the scale multiplies each float32 sum once, before the one
// rounding to bf16. So the result is as exact as the bf16 kernel's on the dequantized weight
// q * scale: float32 products and sums of the exact values, one final rounding.
//
// VDPBF16PS treats bf16 denormals as zero, as in the bf16 kernel (only x can be one here).
//
// Converting costs ~10 vector ops per row pair, on the shuffle and convert pipes, so in one fused
// loop it overlaps the VDPBF16PS chain. Past 12 rows a strip takes several passes: the rows are
// split into equal passes (16 = 8 + 8, not 12 + 4: a short pass is bound by the conversion), and
// the first pass also keeps the converted pairs (K x 64 bytes, in L1/L2) for the others to read.
// Single thread, weights in cache, 576 x 1536, us (a harness including this file, best of 150):
//
//   rows                                            1     4    12    16    64
//   bf16 kernel                                    23    32    91   123   487
//   this (equal passes, first keeps the pairs)     30    45    96   127   490
//   converting in every pass (12 + 4)              30    45    96   141   523
//   dequantize the strip to bf16, then bf16 loop   67     -   136   166     -
//   widen to float32, FMA with float32 x           34     -   198   275     -
//
// (FMA loses: 16 multiplies per zmm, not VDPBF16PS's 32. Widening with shifts and ands instead of
// vpmovsxbd, to spare the shuffle pipe, was 5-30% slower.) Decoding streams the weight from DRAM
// on both threads, where half the bytes show. Timed as benchmarks/cpu_matmul.py times products,
// with 100 distinct matrices per call so they come from DRAM (88 MB of int8, past the 32 MB L3;
// 30 at 64 and 512 rows): `jax.jit(lambda x, ws: [cpu_matmul.matmul_int8(x, q, s, n) for q, s in
// ws])`, the same over `pack`ed bf16 weights and `x @ w` for XLA, best of 3 calls / 100, median of
// 9-15 rounds interleaving the variants, on the 2-core Zen 4 shared with a CI run; us per product
// (GB/s of weight streamed):
//
//   K x N        rows   bf16 kernel    int8 kernel   XLA dot, dequantized bf16 [K, N]
//   576 x 1536     1     57-60 (30)     30-33 (28)     1,186
//                  4     63 (28)        37 (24)          155
//                 16     92-94 (19)     81 (11)          217
//                 64     302            285              439
//                512     2,044          2,049          2,648
//   1536 x 576     1     65-75 (24-27)  35-38 (23-25)  1,244
//                  4     65 (27)        38 (24)          147
//                 16     80-84 (21-22)  80-85 (10-11)    207
//                 64     275            274              401
//                512     2,004          2,011          2,252
//
// So the int8 kernel takes every row count: ~1.9x the bf16 kernel's speed at one row, ~1.7x at
// four, level from 16 up; with more load on the cores (an earlier run) 16 rows were 156 vs 164.

constexpr int64_t kRowBytesInt8 = kStrip;  // one strip row: 32 bytes, two rows to a cache line
// Weight lines (row pairs) prefetched ahead, on past the strip's end into the task's next strip
// (contiguous): while the later passes over a strip run from the kept pairs, this warms the next
// one. 16 rows x 576 x 1536 under load: 182 us at 8 lines clamped to the strip (the bf16 kernel's
// 512 bytes), 156 at 64 (4 KB), the same at 96 or 128; one row: 42-47 us at any distance.
constexpr int64_t kPrefetchLinesInt8 = 64;

inline __m512 widen16(const int8_t* q) {  // 16 int8 -> 16 float32, exact
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// Lane d = the bf16 pair (a[d], b[d]) for float32 a, b that bf16 holds exactly: their high halves.
inline __m512bh pair_high_halves(__m512 a, __m512 b) {
  const __m512i odd_words = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
                                             47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
  return (__m512bh)_mm512_permutex2var_epi16(_mm512_castps_si512(a), odd_words, _mm512_castps_si512(b));
}

// Rows k and k+1 of a strip (the 64 bytes at r) as bf16 pairs: columns 0-15 in lo, 16-31 in hi.
inline void row_pairs(const int8_t* r, __m512bh& lo, __m512bh& hi) {
  lo = pair_high_halves(widen16(r), widen16(r + kRowBytesInt8));
  hi = pair_high_halves(widen16(r + 16), widen16(r + kRowBytesInt8 + 16));
}

// The last row of an odd K, paired with zeros (as its x is).
inline void last_row_pairs(const int8_t* r, __m512bh& lo, __m512bh& hi) {
  lo = (__m512bh)_mm512_srli_epi32(_mm512_castps_si512(widen16(r)), 16);
  hi = (__m512bh)_mm512_srli_epi32(_mm512_castps_si512(widen16(r + 16)), 16);
}

// The weight's bf16 pairs of rows k, k+1 (pair) or of an odd K's last row (last), converted from
// the int8 strip at w with prefetch; with Keep also written to `keep` (2 zmm per row pair) for the
// next passes over the strip.
template <bool Keep>
struct ConvertPairs {
  const int8_t* w;
  int64_t last_row;  // of the weight, from w: prefetches run on into the next strips
  __m512bh* keep;
  void pair(int64_t k, __m512bh& lo, __m512bh& hi) const {
    const int64_t ahead = std::min<int64_t>(k + 2 * kPrefetchLinesInt8, last_row);  // stays inside the weight
    _mm_prefetch(reinterpret_cast<const char*>(w + ahead * kRowBytesInt8), _MM_HINT_T0);
    row_pairs(w + k * kRowBytesInt8, lo, hi);
    if constexpr (Keep) keep[k] = lo, keep[k + 1] = hi;
  }
  void last(int64_t k, __m512bh& lo, __m512bh& hi) const {
    last_row_pairs(w + k * kRowBytesInt8, lo, hi);
    if constexpr (Keep) keep[k] = lo, keep[k + 1] = hi;
  }
};

struct KeptPairs {  // a previous pass's ConvertPairs<true>::keep
  const __m512bh* kept;
  void pair(int64_t k, __m512bh& lo, __m512bh& hi) const { lo = kept[k], hi = kept[k + 1]; }
  void last(int64_t k, __m512bh& lo, __m512bh& hi) const { pair(k, lo, hi); }
};

// Rows [m0, m0 + MB) x the 32 columns of the strip starting at column n0, the weight's pairs from
// `pairs` (ConvertPairs or KeptPairs).
template <int MB, typename Pairs>
void strip_int8(const ProblemInt8& p, int64_t n0, int64_t m0, const Pairs& pairs) {
  __m512 lo[MB], hi[MB];  // columns 0-15, 16-31
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  const uint16_t* x = p.x + m0 * p.k;
  int64_t k = 0;
  for (; k + 1 < p.k; k += 2) {
    __m512bh wl, wh;
    pairs.pair(k, wl, wh);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(load_pair(x + m * p.k + k));
      lo[m] = _mm512_dpbf16_ps(lo[m], a, wl);
      hi[m] = _mm512_dpbf16_ps(hi[m], a, wh);
    }
  }
  if (k < p.k) {  // odd K: the last row pairs with zeros
    __m512bh wl, wh;
    pairs.last(k, wl, wh);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[m * p.k + k]));
      lo[m] = _mm512_dpbf16_ps(lo[m], a, wl);
      hi[m] = _mm512_dpbf16_ps(hi[m], a, wh);
    }
  }
  const int64_t cols = std::min<int64_t>(kStrip, p.n - n0);
  const __mmask32 col_mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  const __mmask16 mask0 = static_cast<__mmask16>(col_mask), mask1 = static_cast<__mmask16>(col_mask >> 16);
  const __m512 scale0 = _mm512_maskz_loadu_ps(mask0, p.scale + n0);  // only N scales exist
  const __m512 scale1 = _mm512_maskz_loadu_ps(mask1, p.scale + n0 + 16);
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) {
    uint16_t* dst = p.out + (m0 + m) * p.n + n0;
    _mm256_mask_storeu_epi16(dst, mask0, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(lo[m], scale0)));
    _mm256_mask_storeu_epi16(dst + 16, mask1, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(hi[m], scale1)));
  }
}

template <typename Pairs>
void strip_int8_rows(const ProblemInt8& p, int64_t n0, int64_t m0, int64_t rows, const Pairs& pairs) {
  switch (rows) {
    case 1: strip_int8<1>(p, n0, m0, pairs); break;
    case 2: strip_int8<2>(p, n0, m0, pairs); break;
    case 3: strip_int8<3>(p, n0, m0, pairs); break;
    case 4: strip_int8<4>(p, n0, m0, pairs); break;
    case 5: strip_int8<5>(p, n0, m0, pairs); break;
    case 6: strip_int8<6>(p, n0, m0, pairs); break;
    case 7: strip_int8<7>(p, n0, m0, pairs); break;
    case 8: strip_int8<8>(p, n0, m0, pairs); break;
    case 9: strip_int8<9>(p, n0, m0, pairs); break;
    case 10: strip_int8<10>(p, n0, m0, pairs); break;
    case 11: strip_int8<11>(p, n0, m0, pairs); break;
    default: strip_int8<12>(p, n0, m0, pairs); break;
  }
}

// Strips [s0, s1), every row: the rows in equal passes of at most 12 (a short last pass would be
// bound by the conversion); with more than one pass the first keeps the converted strip in this
// thread's scratch for the others.
void strips_int8(const ProblemInt8& p, int64_t s0, int64_t s1) {
  const int64_t strips = (p.n + kStrip - 1) / kStrip;
  const int64_t passes = (p.m + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t rows = (p.m + passes - 1) / passes;
  __m512bh* keep = passes > 1 ? jaxserve::kept_pairs(p.k) : nullptr;
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t n0 = s * kStrip;
    const int64_t last_row = (strips - s) * p.k - 2;  // the weight's last row pair, from this strip
    if (passes == 1) {
      strip_int8_rows(p, n0, 0, rows, ConvertPairs<false>{p.w + n0 * p.k, last_row, nullptr});
      continue;
    }
    strip_int8_rows(p, n0, 0, rows, ConvertPairs<true>{p.w + n0 * p.k, last_row, keep});
    for (int64_t m0 = rows; m0 < p.m; m0 += rows)
      strip_int8_rows(p, n0, m0, std::min(rows, p.m - m0), KeptPairs{keep});
  }
}

template <typename Pool>
void run_all_int8(const ProblemInt8& p, Pool& pool) {
  const int64_t strips = (p.n + kStrip - 1) / kStrip;
  const int64_t chunk = strips_per_task(strips, pool.num_threads(), p.k * kRowBytesInt8);
  jaxserve::parallel_for(pool, (strips + chunk - 1) / chunk, [p, chunk, strips](int64_t i) {
    strips_int8(p, i * chunk, std::min(strips, (i + 1) * chunk));
  });
}

#endif  // JAXSERVE_BF16_DOT

// The shapes both products take: x [..., K] (M rows), a weight packed in strips [ceil(N / 32), K,
// 32], out [..., N]. Sets m, k, n, or says what is wrong, naming the product (`what`).
ffi::Error strip_shapes(const char* what, ffi::AnyBuffer& x, ffi::AnyBuffer& w, ffi::Result<ffi::AnyBuffer>& out,
                        int64_t& m, int64_t& k, int64_t& n) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const std::string name(what);
  if (xd.size() < 1 || od.size() < 1 || wd.size() != 3 || wd[2] != kStrip)
    return ffi::Error::InvalidArgument(name + ": the weight must be packed in strips, [ceil(N / 32), K, 32]");
  k = xd[xd.size() - 1];
  n = od[od.size() - 1];
  m = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) m *= xd[i];
  if (wd[1] != k) return ffi::Error::InvalidArgument(name + ": x and the weight disagree on K");
  if (wd[0] != (n + kStrip - 1) / kStrip || static_cast<int64_t>(out->element_count()) != m * n)
    return ffi::Error::InvalidArgument(name + ": the output must be [..., N] for the weight's strips");
  return ffi::Error::Success();
}

// True when there is nothing to multiply (no rows, no columns, or K = 0: the output is zeros).
bool nothing_to_multiply(int64_t m, int64_t k, int64_t n, uint16_t* out) {
  if (m == 0 || n == 0) return true;
  if (k > 0) return false;
  std::memset(out, 0, sizeof(uint16_t) * m * n);
  return true;
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out) {
#if JAXSERVE_BF16_DOT
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu matmul: x, the weight and the output must be bfloat16");
  Problem p;
  if (ffi::Error e = strip_shapes("cpu matmul", x, w, out, p.m, p.k, p.n); e.failure()) return e;
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.w = static_cast<const uint16_t*>(w.untyped_data());
  p.out = static_cast<uint16_t*>(out->untyped_data());
  if (nothing_to_multiply(p.m, p.k, p.n, p.out)) return ffi::Error::Success();
  run_all(p, pool);
  return ffi::Error::Success();
#elif JAXSERVE_AVX2
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu matmul: x, the weight and the output must be bfloat16");
  jaxserve::avx2::Problem p{};
  if (ffi::Error e = strip_shapes("cpu matmul", x, w, out, p.m, p.k, p.n); e.failure()) return e;
  p.w = static_cast<const uint8_t*>(w.untyped_data());
  p.out = static_cast<uint16_t*>(out->untyped_data());
  if (nothing_to_multiply(p.m, p.k, p.n, p.out)) return ffi::Error::Success();
  jaxserve::avx2::product<jaxserve::avx2::Bf16Rows, float>(p, static_cast<const uint16_t*>(x.untyped_data()), pool);
  return ffi::Error::Success();
#else
  return ffi::Error::Unimplemented("cpu matmul: built without AVX512-BF16 or AVX2");
#endif
}

ffi::Error MatmulInt8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> out) {
#if JAXSERVE_BF16_DOT
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::S8 ||
      scale.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(
        "cpu int8 matmul: x and the output must be bfloat16, the weight int8 and the scales float32");
  ProblemInt8 p;
  if (ffi::Error e = strip_shapes("cpu int8 matmul", x, w, out, p.m, p.k, p.n); e.failure()) return e;
  const auto sd = scale.dimensions();
  if (sd.size() != 1 || sd[0] != p.n) return ffi::Error::InvalidArgument("cpu int8 matmul: the scales must be [N]");
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.w = static_cast<const int8_t*>(w.untyped_data());
  p.scale = static_cast<const float*>(scale.untyped_data());
  p.out = static_cast<uint16_t*>(out->untyped_data());
  if (nothing_to_multiply(p.m, p.k, p.n, p.out)) return ffi::Error::Success();
  run_all_int8(p, pool);
  return ffi::Error::Success();
#elif JAXSERVE_AVX2
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::S8 ||
      scale.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(
        "cpu int8 matmul: x and the output must be bfloat16, the weight int8 and the scales float32");
  jaxserve::avx2::Problem p{};
  if (ffi::Error e = strip_shapes("cpu int8 matmul", x, w, out, p.m, p.k, p.n); e.failure()) return e;
  const auto sd = scale.dimensions();
  if (sd.size() != 1 || sd[0] != p.n) return ffi::Error::InvalidArgument("cpu int8 matmul: the scales must be [N]");
  p.w = static_cast<const uint8_t*>(w.untyped_data());
  p.col_scale = static_cast<const float*>(scale.untyped_data());
  p.out = static_cast<uint16_t*>(out->untyped_data());
  if (nothing_to_multiply(p.m, p.k, p.n, p.out)) return ffi::Error::Success();
  jaxserve::avx2::product<jaxserve::avx2::Int8Rows, float>(p, static_cast<const uint16_t*>(x.untyped_data()), pool);
  return ffi::Error::Success();
#else
  return ffi::Error::Unimplemented("cpu int8 matmul: built without AVX512-BF16 or AVX2");
#endif
}

}  // namespace

#ifndef JAXSERVE_STANDALONE
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., K]
                                  .Arg<ffi::AnyBuffer>()  // weight [ceil(N / 32), K, 32]
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulInt8, MatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., K] bfloat16
                                  .Arg<ffi::AnyBuffer>()  // q [ceil(N / 32), K, 32] int8
                                  .Arg<ffi::AnyBuffer>()  // scale [N] float32
                                  .Ret<ffi::AnyBuffer>());
#endif
