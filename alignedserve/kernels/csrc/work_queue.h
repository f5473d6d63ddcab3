// Work items pulled by the intra-op threads: the one scheduling rule of the attention kernels.
//
// each_thread_pulls(body) runs body(claim) once on each of at::get_num_threads() threads;
// claim() returns 0, 1, 2, ..., each index to exactly one thread, whichever asks first. The
// kernels number their items longest first, so a thread that finishes early takes the
// next-longest item (a dynamic longest-processing-time schedule). Which thread computes an item
// never changes its result: an item's arithmetic is fixed by the item alone (batch invariance).
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace alignedserve {

template <typename Body>
void each_thread_pulls(Body&& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    body([&next] { return next.fetch_add(1); });
  });
}

// Calls run(i) for each item index i < n that this thread claims.
template <typename Claim, typename Run>
void for_each_claimed(Claim&& claim, int64_t n, Run&& run) {
  for (int64_t i = claim(); i < n; i = claim()) run(i);
}

// Calls run(i, following) for each item index i < n that this thread claims, where `following`
// is the thread's next item (>= n: none), claimed before item i runs so that i's passes can
// prefetch it.
template <typename Claim, typename Run>
void for_each_claimed_ahead(Claim&& claim, int64_t n, Run&& run) {
  for (int64_t i = claim(); i < n;) {
    const int64_t following = claim();
    run(i, following);
    i = following;
  }
}

}  // namespace alignedserve
