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
#include <cstdio>
#include <string>

#ifndef WORK
#define WORK 12
#endif

#include "stream_probe.h"

namespace {

constexpr size_t kBytes = size_t(512) << 20, kLine = probe::kLine, kBlock = 2048;

float consume(const char* p, size_t n) {
  probe::LineWork work;
  work.lines(p, n);
  return work.total();
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
  const std::vector<char*> buffers = probe::huge_buffers(threads, kBytes);
  float sink = 0;
  const double best = probe::best_rate(
      threads, double(kBytes), [&](int t) { return stream(how, buffers[t], bytes); }, sink);
  std::printf("WORK %d, %d thread(s), %s %zu: %.1f GB/s (best of 5)%s\n", WORK, threads,
              how.c_str(), how == "demand" ? size_t(0) : bytes, best, sink == 1.0f ? " " : "");
  return 0;
}
