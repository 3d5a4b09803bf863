// What the native CPU kernels (cpu_attention.cc, cpu_matmul.cc) share: fanning tasks out over
// XLA's CPU thread pool, and the AVX512-BF16 feature test with its pair-interleave helpers.
// native.py hashes this header with each kernel's source, so editing it rebuilds both.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && !defined(JAXSERVE_FORCE_AVX2)
#include <immintrin.h>
#define JAXSERVE_BF16_DOT 1
#else
#define JAXSERVE_BF16_DOT 0
#endif
// The products' second tier (cpu_avx2.h): x86-64-v3 without AVX512-BF16, or any newer CPU when the
// build asks for it (-DJAXSERVE_FORCE_AVX2: the tests run this tier on machines that have both).
#if !JAXSERVE_BF16_DOT && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXSERVE_AVX2 1
#else
#define JAXSERVE_AVX2 0
#endif

namespace jaxserve {

// Runs run(i) for every i in [0, num_tasks): the calling thread and up to pool.num_threads() - 1
// of the pool's threads (XLA's pool has one per core) take tasks from a shared counter, and the
// call returns once all have finished. The state, `run` included, is held by shared_ptr, so a pool
// thread that starts after every task is taken (the pool may be busy with other ops) touches
// nothing that is gone; the caller never waits on a task nobody took, since it takes them itself.
template <typename Pool, typename Run>
void parallel_for(Pool& pool, int64_t num_tasks, Run run) {
  struct State {
    State(Run r, int64_t n) : run(std::move(r)), num_tasks(n) {}
    Run run;
    int64_t num_tasks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  if (num_tasks <= 0) return;
  auto state = std::make_shared<State>(std::move(run), num_tasks);
  auto drain = [](State& s) {
    for (int64_t i; (i = s.next.fetch_add(1)) < s.num_tasks;) {
      s.run(i);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(static_cast<int64_t>(pool.num_threads()) - 1, num_tasks - 1);
  for (int64_t w = 0; w < helpers; ++w) pool.Schedule([state, drain] { drain(*state); });
  drain(*state);
  while (state->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
}

#if JAXSERVE_BF16_DOT
// VDPBF16PS multiplies pairs of bfloat16. Interleaving two rows r0, r1 of 32 bfloat16 with
// unpacklo/unpackhi_epi16 gives the pairs (r0[d], r1[d]) in 128-bit lanes: float32 accumulators
// over `lo` hold elements {0-3, 8-11, 16-19, 24-27}, over `hi` the rest. These put them back in
// order: elements 0-15 and 16-31.
inline __m512 pairs_first_half(__m512 lo, __m512 hi) {
  return _mm512_permutex2var_ps(lo, _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0), hi);
}
inline __m512 pairs_second_half(__m512 lo, __m512 hi) {
  return _mm512_permutex2var_ps(lo, _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8), hi);
}

// This thread's room for a strip's converted weight pairs (2 zmm per row pair of a K-row strip),
// 64-byte aligned: the quantized products' first pass over a strip keeps them for the next passes.
// Kept for the thread's life, grown to the largest K seen.
inline __m512bh* kept_pairs(int64_t k) {
  thread_local std::vector<char> scratch;
  const size_t need = sizeof(__m512bh) * (k + 1) + 64;
  if (scratch.size() < need) scratch.resize(need);
  return reinterpret_cast<__m512bh*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}
#endif

}  // namespace jaxserve
