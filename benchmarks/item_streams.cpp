// How fast can two threads read the decode kernel's work items, with its arithmetic on every
// line, depending on how the items' bytes are laid out and requested? The question behind the
// decode attention's read rate in the VM's fast-read phases (docs/results/).
//
// Memory is cut into row slots of one layer of one row: 3 kv heads x (K, V) x C bytes, the
// cache's [2, kv_heads, capacity, dim] (`items-*`) or K and V 2 KiB tiles interleaved per head
// (`interleaved`). A work item is one kv head of one slot: L bytes of K, then L of V. Items are
// taken in a shuffled order, as the kernel's longest-first queue takes them from many rows.
// Every 64-byte line is widened once (a shift) and fed to WORK FMAs on six accumulators, as in
// benchmarks/stream_overlap.cpp (WORK 4 is about the dot-product kernel's density on Zen 4).
//
//   stream                one contiguous stream per thread, demand loads (the plain read);
//   items-prefetch        today's scheme: K read while its V is requested (prefetcht1, a tile
//                         per tile), then V read while the next item's K is requested;
//   items-demand          the same reads, no software prefetch;
//   items-lockstep        K read four tiles at a time, line j of each in turn (the score
//                         pass's order), demand loads;
//   items-lockstep-prefetch   the same with today's requests;
//   interleaved           one item = one stream of K and V tiles, read in order (a one-pass
//                         kernel over an interleaved layout), demand loads;
//   rows                  one item = a whole slot (row unit): tile t of K of kv head 0, 1, 2,
//                         then tile t + 1, ..., then its V planes the same way, demand loads;
//   rows-regions          the same reads over a layout whose slot keeps K of all kv heads in
//                         one run of 3 L bytes, then V (a kv-head-inner cache layout);
//   items-ahead           items-demand's reads, each line's read preceded by a request
//                         (prefetcht0) for the line AHEAD bytes further on through the item's
//                         K, its V and the next item's K (the decode kernel's read-ahead).
// Slots are separate rows' caches, so `rows*` take them shuffled. C = L (e.g. `80 80`) shows
// the same reads with no unused capacity between planes.
//
//   g++ -O2 -march=native -pthread -DWORK=4 [-DAHEAD=8192] benchmarks/item_streams.cpp \
//       -o /tmp/item_streams
//   /tmp/item_streams MODE [L_KIB C_KIB]     (default 80 96: a 640-token row's head, bf16)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#ifndef WORK
#define WORK 4
#endif

#include "stream_probe.h"

#ifndef AHEAD
#define AHEAD 8192
#endif

namespace {

constexpr size_t kBytes = size_t(512) << 20, kLine = probe::kLine, kTile = 2048, kHeads = 3;
constexpr int kThreads = 2;

inline void request(const char* p) {
  for (size_t o = 0; o < kTile; o += kLine) _mm_prefetch(p + o, _MM_HINT_T1);
}

// L bytes of K and of V per item; C bytes per plane (K or V of one kv head of one row).
struct Layout {
  size_t L, C;
  const char* slot(const char* base, int item) const {
    return base + item / kHeads * 2 * kHeads * C;
  }
  const char* k(const char* base, int item) const { return slot(base, item) + item % kHeads * C; }
  const char* v(const char* base, int item) const { return k(base, item) + kHeads * C; }
  const char* interleaved(const char* base, int item) const {
    return slot(base, item) + item % kHeads * 2 * C;
  }
};

float read_items(const std::string& mode, const char* base, const Layout& lay,
                 const std::vector<int>& order) {
  probe::LineWork acc;
  const size_t tiles = lay.L / kTile;
  const bool pf = mode == "items-prefetch" || mode == "items-lockstep-prefetch";
  const bool lockstep = mode == "items-lockstep" || mode == "items-lockstep-prefetch";
  for (size_t i = 0; i < order.size(); ++i) {
    const int it = order[i];
    if (mode == "rows" || mode == "rows-regions") {
      if (it % kHeads) continue;  // the slot's first item stands for the whole slot
      for (int kv = 0; kv < 2; ++kv) {
        const char* first = kv ? lay.v(base, it) : lay.k(base, it);
        if (mode == "rows-regions") {
          acc.lines(first, kHeads * lay.L);
          continue;
        }
        for (size_t t = 0; t < tiles; ++t)
          for (size_t h = 0; h < kHeads; ++h) acc.lines(first + h * lay.C + t * kTile, kTile);
      }
      continue;
    }
    if (mode == "interleaved") {
      const char* r = lay.interleaved(base, it);
      for (size_t t = 0; t < 2 * tiles; ++t) acc.lines(r + t * kTile, kTile);
      continue;
    }
    const char *k = lay.k(base, it), *v = lay.v(base, it);
    const char* next_k = i + 1 < order.size() ? lay.k(base, order[i + 1]) : nullptr;
    if (mode == "items-ahead") {
      // Byte `o` of the item's stream: K, then V, then the next item's K.
      auto at = [&](size_t o) -> const char* {
        if (o < lay.L) return k + o;
        if (o < 2 * lay.L || !next_k) return v + std::min(o - lay.L, lay.L - kLine);
        return next_k + std::min(o - 2 * lay.L, lay.L - kLine);
      };
      for (size_t o = 0; o < 2 * lay.L; o += kLine) {
        _mm_prefetch(at(o + AHEAD), _MM_HINT_T0);
        acc.line(at(o));
      }
      continue;
    }
    if (lockstep) {
      for (size_t t = 0; t + 4 <= tiles; t += 4) {
        if (pf) for (size_t u = 0; u < 4; ++u) request(v + (t + u) * kTile);
        for (size_t o = 0; o < kTile; o += kLine)
          for (size_t u = 0; u < 4; ++u) acc.line(k + (t + u) * kTile + o);
      }
    } else {
      for (size_t t = 0; t < tiles; ++t) {
        if (pf) request(v + t * kTile);
        acc.lines(k + t * kTile, kTile);
      }
    }
    for (size_t t = 0; t < tiles; ++t) {
      if (pf && next_k) request(next_k + t * kTile);
      acc.lines(v + t * kTile, kTile);
    }
  }
  return acc.total();
}

float read_stream(const char* base) {
  probe::LineWork acc;
  acc.lines(base, kBytes);
  return acc.total();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODE [L_KIB C_KIB]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const std::vector<std::string> modes = {"stream", "items-prefetch", "items-demand",
                                          "items-lockstep", "items-lockstep-prefetch",
                                          "interleaved", "rows", "rows-regions", "items-ahead"};
  if (std::find(modes.begin(), modes.end(), mode) == modes.end()) {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  const Layout lay{(argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 80) << 10,
                   (argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 96) << 10};
  if (lay.L % (4 * kTile) || lay.C < lay.L) {
    std::fprintf(stderr, "L must be a multiple of 8 KiB and C >= L\n");
    return 2;
  }
  const std::vector<char*> buffers = probe::huge_buffers(kThreads, kBytes);
  const int items = static_cast<int>(kBytes / (2 * kHeads * lay.C) * kHeads);
  std::vector<int> order(items);
  for (int i = 0; i < items; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  if (mode == "rows" || mode == "rows-regions") {  // whole slots, in shuffled order
    std::vector<int> slots(items / kHeads);
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int>(i);
    std::shuffle(slots.begin(), slots.end(), std::mt19937(1));
    for (size_t i = 0; i < order.size(); ++i) order[i] = slots[i / kHeads] * kHeads + i % kHeads;
  }
  // Bytes each thread reads per round.
  const double useful = mode == "stream" ? double(kBytes) : double(items) * 2 * lay.L;
  float sink = 0;
  const double best = probe::best_rate(
      kThreads, useful,
      [&](int t) {
        return mode == "stream" ? read_stream(buffers[t])
                                : read_items(mode, buffers[t], lay, order);
      },
      sink);
  std::printf("WORK %d, %s, L %zu KiB, C %zu KiB: %.1f GB/s (best of 5)%s\n", WORK, mode.c_str(),
              lay.L >> 10, lay.C >> 10, best, sink == 1.0f ? " " : "");
  return 0;
}
