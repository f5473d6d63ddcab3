"""Read bandwidth of this machine under the access patterns a decode step uses.

A decode-attention call streams, per work item (one row's kv head), that item's K and then its
V. The tiled kernels prefetch the item's V into L2 while they read K, and the next item's K
while they read V (``csrc/attention.cpp``, "Software prefetch"). This probe times plain sums
(no attention arithmetic) over 1 GiB on huge pages, on ``--threads`` OpenMP threads:

* ``one stream``: each thread sums one contiguous part (what a memory system does best);
* ``K/V, prefetched``: the decode kernel's pattern, items of ``--item-kb`` KB of K and of V;
* ``K then V``: the same items read in the same order with no software prefetch.

On a shared VM the available bandwidth itself moves (on one Zen 4 VM between ~30 and
~55 GB/s, in phases of minutes), so the patterns run in turns, ``--rounds`` times, and each
round prints all of them. Compiled on first use with the kernel path's compiler flags.

Usage: python benchmarks/read_patterns.py [--item-kb 32 128 384] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse

from torch.utils.cpp_extension import load_inline

from alignedserve.kernels import select_kernels
from alignedserve.kernels.build import build_flags

SOURCE = r"""
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// 1 GiB of floats on huge pages, written once; kept for the process.
float* buffer() {
  static float* p = [] {
    void* m = mmap(nullptr, kGiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("read_patterns: mmap failed");
    madvise(m, kGiB, MADV_HUGEPAGE);
    std::memset(m, 1, kGiB);
    return static_cast<float*>(m);
  }();
  return p;
}

// Sum of n floats (n % 64 == 0) in 64 independent lanes, so the adds never wait on each
// other; meanwhile `pf_bytes` from `pf` are requested into L2, spread evenly over the range.
float sum(const float* p, int64_t n, const char* pf, int64_t pf_bytes) {
  float lanes[64] = {};
  const int64_t steps = n / 64, pf_lines = pf_bytes / 64;
  int64_t asked = 0;
  for (int64_t i = 0; i < steps; ++i) {
#pragma omp simd
    for (int j = 0; j < 64; ++j) lanes[j] += p[i * 64 + j];
    for (const int64_t want = (i + 1) * pf_lines / steps; asked < want; ++asked) {
      __builtin_prefetch(pf + asked * 64, 0, 2);
    }
  }
  float total = 0;
  for (float v : lanes) total += v;
  return total;
}

template <typename Body>
double gbps(int threads, Body body) {
  float sink = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  sink += body(omp_get_thread_num(), omp_get_num_threads());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (sink == 0.5f) return 0;  // keeps the sums alive
  return kGiB / s / 1e9;
}

}  // namespace

double one_stream(int64_t threads) {
  const float* p = buffer();
  return gbps(threads, [p](int t, int n) {
    const int64_t part = kGiB / 4 / n;
    return sum(p + t * part, part, nullptr, 0);
  });
}

// Items of item_bytes of K (first half of the buffer) and of V (second half); thread t takes
// items t, t + n, ...
double items(int64_t threads, int64_t item_bytes, bool prefetch) {
  const char* base = reinterpret_cast<const char*>(buffer());
  const int64_t half = kGiB / 2, count = half / item_bytes;
  return gbps(threads, [=](int t, int n) {
    float total = 0;
    for (int64_t i = t; i < count; i += n) {
      const auto* k = reinterpret_cast<const float*>(base + i * item_bytes);
      const auto* v = reinterpret_cast<const float*>(base + half + i * item_bytes);
      const char* next_k = i + n < count ? base + (i + n) * item_bytes : nullptr;
      total += sum(k, item_bytes / 4, prefetch ? reinterpret_cast<const char*>(v) : nullptr,
                   prefetch ? item_bytes : 0);
      total += sum(v, item_bytes / 4, prefetch ? next_k : nullptr,
                   prefetch && next_k ? item_bytes : 0);
    }
    return total;
  });
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--item-kb", type=int, nargs="+", default=[32, 128, 384],
                        help="KB of K (and of V) per item: 128 B per cached token and kv head")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = select_kernels(None).path
    flags = build_flags(path if path != "reference" else "avx2")
    ext = load_inline(name=f"read_patterns_{path}", cpp_sources=[SOURCE],
                      functions=["one_stream", "items"], extra_cflags=flags,
                      extra_ldflags=["-fopenmp"])
    print(f"compiled for the {path} path; {args.threads} threads; GB/s")
    for r in range(1, args.rounds + 1):
        cells = [f"one stream {ext.one_stream(args.threads):5.1f}"]
        for kb in args.item_kb:
            item = kb * 1024
            cells.append(f"{kb} KB items: K/V prefetched {ext.items(args.threads, item, True):5.1f}"
                         f", K then V {ext.items(args.threads, item, False):5.1f}")
        print(f"round {r}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
