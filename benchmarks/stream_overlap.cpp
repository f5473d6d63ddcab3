// How well this machine overlaps a read stream from DRAM with arithmetic on what it reads:
// the question behind the decode-attention kernel's cold read rate (docs/results/).
//
// Each thread streams its own 512 MiB buffer (huge pages where granted), widening every
// 64-byte line as bf16 pairs are widened (one shift) and doing WORK FMAs per line on six
// independent accumulators, i.e. a compute rate of roughly 64 B x clock / (WORK / 2) cycles.
// Three ways to feed it:
//   demand   loads only; the hardware prefetchers do what they can,
//   ahead    a prefetcht1 of each 2 KiB block `--ahead` bytes further on in the same stream,
//   chunked  the decode kernel's scheme: while a chunk is read (from L2), the next chunk is
//            requested into L2 a slice per 2 KiB block.
// With WORK = 0 the loop is a plain read; raise WORK until the compute rate nears the read
// rate and compare the three.
//
//   g++ -O2 -march=native -pthread -DWORK=12 benchmarks/stream_overlap.cpp -o /tmp/stream_overlap
//   /tmp/stream_overlap THREADS demand|ahead|chunked [AHEAD_BYTES|CHUNK_BYTES]
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#ifndef WORK
#define WORK 12
#endif

namespace {

constexpr size_t kBytes = size_t(512) << 20, kLine = 64, kBlock = 2048;

// WORK FMAs per line on six accumulators (the pair widening of a bf16 row is one shift).
float consume(const char* p, size_t n) {
  __m512 acc[6];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512 w = _mm512_set1_ps(1.0001f);
  for (size_t o = 0; o < n; o += kLine) {
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_load_si512(p + o), 16));
#pragma GCC unroll 64
    for (int k = 0; k < WORK; ++k) acc[k % 6] = _mm512_fmadd_ps(x, w, acc[k % 6]);
    if constexpr (WORK == 0) acc[0] = _mm512_add_ps(acc[0], x);
  }
  for (int i = 1; i < 6; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return _mm512_reduce_add_ps(acc[0]);
}

void request(const char* p, size_t n) {
  for (size_t o = 0; o < n; o += kLine) _mm_prefetch(p + o, _MM_HINT_T1);
}

float stream(const std::string& how, const char* p, size_t ahead_or_chunk) {
  float s = 0;
  if (how == "demand") return consume(p, kBytes);
  if (how == "ahead") {
    for (size_t o = 0; o < kBytes; o += kBlock) {
      if (o + ahead_or_chunk < kBytes) request(p + o + ahead_or_chunk, kBlock);
      s += consume(p + o, kBlock);
    }
    return s;
  }
  const size_t chunk = ahead_or_chunk, slice = kBlock;  // one slice per block read
  for (size_t c = 0; c < kBytes; c += chunk) {
    for (size_t b = 0; b < chunk; b += kBlock) {
      if (c + chunk < kBytes) request(p + c + chunk + b, slice);
      s += consume(p + c + b, kBlock);
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s THREADS demand|ahead|chunked [BYTES]\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]);
  const std::string how = argv[2];
  const size_t bytes = argc > 3 ? std::strtoul(argv[3], nullptr, 10)
                                : (how == "chunked" ? 131072 : 8192);
  std::vector<char*> buffers;
  for (int t = 0; t < threads; ++t) {
    auto* b = static_cast<char*>(std::aligned_alloc(size_t(2) << 20, kBytes));
    madvise(b, kBytes, MADV_HUGEPAGE);
    std::memset(b, 0x3f, kBytes);  // widens to normal floats
    buffers.push_back(b);
  }
  double best = 0;
  float sink = 0;
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> out(threads);
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] { out[t] = stream(how, buffers[t], bytes); });
    }
    for (auto& w : workers) w.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                         .count();
    best = std::max(best, threads * kBytes / s / 1e9);
    for (float x : out) sink += x;
  }
  // The sums feed the output (an invisible space at most), so the compiler keeps the reads.
  std::printf("WORK %d, %d thread(s), %s %zu: %.1f GB/s (best of 5)%s\n", WORK, threads,
              how.c_str(), how == "demand" ? size_t(0) : bytes, best, sink == 1.0f ? " " : "");
  return 0;
}
