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

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Whether this build has the instructions the kernel needs; cpu_matmul.py asks before using it.
extern "C" int JaxserveMatmulSupported() { return JAXSERVE_BF16_DOT; }

namespace {

struct Problem {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [ceil(N / 32), K, 32]
  uint16_t* out;      // [M, N]
  int64_t m, k, n;
};

#if JAXSERVE_BF16_DOT

constexpr int kStrip = 32;        // columns per strip of the packed weight: one cache line of bf16
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

template <typename Pool>
void run_all(const Problem& p, Pool& pool) {
  // Strips per task: about 8 tasks per thread so threads that start late still get a share, and at
  // least ~64 KB of weight so the pool's overhead stays small.
  const int64_t strips = (p.n + kStrip - 1) / kStrip;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t min_strips = std::max<int64_t>(1, (64 * 1024 / 2) / std::max<int64_t>(p.k * kStrip, 1));
  const int64_t chunk = std::max<int64_t>(min_strips, strips / (8 * threads));
  jaxserve::parallel_for(pool, (strips + chunk - 1) / chunk, [p, chunk, strips](int64_t i) {
    for (int64_t s = i * chunk; s < std::min(strips, (i + 1) * chunk); ++s) strip_all_rows(p, s * kStrip);
  });
}

#endif  // JAXSERVE_BF16_DOT

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out) {
#if JAXSERVE_BF16_DOT
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu matmul: x, the weight and the output must be bfloat16");
  if (xd.size() < 1 || od.size() < 1 || wd.size() != 3 || wd[2] != kStrip)
    return ffi::Error::InvalidArgument("cpu matmul: the weight must be packed in strips, [ceil(N / 32), K, 32]");
  Problem p;
  p.k = xd[xd.size() - 1];
  p.n = od[od.size() - 1];
  p.m = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) p.m *= xd[i];
  if (wd[1] != p.k) return ffi::Error::InvalidArgument("cpu matmul: x and the weight disagree on K");
  if (wd[0] != (p.n + kStrip - 1) / kStrip || static_cast<int64_t>(out->element_count()) != p.m * p.n)
    return ffi::Error::InvalidArgument("cpu matmul: the output must be [..., N] for the weight's strips");
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.w = static_cast<const uint16_t*>(w.untyped_data());
  p.out = static_cast<uint16_t*>(out->untyped_data());
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::memset(p.out, 0, sizeof(uint16_t) * p.m * p.n);
    return ffi::Error::Success();
  }
  run_all(p, pool);
  return ffi::Error::Success();
#else
  return ffi::Error::Unimplemented("cpu matmul: built without AVX512-BF16");
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
#endif
