// Paged attention for the CPU: one XLA FFI custom call for ragged (prefill, chunked prefill) and
// decode batches over jaxserve's stacked paged KV cache. Built on first use by cpu_attention.py
// (g++ -O3 -march=native), so it is compiled for the machine it runs on.
//
// Why it exists: XLA:CPU emits the pure-jnp reference's page gathers as a per-element loop and
// materialises the gathered keys and values (widened to float32) before the products read them;
// on SmolLM2 that made attention ~40% of a 16-sequence decode step. Here each (sequence, kv head,
// block of query rows) reads its keys and values once, straight from the pages, and never writes
// them anywhere.
//
// On CPUs with AVX512-BF16 a bfloat16 cache is not widened at all (run_task_bf16): its products use
// bfloat16 dot instructions, and the probabilities are rounded to bfloat16 for p.v (softmax max
// and sum stay float32).
//
// An 8-bit float cache (float8_e4m3fn or float8_e5m2: `--kv-cache-dtype fp8*`, which stores the
// values themselves) is read under float32 or bfloat16 queries: each block's rows are widened as
// they are read, exactly (to float32, or to bfloat16 for the AVX512-BF16 path; every float8 value
// is exact in both). A step moves half the bytes of a bfloat16 cache, and the products are the
// references', which widen the same stored values to float32 (the AVX512-BF16 path still rounds
// the probabilities for p.v, as for a bfloat16 cache).
//
// Semantics are the references' (pallas_kernels/ragged_paged_attention.py): query row i of
// sequence b sits at position kv_lens[b] - q_len_b + i; key position k is visible iff k <= qpos and
// (window == 0 or qpos - k < window); logits are q.k * scale, soft-capped as tanh(s / cap) * cap
// when softcap > 0; softmax in float32; a row that sees nothing, and every row at or beyond
// cu_q_lens[num_seqs], returns zeros. Out-of-range page ids (never produced by the engine) are
// clamped into [0, num_pages) so they cannot read outside the cache.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"
#if JAXSERVE_AVX2
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kRowBlock = 16;  // query rows of one sequence handled together (they share key reads)

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA's convert does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// One element of an 8-bit float cache (vLLM's fp8 KV cache with a scale of 1.0: the values
// themselves, rounded). Two distinct one-byte types, so that templates over the cache's element
// type tell the formats apart.
struct f8e4m3fn {  // bias 7, subnormals, no infinities; 0x7f / 0xff are NaN
  uint8_t bits;
};
struct f8e5m2 {  // bias 15, IEEE-like: subnormals, infinities, NaNs
  uint8_t bits;
};

// Exact widening of a float8 element to float32's bits. A normal's exponent and mantissa move into
// float32's fields with one shift and a rebias. A subnormal (exponent field 0, zero included) is
// its mantissa, converted from an integer, times the format's smallest subnormal, so no float32
// denormal is ever formed: XLA may run with denormals flushed to zero, and denormal operands are
// slow. Every case is computed and picked with masks, not branches: GCC will not speculate a float
// multiply written under a condition (it may trap, under the default -ftrapping-math), and the
// branch left behind keeps load_row's `omp simd` loop scalar.
inline uint32_t f32_bits_of(f8e4m3fn x) {
  const uint32_t mag = x.bits & 0x7fu, sign = static_cast<uint32_t>(x.bits & 0x80u) << 24;
  const float sub_f = static_cast<float>(static_cast<int32_t>(mag)) * 0x1p-9f;
  uint32_t sub;
  std::memcpy(&sub, &sub_f, sizeof sub);
  const uint32_t normal = (mag << 20) + ((127u - 7u) << 23);
  const uint32_t is_sub = 0u - (mag < 8u), is_nan = 0u - (mag == 0x7fu);  // all ones or zero
  const uint32_t u = (sub & is_sub) | (normal & ~is_sub);
  return ((0x7fc00000u & is_nan) | (u & ~is_nan)) | sign;  // 0x7f, 0xff: the only NaNs (no infinities)
}

inline uint32_t f32_bits_of(f8e5m2 x) {
  const uint32_t mag = x.bits & 0x7fu, sign = static_cast<uint32_t>(x.bits & 0x80u) << 24;
  const float sub_f = static_cast<float>(static_cast<int32_t>(mag)) * 0x1p-16f;
  uint32_t sub;
  std::memcpy(&sub, &sub_f, sizeof sub);
  const uint32_t is_sub = 0u - (mag < 4u), is_top = 0u - (mag >= 0x7cu);
  // exponent 31 (infinities, NaNs) goes to 255, the others are rebiased by 127 - 15
  const uint32_t normal = (mag << 21) + ((127u - 15u) << 23) + (is_top & ((255u - 31u - (127u - 15u)) << 23));
  return ((sub & is_sub) | (normal & ~is_sub)) | sign;
}

template <typename T>
inline void load_row(const T* src, float* dst, int n);

template <typename F8>
inline void load_row_f8(const F8* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const uint32_t u = f32_bits_of(src[i]);
    std::memcpy(dst + i, &u, sizeof u);
  }
}

template <>
inline void load_row<f8e4m3fn>(const f8e4m3fn* src, float* dst, int n) {
  load_row_f8(src, dst, n);
}

template <>
inline void load_row<f8e5m2>(const f8e5m2* src, float* dst, int n) {
  load_row_f8(src, dst, n);
}

template <>
inline void load_row<float>(const float* src, float* dst, int n) {
  std::memcpy(dst, src, sizeof(float) * n);
}

template <>
inline void load_row<uint16_t>(const uint16_t* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int n);

template <>
inline void store_row<float>(const float* src, float* dst, int n) {
  std::memcpy(dst, src, sizeof(float) * n);
}

template <>
inline void store_row<uint16_t>(const float* src, uint16_t* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// 16 floats as one vector (GCC/Clang lower it to whatever width the CPU has).
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(v16 v) {  // a shuffle tree; a plain reduction loop compiles to 16 serial adds
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) lane-wise for x <= 0 or -inf (softmax arguments), vectorisable: 2^(x log2 e) split into the
// nearest integer power, set in the exponent bits, times Cephes' exp2f polynomial for 2^f on
// [-0.5, 0.5] (relative error ~2e-7 for x > -2, ~1e-6 for x > -20: the rounding of x log2 e).
// Below -87 it is 0 (the true value underflows float32 there anyway).
inline v16 exp16(v16 x) {
  typedef int32_t i16 __attribute__((vector_size(64)));
  const v16 xc = (x < -87.f) ? v16{} - 87.f : x;
  const v16 t = xc * 1.44269504088896341f;
  const v16 half = t + 0.5f;
  v16 fi = __builtin_convertvector(__builtin_convertvector(half, i16), v16);  // truncates toward 0
  fi = (fi > half) ? fi - 1.f : fi;  // floor(t + 0.5): t rounded to the nearest integer
  const v16 f = t - fi;
  v16 q = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  q = q * f + 9.618437357674640e-3f;
  q = q * f + 5.550332471162809e-2f;
  q = q * f + 2.402264791363012e-1f;
  q = q * f + 6.931472028550421e-1f;
  q = q * f + 1.0f;
  const i16 bits = (__builtin_convertvector(fi, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const v16 r = q * scale;
  return (x < -87.f) ? v16{} : r;
}

inline float hmax(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  v8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  a = a > b ? a : b;
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), e = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c = c > e ? c : e;
  return std::max(std::max(c[0], c[1]), std::max(c[2], c[3]));
}

// Sixteen vectors of partial sums (one per key) -> one vector of the sixteen sums, in key order.
// Four shuffle-and-add levels, each halving the partials per key: ~3 operations per key instead of
// a full horizontal sum per key.
inline v16 transpose_sum(v16* x) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

struct Problem {
  const void* q;  // [total, q_heads, head_dim]
  const void* k;  // [layers, kv_heads, num_pages, page_size, head_dim]
  const void* v;
  void* out;  // like q
  const int32_t* page_tables;  // [max_seqs, max_pages]
  const int32_t* cu_q_lens;  // [max_seqs + 1]
  const int32_t* kv_lens;  // [max_seqs]
  int64_t total, q_heads, head_dim, kv_heads, num_pages, page_size, max_seqs, max_pages;
  int64_t layer, num_seqs, window;
  float scale, softcap;
};

struct Task {
  int32_t seq, kv_head, row0, rows;  // rows [row0, row0 + rows) of `seq`'s new tokens
  int64_t start, q_len;  // the sequence's first row in q and its number of new tokens (validated)
};

constexpr int kKeys = 16;  // keys per block: one vector of logits per query

// A task's keys: positions [lo, hi) of one sequence, read in blocks of up to kKeys slots of one
// page from one layer and kv head of the stacked cache.
template <typename T>
struct Keys {
  const Problem& p;
  int64_t d, first_pos, lo, hi, page_elems;
  const T* k_layer;
  const T* v_layer;
  const int32_t* table;

  Keys(const Problem& p_, const Task& t, int64_t head_dim) : p(p_), d(head_dim) {
    const int64_t kv_len = std::min<int64_t>(p.kv_lens[t.seq], p.max_pages * p.page_size);
    first_pos = kv_len - t.q_len + t.row0;  // position of the task's first row
    hi = std::min(first_pos + t.rows, kv_len);  // keys any row can see: [lo, hi)
    lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
    page_elems = p.page_size * d;
    const int64_t layer_off = (p.layer * p.kv_heads + t.kv_head) * p.num_pages * page_elems;
    k_layer = static_cast<const T*>(p.k) + layer_off;
    v_layer = static_cast<const T*>(p.v) + layer_off;
    table = p.page_tables + static_cast<int64_t>(t.seq) * p.max_pages;
  }

  int64_t page_offset(int64_t index) const {  // out-of-range page ids are clamped into the cache
    const int64_t page = table[std::min<int64_t>(index, p.max_pages - 1)];
    return std::min<int64_t>(std::max<int64_t>(page, 0), p.num_pages - 1) * page_elems;
  }

  // The block at `pos`: its number of keys and its offset in the layer. When it ends a page, the
  // next page (scattered, so beyond the hardware prefetcher) is fetched.
  int64_t block(int64_t pos, int64_t* offset) const {
    const int64_t index = pos / p.page_size, slot = pos % p.page_size;
    const int64_t count = std::min<int64_t>({kKeys, p.page_size - slot, hi - pos});
    *offset = page_offset(index) + slot * d;
    if (slot + count == p.page_size && pos + count < hi) {
      const int64_t next = page_offset(index + 1);
      for (int64_t b = 0; b < page_elems * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_layer + next) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(v_layer + next) + b);
      }
    }
    return count;
  }

  // 1 for each of the block's keys the query at `qpos` sees (causal, window), else 0.
  v16 visible(int64_t pos, int64_t count, int64_t qpos) const {
    v16 ok = {};
    for (int j = 0; j < kKeys; ++j) {
      const int64_t kpos = pos + j;
      ok[j] = (j < count && kpos <= qpos && (p.window <= 0 || qpos - kpos < p.window)) ? 1.f : 0.f;
    }
    return ok;
  }
};

// One query's online-softmax step over a block's (scaled) logits: soft-caps them, masks the keys
// it cannot see, writes the block's probabilities to `probs` (zeros if it sees none, and returns
// false), and rescales its running sum `l` and unnormalised output `acc` (acc_len floats) to the
// new running max `m`.
inline bool softmax_step(v16 s16, const v16& visible, float softcap, float& m, float& l, float* probs, float* acc,
                         int64_t acc_len) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (softcap > 0.f)
    for (int j = 0; j < kKeys; ++j) s16[j] = std::tanh(s16[j] / softcap) * softcap;
  s16 = visible > 0.f ? s16 : v16{} + neg_inf;
  const float bm = hmax(s16);
  if (bm == neg_inf) {
    std::memset(probs, 0, sizeof(float) * kKeys);
    return false;
  }
  const float m_new = std::max(m, bm);
  const float alpha = m == neg_inf ? 0.f : exp16(v16{} + (m - m_new))[0];
  const v16 p16 = exp16(s16 - m_new);
  std::memcpy(probs, &p16, sizeof p16);
  l = l * alpha + hsum(p16);
  m = m_new;
  if (alpha != 1.f)
    for (int64_t c = 0; c < acc_len; ++c) acc[c] *= alpha;
  return true;
}

// The float32 working set of a task of run_task_dv and avx2::run_task, carved from `scratch`
// (32-byte aligned): the scaled queries (loaded here), the unnormalised outputs, each query's running
// max and sum, a block's widened keys or values and its probabilities; `store` writes the outputs.
template <typename T>
struct FloatTask {
  float* qf;   // [nq, d] scaled queries
  float* acc;  // [nq, d] unnormalised outputs
  float* kb;   // [kKeys, d] the block's keys, then its values, in float32
  float* m;    // [nq] running max
  float* l;    // [nq] running sum
  float* pb;   // [nq, kKeys] the block's probabilities
  int64_t d, group, nq;

  FloatTask(const Problem& p, const Task& t, int64_t head_dim, std::vector<float>& scratch)
      : d(head_dim), group(p.q_heads / p.kv_heads), nq(t.rows * (p.q_heads / p.kv_heads)) {
    scratch.resize(static_cast<size_t>(2 * nq * d + kKeys * d + 2 * nq + nq * kKeys + 8));
    qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
    acc = qf + nq * d;
    kb = acc + nq * d;
    m = kb + kKeys * d;
    l = m + nq;
    pb = l + nq;
    const T* q = static_cast<const T*>(p.q);
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t g = 0; g < group; ++g) {
        float* dst = qf + (r * group + g) * d;
        load_row<T>(q + ((t.start + t.row0 + r) * p.q_heads + t.kv_head * group + g) * d, dst, static_cast<int>(d));
        for (int64_t i = 0; i < d; ++i) dst[i] *= p.scale;
      }
    std::fill(acc, acc + nq * d, 0.f);
    std::fill(m, m + nq, -std::numeric_limits<float>::infinity());
    std::fill(l, l + nq, 0.f);
  }

  void store(const Problem& p, const Task& t) const {  // outputs / running sums (0 where nothing was seen)
    T* out = static_cast<T*>(p.out);
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + (r * group + g) * d;
        const float inv = l[r * group + g] > 0.f ? 1.f / l[r * group + g] : 0.f;
        for (int64_t c = 0; c < d; ++c) a[c] *= inv;
        store_row<T>(a, out + ((t.start + t.row0 + r) * p.q_heads + t.kv_head * group + g) * d, static_cast<int>(d));
      }
  }
};

// One task: `rows` query rows of one sequence, the `group` q heads of one kv head, in one pass
// over the keys with an online softmax. Keys come in blocks of up to 16 within one page; each block
// is widened to float32 once and serves every query of the task. head_dim must be a multiple of 16.
// T is the queries' and the output's element type, C the cache's (T, or a float8 format).
template <typename T, typename C, int DV>
void run_task_dv(const Problem& p, const Task& t, std::vector<float>& scratch) {
  const int64_t d = 16 * DV;
  const Keys<C> keys(p, t, d);
  FloatTask<T> work(p, t, d, scratch);
  const int64_t group = work.group, nq = work.nq;
  float *qf = work.qf, *acc = work.acc, *kb = work.kb, *m = work.m, *l = work.l, *pb = work.pb;

  v16 partial[kKeys];
  for (int64_t pos = keys.lo; pos < keys.hi;) {
    int64_t off;
    const int64_t count = keys.block(pos, &off);
    for (int64_t j = 0; j < count; ++j) load_row<C>(keys.k_layer + off + j * d, kb + j * d, static_cast<int>(d));

    // Logits and probabilities of the block, query by query.
    bool any = false;
    for (int64_t r = 0; r < t.rows; ++r) {
      const v16 visible = keys.visible(pos, count, keys.first_pos + r);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = r * group + g;
        const float* qi = qf + i * d;
        for (int j = 0; j < kKeys; ++j) {
          v16 sum = {};
          if (j < count)
            for (int c = 0; c < DV; ++c) sum += load16(qi + 16 * c) * load16(kb + j * d + 16 * c);
          partial[j] = sum;
        }
        any |= softmax_step(transpose_sum(partial), visible, p.softcap, m[i], l[i], pb + i * kKeys, acc + i * d, d);
      }
    }
    if (any) {  // probabilities times values; a zero probability never touches a (maybe NaN) value
      for (int64_t j = 0; j < count; ++j) load_row<C>(keys.v_layer + off + j * d, kb + j * d, static_cast<int>(d));
      for (int64_t i = 0; i < nq; ++i) {  // query-major: the query's output stays in registers
        const float* pi = pb + i * kKeys;
        float* a = acc + i * d;
        v16 av[DV];
        for (int c = 0; c < DV; ++c) av[c] = load16(a + 16 * c);
        for (int64_t j = 0; j < count; ++j) {
          const float w = pi[j];
          if (w == 0.f) continue;
          const float* vj = kb + j * d;
          for (int c = 0; c < DV; ++c) av[c] += w * load16(vj + 16 * c);
        }
        for (int c = 0; c < DV; ++c) std::memcpy(a + 16 * c, &av[c], sizeof(v16));
      }
    }
    pos += count;
  }
  work.store(p, t);
}

#if JAXSERVE_BF16_DOT
// A block's cache rows as bfloat16 for run_task_bf16. A bfloat16 cache is read in place.
template <typename C>
struct Bf16Rows {
  template <int D>
  const uint16_t* rows(const uint16_t* src, int64_t, uint16_t*) const { return src; }
};

// A float8 cache's rows are widened into `buf` (every float8 value is exact in bfloat16: fewer
// mantissa bits, a narrower exponent range) through a table of the bfloat16 bits of all 128
// magnitudes, taken from f32_bits_of once and held in four registers: two two-table word permutes
// and a blend per 32 elements, then the sign. NaN stays NaN.
template <typename F8>
struct Bf16RowsF8 {
  __m512i lut[4];

  Bf16RowsF8() {
    static const std::vector<uint16_t> table = [] {
      std::vector<uint16_t> t(128);
      for (int i = 0; i < 128; ++i) t[i] = static_cast<uint16_t>(f32_bits_of(F8{static_cast<uint8_t>(i)}) >> 16);
      return t;
    }();
    for (int i = 0; i < 4; ++i) lut[i] = _mm512_loadu_si512(table.data() + 32 * i);
  }

  template <int D>
  const uint16_t* rows(const F8* src, int64_t count, uint16_t* buf) const {
    constexpr int NC = (D + 31) / 32;
    constexpr uint64_t kLast = D % 32 == 0 ? 0xffffffffu : 0xffffu;
    const uint8_t* b = reinterpret_cast<const uint8_t*>(src);
    for (int64_t j = 0; j < count; ++j)
      for (int c = 0; c < NC; ++c) {
        const uint64_t mask = c == NC - 1 ? kLast : 0xffffffffu;
        const __m512i bytes = _mm512_maskz_loadu_epi8(mask, b + j * D + c * 32);
        const __m512i x = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(bytes));
        const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
        const __m512i w = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)),
                                                  _mm512_permutex2var_epi16(lut[0], mag, lut[1]),
                                                  _mm512_permutex2var_epi16(lut[2], mag, lut[3]));
        const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
        _mm512_mask_storeu_epi16(buf + j * D + c * 32, static_cast<__mmask32>(mask), _mm512_or_si512(w, sign));
      }
    return buf;
  }
};
template <>
struct Bf16Rows<f8e4m3fn> : Bf16RowsF8<f8e4m3fn> {};
template <>
struct Bf16Rows<f8e5m2> : Bf16RowsF8<f8e5m2> {};

// run_task_dv for bfloat16 queries over a bfloat16 cache on a CPU with AVX512-BF16: no widening of
// keys or values. A float8 cache (C) takes the same path, its block's rows widened to bfloat16 first.
// q.k runs VDPBF16PS over pairs of head dims (exact bf16 products, float32 sums, scaled after, as
// the reference does); p.v runs it over pairs of keys, with the probabilities rounded to bfloat16
// for that product (the softmax's max and sum stay float32; flash-attention kernels do the same).
// A pair's second key past the block's end is a zero row, so an unwritten (NaN) slot is never
// read. Values are interleaved in pairs once per block for every query of the task; the
// interleave permutes head dims within each 32-dim chunk, undone once when the output is stored.
template <typename C, int DV>
void run_task_bf16(const Problem& p, const Task& t, std::vector<float>& scratch) {
  constexpr int D = 16 * DV, NC = (D + 31) / 32;  // head dims; 32-dim chunks
  constexpr uint32_t kLastMask = D % 32 == 0 ? 0xffffffffu : 0xffffu;
  const int64_t group = p.q_heads / p.kv_heads, nq = t.rows * group, start = t.start;
  const Keys<C> keys(p, t, D);
  const Bf16Rows<C> widen;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto chunk_mask = [](int c) { return static_cast<__mmask32>(c == NC - 1 ? kLastMask : 0xffffffffu); };

  scratch.resize(static_cast<size_t>(nq * NC * 32 + 2 * nq + nq * kKeys));
  float* acc = scratch.data();  // [nq, NC, 32] unnormalised outputs, interleaved dim order
  float* m = acc + nq * NC * 32;
  float* l = m + nq;
  float* pb = l + nq;  // [nq, kKeys]
  thread_local std::vector<uint16_t> bf;
  bf.resize(static_cast<size_t>(nq * NC * 32 + kKeys * NC * 32 + (std::is_same_v<C, uint16_t> ? 0 : kKeys * D)));
  uint16_t* qb = bf.data();  // [nq, NC, 32] queries, zero padded
  uint16_t* vb = qb + nq * NC * 32;  // [kKeys / 2, NC, 2, 32]: value rows interleaved in pairs
  uint16_t* wide = vb + kKeys * NC * 32;  // [kKeys, D] a float8 block's keys, then its values

  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  uint16_t* out = static_cast<uint16_t*>(p.out);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      uint16_t* dst = qb + (r * group + g) * NC * 32;
      std::memset(dst, 0, sizeof(uint16_t) * NC * 32);
      std::memcpy(dst, q + ((start + t.row0 + r) * p.q_heads + t.kv_head * group + g) * D, sizeof(uint16_t) * D);
    }
  std::fill(acc, acc + nq * NC * 32, 0.f);
  std::fill(m, m + nq, neg_inf);
  std::fill(l, l + nq, 0.f);

  for (int64_t pos = keys.lo; pos < keys.hi;) {
    int64_t off;
    const int64_t count = keys.block(pos, &off);
    const uint16_t* kblk = widen.template rows<D>(keys.k_layer + off, count, wide);

    bool any = false;
    for (int64_t r = 0; r < t.rows; ++r) {
      const v16 visible = keys.visible(pos, count, keys.first_pos + r);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = r * group + g;
        __m512bh qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + (i * NC + c) * 32);
        __m512 part[kKeys];
        for (int j = 0; j < kKeys; ++j) {
          __m512 sum = _mm512_setzero_ps();
          if (j < count)
            for (int c = 0; c < NC; ++c)
              sum = _mm512_dpbf16_ps(sum, qv[c], (__m512bh)_mm512_maskz_loadu_epi16(chunk_mask(c), kblk + j * D + c * 32));
          part[j] = sum;
        }
        v16 parts[kKeys];
        std::memcpy(parts, part, sizeof parts);
        any |= softmax_step(transpose_sum(parts) * p.scale, visible, p.softcap, m[i], l[i], pb + i * kKeys,
                            acc + i * NC * 32, NC * 32);
      }
    }
    if (any) {
      const int64_t pairs = (count + 1) / 2;
      const uint16_t* vblk = widen.template rows<D>(keys.v_layer + off, count, wide);
      for (int64_t jp = 0; jp < pairs; ++jp)
        for (int c = 0; c < NC; ++c) {
          const __m512i r0 = _mm512_maskz_loadu_epi16(chunk_mask(c), vblk + (2 * jp) * D + c * 32);
          const __m512i r1 = 2 * jp + 1 < count
                                 ? _mm512_maskz_loadu_epi16(chunk_mask(c), vblk + (2 * jp + 1) * D + c * 32)
                                 : _mm512_setzero_si512();
          _mm512_storeu_si512(vb + ((jp * NC + c) * 2) * 32, _mm512_unpacklo_epi16(r0, r1));
          _mm512_storeu_si512(vb + ((jp * NC + c) * 2 + 1) * 32, _mm512_unpackhi_epi16(r0, r1));
        }
      for (int64_t i = 0; i < nq; ++i) {
        alignas(32) uint32_t pp[kKeys / 2];  // probabilities as bfloat16 pairs (key 2k low, 2k + 1 high)
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pb + i * kKeys)));
        float* a = acc + i * NC * 32;
        __m512 av[2 * NC];
        for (int c = 0; c < 2 * NC; ++c) av[c] = _mm512_loadu_ps(a + 16 * c);
        for (int64_t jp = 0; jp < pairs; ++jp) {
          if (pp[jp] == 0) continue;
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[jp]));
          for (int c = 0; c < 2 * NC; ++c)
            av[c] = _mm512_dpbf16_ps(av[c], w, (__m512bh)_mm512_loadu_si512(vb + (jp * NC * 2 + c) * 32));
        }
        for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(a + 16 * c, av[c]);
      }
    }
    pos += count;
  }

  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = r * group + g;
      const __m512 inv = _mm512_set1_ps(l[i] > 0.f ? 1.f / l[i] : 0.f);
      uint16_t* dst = out + ((start + t.row0 + r) * p.q_heads + t.kv_head * group + g) * D;
      for (int c = 0; c < NC; ++c) {
        const __m512 lo_c = _mm512_loadu_ps(acc + (i * NC + c) * 32), hi_c = _mm512_loadu_ps(acc + (i * NC + c) * 32 + 16);
        const __m512 o0 = _mm512_mul_ps(jaxserve::pairs_first_half(lo_c, hi_c), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 32), (__m256i)_mm512_cvtneps_pbh(o0));
        if (c < NC - 1 || D % 32 == 0) {
          const __m512 o1 = _mm512_mul_ps(jaxserve::pairs_second_half(lo_c, hi_c), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 32 + 16), (__m256i)_mm512_cvtneps_pbh(o1));
        }
      }
    }
}
#endif  // JAXSERVE_BF16_DOT

#if JAXSERVE_AVX2
// run_task_dv on x86-64-v3 (AVX2, FMA): the same pass over the keys, written in 8-wide registers.
// Why: the generic code's 16-float vectors are wider than an AVX2 register, and GCC lowered the
// per-query output rows, the transposing sum and the masks through the stack: 100 us per layer for
// one sequence of 160 keys on a Zen 3 core (1.2 GB/s of cache). Keys and values of a block are
// widened to float32 once (load_row: exact for every cache dtype) and serve every query of the
// task; a query's logits for eight keys are eight partial vectors summed by a horizontal-add tree;
// its output row is updated in registers, eight head dims at a time.
namespace avx2 {

inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

inline float hmax8(__m256 v) {
  const __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}

// Eight vectors of partial sums (one per key) -> the eight sums, in key order.
inline __m256 sum8x8(const __m256* p) {
  const __m256 t0 = _mm256_hadd_ps(p[0], p[1]), t1 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 t2 = _mm256_hadd_ps(p[4], p[5]), t3 = _mm256_hadd_ps(p[6], p[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [k0-3 low | k0-3 high], k4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp16 on eight lanes (same steps: the same values).
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, low), _mm256_set1_ps(1.44269504088896341f));
  const __m256 fi = _mm256_floor_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 q = _mm256_fmadd_ps(f, _mm256_set1_ps(1.535336188319500e-4f), _mm256_set1_ps(1.339887440266574e-3f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(9.618437357674640e-3f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(5.550332471162809e-2f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(2.402264791363012e-1f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(6.931472028550421e-1f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(q, _mm256_castsi256_ps(bits)));
}

// All ones in lane j when key pos0 + j (j < 8) is one of the block's (< end) and the query at qpos
// sees it (causal, window).
inline __m256 visible8(int64_t pos0, int64_t end, int64_t qpos, int64_t window) {
  const __m256i kpos = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(pos0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i in_block = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(end)), kpos);
  const __m256i causal = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(qpos + 1)), kpos);
  __m256i ok = _mm256_and_si256(in_block, causal);
  if (window > 0)  // qpos - kpos < window  <=>  kpos > qpos - window
    ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(kpos, _mm256_set1_epi32(static_cast<int32_t>(qpos - window))));
  return _mm256_castsi256_ps(ok);
}

// a[0, 8 N) += sum over the block's keys j of probs[j] * values[j, 0, 8 N) (rows `stride` apart);
// a zero probability skips its row, so an unwritten (maybe NaN) value is never read.
template <int N>
inline void add_values(const float* probs, const float* values, int64_t stride, int64_t count, float* a) {
  __m256 sum[N];
  for (int c = 0; c < N; ++c) sum[c] = _mm256_loadu_ps(a + 8 * c);
  for (int64_t j = 0; j < count; ++j) {
    if (probs[j] == 0.f) continue;
    const __m256 w = _mm256_broadcast_ss(probs + j);
    for (int c = 0; c < N; ++c) sum[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + j * stride + 8 * c), sum[c]);
  }
  for (int c = 0; c < N; ++c) _mm256_storeu_ps(a + 8 * c, sum[c]);
}

template <typename T, typename C, int DV>
void run_task(const Problem& p, const Task& t, std::vector<float>& scratch) {
  constexpr int64_t d = 16 * DV;
  constexpr int NV = 2 * DV;  // ymm per row
  const Keys<C> keys(p, t, d);
  FloatTask<T> work(p, t, d, scratch);
  const int64_t group = work.group, nq = work.nq;
  float *qf = work.qf, *acc = work.acc, *kb = work.kb, *m = work.m, *l = work.l, *pb = work.pb;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t pos = keys.lo; pos < keys.hi;) {
    int64_t off;
    const int64_t count = keys.block(pos, &off);
    for (int64_t j = 0; j < count; ++j) load_row<C>(keys.k_layer + off + j * d, kb + j * d, static_cast<int>(d));

    bool any = false;
    for (int64_t r = 0; r < t.rows; ++r) {
      const int64_t qpos = keys.first_pos + r;
      const __m256 vis0 = visible8(pos, pos + count, qpos, p.window);
      const __m256 vis1 = visible8(pos + 8, pos + count, qpos, p.window);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = r * group + g;
        const float* qi = qf + i * d;
        __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int half = 0; half < 2 && 8 * half < count; ++half) {
          __m256 part[8];
          for (int jj = 0; jj < 8; ++jj) {
            const int64_t j = 8 * half + jj;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            if (j < count) {
              const float* kj = kb + j * d;
              for (int c = 0; c < NV; c += 2) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8 * c), _mm256_loadu_ps(kj + 8 * c), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8 * c + 8), _mm256_loadu_ps(kj + 8 * c + 8), a1);
              }
            }
            part[jj] = _mm256_add_ps(a0, a1);
          }
          s[half] = sum8x8(part);
        }
        if (p.softcap > 0.f) {
          alignas(32) float v[kKeys];
          _mm256_store_ps(v, s[0]);
          _mm256_store_ps(v + 8, s[1]);
          for (int j = 0; j < kKeys; ++j) v[j] = std::tanh(v[j] / p.softcap) * p.softcap;
          s[0] = _mm256_load_ps(v);
          s[1] = _mm256_load_ps(v + 8);
        }
        // The online softmax step (softmax_step's, eight lanes at a time).
        const __m256 ninf = _mm256_set1_ps(neg_inf);
        s[0] = _mm256_blendv_ps(ninf, s[0], vis0);
        s[1] = _mm256_blendv_ps(ninf, s[1], vis1);
        float* probs = pb + i * kKeys;
        const float bm = hmax8(_mm256_max_ps(s[0], s[1]));
        if (bm == neg_inf) {
          std::memset(probs, 0, sizeof(float) * kKeys);
          continue;
        }
        any = true;
        const float m_new = std::max(m[i], bm);
        const float alpha = m[i] == neg_inf ? 0.f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[i] - m_new)));
        const __m256 mn = _mm256_set1_ps(m_new);
        const __m256 p0 = exp8(_mm256_sub_ps(s[0], mn)), p1 = exp8(_mm256_sub_ps(s[1], mn));
        _mm256_storeu_ps(probs, p0);
        _mm256_storeu_ps(probs + 8, p1);
        l[i] = l[i] * alpha + hsum8(_mm256_add_ps(p0, p1));
        m[i] = m_new;
        if (alpha != 1.f) {
          const __m256 a = _mm256_set1_ps(alpha);
          float* ai = acc + i * d;
          for (int c = 0; c < NV; ++c) _mm256_storeu_ps(ai + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(ai + 8 * c), a));
        }
      }
    }
    if (any) {  // probabilities times values; a zero probability never touches a (maybe NaN) value
      for (int64_t j = 0; j < count; ++j) load_row<C>(keys.v_layer + off + j * d, kb + j * d, static_cast<int>(d));
      for (int64_t i = 0; i < nq; ++i) {
        // 64 head dims (eight registers) of the row at a time: the sums stay in registers.
        for (int c = 0; c + 8 <= NV; c += 8) add_values<8>(pb + i * kKeys, kb + 8 * c, d, count, acc + i * d + 8 * c);
        if constexpr (NV % 8 != 0) add_values<NV % 8>(pb + i * kKeys, kb + NV / 8 * 64, d, count, acc + i * d + NV / 8 * 64);
      }
    }
    pos += count;
  }
  work.store(p, t);
}

}  // namespace avx2
#endif  // JAXSERVE_AVX2

template <typename T, typename C>
void run_task(const Problem& p, const Task& t, std::vector<float>& scratch) {
  // head_dim / 16 as a constant, so a query's output and the key block's rows stay in registers.
  // The head dims listed in cpu_attention.HEAD_DIMS; Attention() refuses the others.
#if JAXSERVE_BF16_DOT
  if constexpr (std::is_same_v<T, uint16_t>) {
    switch (p.head_dim / 16) {
      case 1: return run_task_bf16<C, 1>(p, t, scratch);
      case 2: return run_task_bf16<C, 2>(p, t, scratch);
      case 3: return run_task_bf16<C, 3>(p, t, scratch);
      case 4: return run_task_bf16<C, 4>(p, t, scratch);
      case 5: return run_task_bf16<C, 5>(p, t, scratch);
      case 6: return run_task_bf16<C, 6>(p, t, scratch);
      case 7: return run_task_bf16<C, 7>(p, t, scratch);
      case 8: return run_task_bf16<C, 8>(p, t, scratch);
      case 12: return run_task_bf16<C, 12>(p, t, scratch);
      default: return run_task_bf16<C, 16>(p, t, scratch);
    }
  }
#endif
#if JAXSERVE_AVX2
  switch (p.head_dim / 16) {
    case 1: return avx2::run_task<T, C, 1>(p, t, scratch);
    case 2: return avx2::run_task<T, C, 2>(p, t, scratch);
    case 3: return avx2::run_task<T, C, 3>(p, t, scratch);
    case 4: return avx2::run_task<T, C, 4>(p, t, scratch);
    case 5: return avx2::run_task<T, C, 5>(p, t, scratch);
    case 6: return avx2::run_task<T, C, 6>(p, t, scratch);
    case 7: return avx2::run_task<T, C, 7>(p, t, scratch);
    case 8: return avx2::run_task<T, C, 8>(p, t, scratch);
    case 12: return avx2::run_task<T, C, 12>(p, t, scratch);
    default: return avx2::run_task<T, C, 16>(p, t, scratch);
  }
#else
  switch (p.head_dim / 16) {
    case 1: return run_task_dv<T, C, 1>(p, t, scratch);
    case 2: return run_task_dv<T, C, 2>(p, t, scratch);
    case 3: return run_task_dv<T, C, 3>(p, t, scratch);
    case 4: return run_task_dv<T, C, 4>(p, t, scratch);
    case 5: return run_task_dv<T, C, 5>(p, t, scratch);
    case 6: return run_task_dv<T, C, 6>(p, t, scratch);
    case 7: return run_task_dv<T, C, 7>(p, t, scratch);
    case 8: return run_task_dv<T, C, 8>(p, t, scratch);
    case 12: return run_task_dv<T, C, 12>(p, t, scratch);
    default: return run_task_dv<T, C, 16>(p, t, scratch);
  }
#endif
}

template <typename T, typename C, typename Pool>
void run_all(const Problem& p, Pool& pool) {
  std::vector<Task> tasks;
  T* out = static_cast<T*>(p.out);
  const int64_t row_elems = p.q_heads * p.head_dim;
  auto zero_rows = [&](int64_t from, int64_t to) {  // rows no task writes: padding, empty sequences
    if (to > from) std::memset(out + from * row_elems, 0, sizeof(T) * (to - from) * row_elems);
  };
  // Each sequence's rows are clamped into [end of the previous sequence, total]: under jit nothing
  // validated cu_q_lens, and an inconsistent one must neither write outside `out` nor have two
  // tasks write the same rows.
  int64_t prev_end = 0;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t start = std::min<int64_t>(std::max<int64_t>(p.cu_q_lens[b], prev_end), p.total);
    const int64_t end = std::min<int64_t>(std::max<int64_t>(p.cu_q_lens[b + 1], start), p.total);
    zero_rows(prev_end, start);
    prev_end = end;
    const int64_t q_len = end - start;
    if (q_len <= 0 || p.kv_lens[b] <= 0) {
      zero_rows(start, end);
      continue;
    }
    for (int64_t r0 = 0; r0 < q_len; r0 += kRowBlock)
      for (int32_t h = 0; h < p.kv_heads; ++h)
        tasks.push_back({static_cast<int32_t>(b), h, static_cast<int32_t>(r0),
                             static_cast<int32_t>(std::min<int64_t>(kRowBlock, q_len - r0)), start, q_len});
  }
  zero_rows(prev_end, p.total);

  const int64_t num_tasks = static_cast<int64_t>(tasks.size());  // before `tasks` moves into the lambda
  jaxserve::parallel_for(pool, num_tasks, [p, tasks = std::move(tasks)](int64_t i) {
    thread_local std::vector<float> scratch;  // grows to the largest task a thread has run
    run_task<T, C>(p, tasks[i], scratch);
  });
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::S32> window, float scale, float softcap, ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = page_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2)
    return ffi::Error::InvalidArgument("cpu paged attention: q must be 3-D, the cache 5-D, page_tables 2-D");
  const ffi::DataType qt = q.element_type(), ct = k.element_type();
  const bool fp8_cache = ct == ffi::DataType::F8E4M3FN || ct == ffi::DataType::F8E5M2;
  // A narrower cache under float32 queries (--dtype float32 --kv-cache-dtype bfloat16 or fp8) is
  // widened as it is read, as a float8 one is under bfloat16 queries.
  const bool narrower_cache = fp8_cache || (qt == ffi::DataType::F32 && ct == ffi::DataType::BF16);
  if ((ct != qt && !narrower_cache) || v.element_type() != ct || out->element_type() != qt)
    return ffi::Error::InvalidArgument(
        "cpu paged attention: q and the output must share a dtype, and the cache too unless it is narrower "
        "(float8, or bfloat16 under float32 queries)");
  if (qt != ffi::DataType::F32 && qt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu paged attention: q must be float32 or bfloat16");
  if (static_cast<int64_t>(cu_q_lens.element_count()) != pd[0] + 1 ||
      static_cast<int64_t>(kv_lens.element_count()) != pd[0] || num_seqs.element_count() != 1 ||
      layer.element_count() != 1 || window.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "cpu paged attention: cu_q_lens must be [max_seqs + 1], kv_lens [max_seqs], num_seqs/layer/window scalars");
  Problem p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.page_tables = page_tables.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.total = qd[0];
  p.q_heads = qd[1];
  p.head_dim = qd[2];
  p.kv_heads = kd[1];
  p.num_pages = kd[2];
  p.page_size = kd[3];
  p.max_seqs = pd[0];
  p.max_pages = pd[1];
  p.layer = layer.typed_data()[0];
  p.num_seqs = std::min<int64_t>(std::max<int64_t>(num_seqs.typed_data()[0], 0), p.max_seqs);
  p.window = window.typed_data()[0];
  p.scale = scale;
  p.softcap = softcap;
  if (p.num_pages < 1 || p.page_size < 1)
    return ffi::Error::InvalidArgument("cpu paged attention: the cache must hold at least one page of one slot");
  if (kd[4] != p.head_dim || p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0)
    return ffi::Error::InvalidArgument("cpu paged attention: q heads / head_dim do not match the cache");
  const int64_t dv = p.head_dim / 16;
  if (p.head_dim % 16 != 0 || dv < 1 || (dv > 8 && dv != 12 && dv != 16))
    return ffi::Error::InvalidArgument("cpu paged attention: head_dim must be 16..128 in steps of 16, 192 or 256");
  if (p.layer < 0 || p.layer >= kd[0]) return ffi::Error::InvalidArgument("cpu paged attention: layer out of range");
  const bool f32 = qt == ffi::DataType::F32;
  if (ct == ffi::DataType::F8E4M3FN) {
    f32 ? run_all<float, f8e4m3fn>(p, pool) : run_all<uint16_t, f8e4m3fn>(p, pool);
  } else if (ct == ffi::DataType::F8E5M2) {
    f32 ? run_all<float, f8e5m2>(p, pool) : run_all<uint16_t, f8e5m2>(p, pool);
  } else if (ct == ffi::DataType::BF16) {
    f32 ? run_all<float, uint16_t>(p, pool) : run_all<uint16_t, uint16_t>(p, pool);
  } else {
    run_all<float, float>(p, pool);
  }
  return ffi::Error::Success();
}

}  // namespace

// Which code computes the tasks in this build: 2 AVX512-BF16 (bfloat16 queries; float32 ones take
// the generic code), 1 AVX2, 0 the generic vector code.
extern "C" int JaxserveAttentionIsa() { return JAXSERVE_BF16_DOT ? 2 : JAXSERVE_AVX2 ? 1 : 0; }

#ifndef JAXSERVE_STANDALONE
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k pages (stacked)
                                  .Arg<ffi::AnyBuffer>()  // v pages (stacked)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::AnyBuffer>());
#endif
