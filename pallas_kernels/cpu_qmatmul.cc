// Products with block-quantized weights for the CPU: out[M, N] = x[M, K] @ W in bfloat16 with
// float32 accumulation, where W [K, N] is stored in groups of G consecutive rows (along K, as GGUF
// blocks are) per column, each group with its own float16 scale (and, for 4-bit values, its own
// float16 minimum):
//
//   Q4   w[k, n] = q[k, n] * d[k / G, n] + mn[k / G, n],  q in 0..15    (GGUF Q4_1; Q4_0 has
//        mn = -8 d; --quantization int4 quantizes to it)
//   Q8   w[k, n] = q[k, n] * d[k / G, n],                  q in -127..127 (GGUF Q8_0)
//
// The weight is packed in strips of 32 columns as cpu_matmul.cc's (pack_q4 / pack_q8 in
// cpu_qmatmul.py). A Q4 strip holds K / 2 rows of 32 bytes, one per row pair (k, k+1): byte j holds
// q[k + j % 2][j / 2] in its low nibble and q[k + j % 2][16 + j / 2] in its high nibble, so that
// widening the 32 bytes to 16-bit lanes and looking each nibble up in a table of the bfloat16 values
// 0..15 (one vpermw) gives the pairs VDPBF16PS multiplies, columns 0-15 from the low nibbles and
// 16-31 from the high ones, in order: about 5 vector ops per row pair, half the int8 kernel's
// widening. A Q8 strip is cpu_matmul's int8 layout, K rows of 32 bytes, converted as there.
// Scales: [ceil(N / 32), K / G, R, 32] float16, R = 2 (d, then mn) for Q4 and 1 for Q8, so each
// strip's scales are one contiguous stream beside its values. They may be float32 instead: GGUF's
// K-quants scale each group by a float16 times a 6- or 8-bit integer, which float16 cannot hold
// exactly and float32 can (Q4_K is Q4 in groups of 32, Q6_K is Q8 in groups of 16 with |q| <= 32).
//
// Exactness: every q is exact in bfloat16, so each group's partial sum x[k] * q[k, n] is float32
// products and sums of exact values (VDPBF16PS); it is scaled by d once per group, and mn times
// the group's sum of x (float32, computed once per call) is added, all in float32, and the output
// is rounded to bfloat16 once. So the result agrees with a float32 product of x by the dequantized
// weight to float32 rounding before that final rounding (a different order of the same sums).
//
// Registers: each row keeps a group partial and a running total for 32 columns, 4 zmm, so a pass
// takes 6 rows (24 accumulators); more rows take more passes over the strip, the first converting
// the values and keeping the bf16 pairs for the others (as the int8 kernel does).

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

extern "C" int JaxserveQMatmulSupported() { return JAXSERVE_BF16_DOT || JAXSERVE_AVX2; }

namespace {

struct QProblem {
  const uint16_t* x;       // [M, K] bfloat16
  const uint8_t* w;        // Q4: [S, K / 2, 32] bytes; Q8: [S, K, 32] int8
  const void* scales;      // [S, K / G, R, 32] float16 (uint16_t) or float32 (float)
  const float* xsum;       // [M, K / G]: x summed over each group (Q4's minimum term)
  uint16_t* out;           // [M, N] bfloat16
  int64_t m, k, n, group;
};

#if JAXSERVE_BF16_DOT

constexpr int kStrip = 32;
constexpr int kRowsPerPass = 6;         // 4 accumulators per row: 24 of the 32 zmm
constexpr int64_t kPrefetchBytes = 2048;  // weight bytes fetched ahead of the loads

inline int32_t load_pair(const uint16_t* p) {  // two adjacent bf16 as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 4-bit values: the nibble table lookup described above.
struct Q4 {
  static constexpr bool kMin = true;
  static constexpr int64_t kPairBytes = 32;  // one row pair of a strip
  static constexpr int kScaleRows = 2;       // d, mn
  __m512i table, low;
  Q4() {
    alignas(64) static const uint16_t bf16_of[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    table = _mm512_load_si512(bf16_of);
    low = _mm512_set1_epi16(15);
  }
  void pairs(const uint8_t* r, __m512bh& lo, __m512bh& hi) const {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
    lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, low), table);
    hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
  }
};

// int8 values: widened to float32 (exact) and paired by their high halves, as in cpu_matmul.cc.
struct Q8 {
  static constexpr bool kMin = false;
  static constexpr int64_t kPairBytes = 64;  // rows k and k+1, 32 bytes each
  static constexpr int kScaleRows = 1;
  static __m512 widen16(const uint8_t* q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  }
  static __m512bh high_halves(__m512 a, __m512 b) {
    const __m512i odd_words = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
                                               47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    return (__m512bh)_mm512_permutex2var_epi16(_mm512_castps_si512(a), odd_words, _mm512_castps_si512(b));
  }
  void pairs(const uint8_t* r, __m512bh& lo, __m512bh& hi) const {
    lo = high_halves(widen16(r), widen16(r + kStrip));
    hi = high_halves(widen16(r + 16), widen16(r + kStrip + 16));
  }
};

// Where a pass gets the weight's bf16 pairs: converted from the strip (optionally kept for the
// next passes), or read back from a previous pass's keep.
template <typename Q, bool Keep>
struct Convert {
  const Q& q;
  const uint8_t* w;    // the strip's first pair
  const uint8_t* end;  // the weight's last cache line: prefetches run on into the next strips
  __m512bh* keep;
  void pair(int64_t i, __m512bh& lo, __m512bh& hi) const {
    const uint8_t* r = w + i * Q::kPairBytes;
    _mm_prefetch(reinterpret_cast<const char*>(std::min(r + kPrefetchBytes, end)), _MM_HINT_T0);
    q.pairs(r, lo, hi);
    if constexpr (Keep) keep[2 * i] = lo, keep[2 * i + 1] = hi;
  }
};

inline __m512 load16(const uint16_t* p) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

struct Kept {
  const __m512bh* kept;
  void pair(int64_t i, __m512bh& lo, __m512bh& hi) const { lo = kept[2 * i], hi = kept[2 * i + 1]; }
};

// Rows [m0, m0 + MB) x the 32 columns of strip s, scales of type S.
template <typename Q, typename S, int MB, typename Pairs>
void strip(const QProblem& p, int64_t s, int64_t m0, const Pairs& pairs) {
  const int64_t groups = p.k / p.group, pairs_per_group = p.group / 2;
  const S* sc = static_cast<const S*>(p.scales) + s * groups * Q::kScaleRows * kStrip;
  const uint16_t* x = p.x + m0 * p.k;
  __m512 lo[MB], hi[MB];  // running totals, columns 0-15 and 16-31
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 plo[MB], phi[MB];  // this group's partial sums
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) plo[m] = phi[m] = _mm512_setzero_ps();
    for (int64_t i = g * pairs_per_group; i < (g + 1) * pairs_per_group; ++i) {
      __m512bh wl, wh;
      pairs.pair(i, wl, wh);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(load_pair(x + m * p.k + 2 * i));
        plo[m] = _mm512_dpbf16_ps(plo[m], a, wl);
        phi[m] = _mm512_dpbf16_ps(phi[m], a, wh);
      }
    }
    const S* gs = sc + g * Q::kScaleRows * kStrip;
    const __m512 d0 = load16(gs), d1 = load16(gs + 16);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      lo[m] = _mm512_fmadd_ps(plo[m], d0, lo[m]);
      hi[m] = _mm512_fmadd_ps(phi[m], d1, hi[m]);
    }
    if constexpr (Q::kMin) {
      const __m512 n0 = load16(gs + kStrip), n1 = load16(gs + kStrip + 16);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m512 xs = _mm512_set1_ps(p.xsum[(m0 + m) * groups + g]);
        lo[m] = _mm512_fmadd_ps(xs, n0, lo[m]);
        hi[m] = _mm512_fmadd_ps(xs, n1, hi[m]);
      }
    }
  }
  const int64_t n0 = s * kStrip, cols = std::min<int64_t>(kStrip, p.n - n0);
  const __mmask32 col_mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  const __mmask16 mask0 = static_cast<__mmask16>(col_mask), mask1 = static_cast<__mmask16>(col_mask >> 16);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    uint16_t* dst = p.out + (m0 + m) * p.n + n0;
    _mm256_mask_storeu_epi16(dst, mask0, (__m256i)_mm512_cvtneps_pbh(lo[m]));
    _mm256_mask_storeu_epi16(dst + 16, mask1, (__m256i)_mm512_cvtneps_pbh(hi[m]));
  }
}

template <typename Q, typename S, typename Pairs>
void strip_rows(const QProblem& p, int64_t s, int64_t m0, int64_t rows, const Pairs& pairs) {
  switch (rows) {
    case 1: strip<Q, S, 1>(p, s, m0, pairs); break;
    case 2: strip<Q, S, 2>(p, s, m0, pairs); break;
    case 3: strip<Q, S, 3>(p, s, m0, pairs); break;
    case 4: strip<Q, S, 4>(p, s, m0, pairs); break;
    case 5: strip<Q, S, 5>(p, s, m0, pairs); break;
    default: strip<Q, S, 6>(p, s, m0, pairs); break;
  }
}

// Strips [s0, s1), every row, in equal passes of at most 6 rows.
template <typename Q, typename S>
void strips(const QProblem& p, int64_t s0, int64_t s1) {
  const Q q;
  const int64_t num_strips = (p.n + kStrip - 1) / kStrip;
  const int64_t strip_bytes = (p.k / 2) * Q::kPairBytes;
  const uint8_t* end = p.w + num_strips * strip_bytes - 64;
  const int64_t passes = (p.m + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t rows = (p.m + passes - 1) / passes;
  __m512bh* keep = passes > 1 ? jaxserve::kept_pairs(p.k) : nullptr;
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* w = p.w + s * strip_bytes;
    if (passes == 1) {
      strip_rows<Q, S>(p, s, 0, rows, Convert<Q, false>{q, w, end, nullptr});
      continue;
    }
    strip_rows<Q, S>(p, s, 0, rows, Convert<Q, true>{q, w, end, keep});
    for (int64_t m0 = rows; m0 < p.m; m0 += rows) strip_rows<Q, S>(p, s, m0, std::min(rows, p.m - m0), Kept{keep});
  }
}

// Sums of x over each group, float32: the minimum's factor (x [M, K] bf16 -> [M, K / G]).
void group_sums(const uint16_t* x, int64_t m, int64_t k, int64_t group, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* v = x + r * k + g * group;
      __m512 acc = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= group; i += 16)
        acc = _mm512_add_ps(acc, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i))));
      float sum = _mm512_reduce_add_ps(acc);
      for (; i < group; ++i) {
        const uint32_t bits = static_cast<uint32_t>(v[i]) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        sum += f;
      }
      out[r * (k / group) + g] = sum;
    }
  }
}

template <typename Q, typename S, typename Pool>
void run(QProblem p, Pool& pool) {
  std::vector<float> xsum;
  if constexpr (Q::kMin) {
    xsum.resize(p.m * (p.k / p.group));
    group_sums(p.x, p.m, p.k, p.group, xsum.data());
    p.xsum = xsum.data();
  }
  const int64_t num_strips = (p.n + kStrip - 1) / kStrip;
  const int64_t strip_bytes = (p.k / 2) * Q::kPairBytes;
  // Tasks of at least 64 KB of weight, about 8 per thread (cpu_matmul.cc's strips_per_task).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(strip_bytes, 1)),
                                          num_strips / (8 * threads));
  jaxserve::parallel_for(pool, (num_strips + chunk - 1) / chunk, [p, chunk, num_strips](int64_t i) {
    strips<Q, S>(p, i * chunk, std::min(num_strips, (i + 1) * chunk));
  });
}

#endif  // JAXSERVE_BF16_DOT

// x [..., K] bf16, w strips, scales [S, K / G, R, 32] f16 or f32, out [..., N] bf16: checks and fills p.
ffi::Error problem(const char* what, int64_t pair_bytes, int scale_rows, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
                   ffi::AnyBuffer& scales, ffi::Result<ffi::AnyBuffer>& out, QProblem& p) {
  const std::string name(what);
  if (x.element_type() != ffi::DataType::BF16 || out->element_type() != ffi::DataType::BF16 ||
      (scales.element_type() != ffi::DataType::F16 && scales.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument(name + ": x and the output must be bfloat16 and the scales float16 or float32");
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scales.dimensions(), od = out->dimensions();
  if (xd.size() < 1 || od.size() < 1 || wd.size() != 3 || wd[2] != 32 || sd.size() != 4 || sd[3] != 32 ||
      sd[2] != scale_rows)
    return ffi::Error::InvalidArgument(name + ": the weight must be packed in strips and the scales [S, K / G, R, 32]");
  p.k = xd[xd.size() - 1];
  p.n = od[od.size() - 1];
  p.m = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) p.m *= xd[i];
  const int64_t strips = (p.n + 31) / 32;
  if (wd[0] != strips || sd[0] != strips || static_cast<int64_t>(out->element_count()) != p.m * p.n)
    return ffi::Error::InvalidArgument(name + ": the weight, scales and output disagree on N");
  if (wd[1] * 32 != p.k * pair_bytes / 2)
    return ffi::Error::InvalidArgument(name + ": x and the weight disagree on K");
  if (sd[1] == 0 || p.k % sd[1] != 0 || (p.k / sd[1]) % 2 != 0)
    return ffi::Error::InvalidArgument(name + ": K must be a whole number of groups of an even size");
  p.group = p.k / sd[1];
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.w = static_cast<const uint8_t*>(w.untyped_data());
  p.scales = scales.untyped_data();
  p.xsum = nullptr;
  p.out = static_cast<uint16_t*>(out->untyped_data());
  return ffi::Error::Success();
}

#if JAXSERVE_BF16_DOT
template <typename Q>
ffi::Error Product(const char* what, ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                   ffi::Result<ffi::AnyBuffer> out) {
  QProblem p;
  if (ffi::Error e = problem(what, Q::kPairBytes, Q::kScaleRows, x, w, scales, out, p); e.failure()) return e;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (scales.element_type() == ffi::DataType::F32)
    run<Q, float>(p, pool);
  else
    run<Q, uint16_t>(p, pool);
  return ffi::Error::Success();
}
#elif JAXSERVE_AVX2
// The same products on AVX2 + FMA (cpu_avx2.h): Rows is the strip's stored form (a row pair is two
// of its rows), ScaleRows the scale rows per group (2: d and mn; 1: d).
template <typename Rows, int ScaleRows>
ffi::Error Product(const char* what, ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                   ffi::Result<ffi::AnyBuffer> out) {
  QProblem q;
  if (ffi::Error e = problem(what, 2 * Rows::kRowBytes, ScaleRows, x, w, scales, out, q); e.failure()) return e;
  if (q.m == 0 || q.n == 0) return ffi::Error::Success();
  jaxserve::avx2::Problem p{};
  p.w = q.w;
  p.scales = q.scales;
  p.out = q.out;
  p.m = q.m, p.k = q.k, p.n = q.n, p.group = q.group;
  p.scale_rows = ScaleRows;
  if (scales.element_type() == ffi::DataType::F32)
    jaxserve::avx2::product<Rows, float>(p, q.x, pool);
  else
    jaxserve::avx2::product<Rows, uint16_t>(p, q.x, pool);
  return ffi::Error::Success();
}
#endif

ffi::Error MatmulQ4(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                    ffi::Result<ffi::AnyBuffer> out) {
  if (w.element_type() != ffi::DataType::U8) return ffi::Error::InvalidArgument("cpu q4 matmul: the weight must be uint8");
#if JAXSERVE_BF16_DOT
  return Product<Q4>("cpu q4 matmul", pool, x, w, s, out);
#elif JAXSERVE_AVX2
  return Product<jaxserve::avx2::Q4Pairs, 2>("cpu q4 matmul", pool, x, w, s, out);
#else
  return ffi::Error::Unimplemented("cpu q4 matmul: built without AVX512-BF16 or AVX2");
#endif
}
ffi::Error MatmulQ8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                    ffi::Result<ffi::AnyBuffer> out) {
  if (w.element_type() != ffi::DataType::S8) return ffi::Error::InvalidArgument("cpu q8 matmul: the weight must be int8");
#if JAXSERVE_BF16_DOT
  return Product<Q8>("cpu q8 matmul", pool, x, w, s, out);
#elif JAXSERVE_AVX2
  return Product<jaxserve::avx2::Int8Rows, 1>("cpu q8 matmul", pool, x, w, s, out);
#else
  return ffi::Error::Unimplemented("cpu q8 matmul: built without AVX512-BF16 or AVX2");
#endif
}

}  // namespace

#ifndef JAXSERVE_STANDALONE
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulQ4, MatmulQ4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., K] bfloat16
                                  .Arg<ffi::AnyBuffer>()  // q [ceil(N / 32), K / 2, 32] uint8 nibbles
                                  .Arg<ffi::AnyBuffer>()  // scales [ceil(N / 32), K / G, 2, 32] float16 | float32
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulQ8, MatmulQ8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., K] bfloat16
                                  .Arg<ffi::AnyBuffer>()  // q [ceil(N / 32), K, 32] int8
                                  .Arg<ffi::AnyBuffer>()  // scales [ceil(N / 32), K / G, 1, 32] float16 | float32
                                  .Ret<ffi::AnyBuffer>());
#endif
