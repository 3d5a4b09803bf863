// Small-batch products for the CPU: out[M, N] = x[M, K] @ W in bfloat16 with float32 accumulation,
// where W is a weight stored [K, N] (a Linear kernel) or [N, K] (an LM head tied to the embedding).
// One XLA FFI custom call, built on
// first use by cpu_matmul.py (-march=native) and only used where the CPU has AVX512-BF16.
//
// Why it exists: a decode step multiplies a few rows (one per running sequence) by every weight of
// the model, so it is a stream over the weights. XLA:CPU's bfloat16 dot reaches ~10 GB/s of weight
// at 16 rows on two Zen 4 cores and ~1.4 GB/s at one row; this kernel streams the weight once with
// software prefetch and feeds it to VDPBF16PS (pairs of bf16 products added into float32), so one
// row runs at the memory's rate and sixteen rows close to it.
//
// Layout of the work: [K, N] weights are cut into strips of 32 columns. For each strip, rows k and
// k+1 are loaded as whole cache lines and interleaved (bf16 pairs along K, what VDPBF16PS takes),
// then multiplied into up to 12 query rows at once; more rows reuse the strip from L2. [N, K] weights
// are read in tiles of 4 rows (8 for fewer than 4 query rows), 32 elements of K per instruction,
// and reduced at the end. Strips / tiles are shared out over XLA's CPU thread pool.
//
// Rounding: every product and partial sum is float32 (VDPBF16PS adds the two products of a pair
// before the accumulator, and treats bf16 denormals as zero); the output is rounded to bfloat16 to
// nearest even, as XLA's convert does. Sums run in a different order than XLA's dot, so results
// agree to float32 rounding before the final bf16 rounding, not bit for bit.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Whether this build has the instructions the kernel needs; cpu_matmul.py asks before using it.
extern "C" int JaxserveMatmulSupported() { return JAXSERVE_BF16_DOT; }

namespace {

struct Problem {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [K, N] (or [N, K] when transposed)
  uint16_t* out;      // [M, N]
  int64_t m, k, n;
  bool transposed;
};

#if JAXSERVE_BF16_DOT

constexpr int kStrip = 32;        // columns per strip of a [K, N] weight: one cache line of bf16
constexpr int kRowsPerPass = 12;  // query rows per pass over a strip: 2 x 12 accumulators + temporaries fit 32 zmm
constexpr int kPrefetchRows = 8;  // weight rows fetched ahead; the strided stream defeats the hardware prefetcher
constexpr int kTransposedRows = 16;  // accumulators per [N, K] tile: rows x weight rows

inline int32_t load_pair(const uint16_t* p) {  // two adjacent bf16 as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Rows [m0, m0 + MB) x columns [n0, n0 + 32) of x @ W for W [K, N].
template <int MB>
void strip(const Problem& p, int64_t n0, int64_t m0) {
  const int64_t cols = std::min<int64_t>(kStrip, p.n - n0);
  const __mmask32 col_mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  __m512 lo[MB], hi[MB];  // the interleave puts columns {0-3, 8-11, 16-19, 24-27} in lo, the rest in hi
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  const uint16_t* w = p.w + n0;
  const uint16_t* x = p.x + m0 * p.k;
  const int64_t n = p.n;
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
    uint16_t* dst = p.out + (m0 + m) * n + n0;
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

// Sixteen vectors of partial sums -> one vector holding the sixteen sums, in order.
__attribute__((always_inline)) inline __m512 transpose_sum(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i)  // 256-bit halves
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit quarters
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xdd));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // 64-bit pairs within each lane
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xdd));
  // s holds sum i at 4 * (i % 4) + i / 4.
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), s);
}

// x rows [m0, m0 + MB) laid out for transposed_tile: chunk c of row m (32 bf16 of K, zero padded)
// at packed[(c * MB + m) * 32], so one pointer and constant offsets reach every row's chunk.
// Rows past the end are zeros (their sums are dropped).
void pack_rows(const Problem& p, int64_t m0, int mb, uint16_t* packed) {
  const int64_t chunks = (p.k + 31) / 32;
  std::memset(packed, 0, sizeof(uint16_t) * chunks * mb * 32);
  for (int m = 0; m < mb && m0 + m < p.m; ++m)
    for (int64_t c = 0; c < chunks; ++c)
      std::memcpy(packed + (c * mb + m) * 32, p.x + (m0 + m) * p.k + c * 32,
                  sizeof(uint16_t) * std::min<int64_t>(32, p.k - c * 32));
}

// Packed x rows (MB of them) x weight rows [n0, n0 + NB) of x @ W^T for W [N, K]; MB * NB <= 16.
// Weight rows past the end repeat the last one (their sums are dropped).
template <int MB, int NB>
void transposed_tile(const Problem& p, const uint16_t* packed, int64_t n0, int64_t m0) {
  const int64_t k_len = p.k;
  const uint16_t* wr[NB];
  const uint16_t* next[NB];  // rows two tiles on, fetched while this one computes (DRAM latency)
  for (int j = 0; j < NB; ++j) {
    wr[j] = p.w + std::min<int64_t>(n0 + j, p.n - 1) * k_len;
    next[j] = p.w + std::min<int64_t>(n0 + 2 * NB + j, p.n - 1) * k_len;
  }
  __m512 acc[kTransposedRows];  // MB * NB used, the rest stay zero for transpose_sum
#pragma GCC unroll 16
  for (int i = 0; i < kTransposedRows; ++i) acc[i] = _mm512_setzero_ps();
  const uint16_t* xc = packed;
  for (int64_t k = 0; k < k_len; k += 32, xc += MB * 32) {
    const __mmask32 mask = k_len - k >= 32 ? ~__mmask32{0} : (__mmask32{1} << (k_len - k)) - 1;
    __m512bh wv[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(next[j] + k), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[j] + k);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xc + m * 32);
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) acc[m * NB + j] = _mm512_dpbf16_ps(acc[m * NB + j], xv, wv[j]);
    }
  }
  alignas(64) uint16_t sums[kTransposedRows];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), (__m256i)_mm512_cvtneps_pbh(transpose_sum(acc)));
  for (int m = 0; m < MB && m0 + m < p.m; ++m)
    for (int j = 0; j < NB && n0 + j < p.n; ++j) p.out[(m0 + m) * p.n + n0 + j] = sums[m * NB + j];
}

// One task: a run of strips (or of weight rows when transposed), every query row.
struct Task {
  int64_t begin, end;  // columns of the output
};

// Tile shapes (x rows, weight rows): four by four balances loads against products (8 loads per 16
// products); fewer x rows take more weight rows so the accumulators stay independent.
int transposed_rows_per_pass(int64_t m) { return m >= 4 ? 4 : m >= 2 ? 2 : 1; }
int transposed_weight_rows(int64_t m) { return m >= 4 ? 4 : 8; }

// The packed x of a transposed product: blocks of transposed_rows_per_pass rows (pack_rows).
int64_t packed_block(const Problem& p) { return (p.k + 31) / 32 * transposed_rows_per_pass(p.m) * 32; }

std::vector<uint16_t> pack_all_rows(const Problem& p) {
  const int mb = transposed_rows_per_pass(p.m);
  const int64_t block = packed_block(p), blocks = (p.m + mb - 1) / mb;
  std::vector<uint16_t> packed(blocks * block);
  for (int64_t b = 0; b < blocks; ++b) pack_rows(p, b * mb, mb, packed.data() + b * block);
  return packed;
}

// `packed`: pack_all_rows(p) for a transposed product, unused otherwise.
void run_task(const Problem& p, const Task& t, const uint16_t* packed) {
  if (!p.transposed) {
    for (int64_t n0 = t.begin; n0 < t.end; n0 += kStrip) strip_all_rows(p, n0);
    return;
  }
  const int mb = transposed_rows_per_pass(p.m);
  const int nb = transposed_weight_rows(p.m);
  const int64_t block = packed_block(p), blocks = (p.m + mb - 1) / mb;
  // Weight rows outside, x blocks inside: the tile's weight rows are read from memory once and
  // from L1 for every further block of x rows.
  for (int64_t n0 = t.begin; n0 < t.end; n0 += nb)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* xb = packed + b * block;
      switch (mb) {
        case 4: transposed_tile<4, 4>(p, xb, n0, b * mb); break;
        case 2: transposed_tile<2, 8>(p, xb, n0, b * mb); break;
        default: transposed_tile<1, 8>(p, xb, n0, b * mb); break;
      }
    }
}

template <typename Pool>
void run_all(const Problem& p, Pool& pool) {
  // Columns per task: a multiple of the tile width, about 8 tasks per thread so threads that start
  // late still get a share, and at least ~64 KB of weight so the pool's overhead stays small.
  const int64_t unit = p.transposed ? transposed_weight_rows(p.m) : kStrip;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t min_cols = std::max<int64_t>(unit, (64 * 1024 / 2) / std::max<int64_t>(p.k, 1));
  int64_t chunk = std::max<int64_t>(min_cols, p.n / (8 * threads));
  chunk = (chunk + unit - 1) / unit * unit;
  // x is packed once per call, not by every task.
  std::vector<uint16_t> packed = p.transposed ? pack_all_rows(p) : std::vector<uint16_t>();
  jaxserve::parallel_for(pool, (p.n + chunk - 1) / chunk, [p, chunk, packed = std::move(packed)](int64_t i) {
    const int64_t begin = i * chunk;
    run_task(p, {begin, std::min(begin + chunk, p.n)}, packed.data());
  });
}

#endif  // JAXSERVE_BF16_DOT

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, bool transposed,
                  ffi::Result<ffi::AnyBuffer> out) {
#if JAXSERVE_BF16_DOT
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu matmul: x, the weight and the output must be bfloat16");
  if (xd.size() < 1 || wd.size() != 2) return ffi::Error::InvalidArgument("cpu matmul: the weight must be 2-D");
  const int64_t rows = wd[0], cols = wd[1];
  Problem p;
  p.transposed = transposed;
  p.k = xd[xd.size() - 1];
  p.n = transposed ? rows : cols;
  if ((transposed ? cols : rows) != p.k) return ffi::Error::InvalidArgument("cpu matmul: x and the weight disagree on K");
  p.m = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) p.m *= xd[i];
  if (static_cast<int64_t>(out->element_count()) != p.m * p.n)
    return ffi::Error::InvalidArgument("cpu matmul: the output must be [..., N]");
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
                                  .Arg<ffi::AnyBuffer>()  // weight [K, N] or [N, K]
                                  .Attr<bool>("transposed")
                                  .Ret<ffi::AnyBuffer>());
#endif
