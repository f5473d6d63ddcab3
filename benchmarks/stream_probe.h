// What the standalone read probes (stream_overlap.cpp, item_streams.cpp) share: the arithmetic
// spent on each 64-byte line, the per-thread buffers on huge pages and the best-of-5 timing.
// Each probe defines WORK (FMAs per line) before including this.
#pragma once

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#ifndef WORK
#error "define WORK (FMAs per 64-byte line) before including stream_probe.h"
#endif

namespace probe {

constexpr size_t kLine = 64;

// WORK FMAs per line on six accumulators (the pair widening of a bf16 row is one shift).
struct LineWork {
  __m512 acc[6];
  LineWork() {
    for (auto& a : acc) a = _mm512_setzero_ps();
  }
  inline void line(const char* p) {
    const __m512 w = _mm512_set1_ps(1.0001f);
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_load_si512(p), 16));
#pragma GCC unroll 64
    for (int k = 0; k < WORK; ++k) acc[k % 6] = _mm512_fmadd_ps(x, w, acc[k % 6]);
    if constexpr (WORK == 0) acc[0] = _mm512_add_ps(acc[0], x);
  }
  inline void lines(const char* p, size_t n) {
    for (size_t o = 0; o < n; o += kLine) line(p + o);
  }
  float total() {
    for (int i = 1; i < 6; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
    return _mm512_reduce_add_ps(acc[0]);
  }
};

// One `bytes` buffer per thread, 2 MiB aligned, advised onto huge pages, and filled with bytes
// that widen to normal floats.
inline std::vector<char*> huge_buffers(int threads, size_t bytes) {
  std::vector<char*> buffers;
  for (int t = 0; t < threads; ++t) {
    auto* b = static_cast<char*>(std::aligned_alloc(size_t(2) << 20, bytes));
    madvise(b, bytes, MADV_HUGEPAGE);
    std::memset(b, 0x3f, bytes);
    buffers.push_back(b);
  }
  return buffers;
}

// The best of five rounds, in GB/s, of `read(t)` on threads t = 0..threads-1, each reading
// `bytes` per round. `read` returns its sum; the sums go to `sink`, which the caller prints
// (an invisible space at most), so the compiler keeps the reads.
template <typename Read>
double best_rate(int threads, double bytes, Read&& read, float& sink) {
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> out(threads);
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) workers.emplace_back([&, t] { out[t] = read(t); });
    for (auto& w : workers) w.join();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, threads * bytes / s / 1e9);
    for (float x : out) sink += x;
  }
  return best;
}

}  // namespace probe
