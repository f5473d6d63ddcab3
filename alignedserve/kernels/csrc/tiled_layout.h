// The tiled layout of bf16 KV caches (alignedserve/kernels/kv_layout.py, which says why), in
// one place for the kernels that write or read it in place: the decode kernel (attention.cpp)
// and the prefill kernels. Within a kv head's [capacity, dim] plane:
//   K: blocks of kKeyBlock tokens, each stored [dim / 2 dim pairs][kKeyBlock tokens][2 dims];
//   V: pairs of tokens, each stored [dim][2 tokens].
// Element (t, d) of a plane sits key_row(t) + key_dim(d) (K) or value_row(t) + value_dim(d) (V)
// elements from the plane's start.
#pragma once

#include <cstdint>

namespace alignedserve::tiled {

constexpr int64_t kDim = 64;       // the head_dim the compiled kernels read tiled planes at
constexpr int64_t kKeyBlock = 16;  // tokens per K block (kv_layout.KEYS)

// Positions and dims are never negative: as unsigned, / and % by the block sizes compile to
// shifts and masks (the prefill kernels take these per key and per dim).
constexpr int64_t key_row(int64_t t, int64_t dim) {
  const auto u = static_cast<uint64_t>(t);
  return static_cast<int64_t>(u / kKeyBlock * (kKeyBlock * dim) + u % kKeyBlock * 2);
}
constexpr int64_t key_dim(int64_t d) {
  const auto u = static_cast<uint64_t>(d);
  return static_cast<int64_t>(u / 2 * (2 * kKeyBlock) + u % 2);
}
constexpr int64_t value_row(int64_t t, int64_t dim) {
  const auto u = static_cast<uint64_t>(t);
  return static_cast<int64_t>(u / 2 * (2 * dim) + u % 2);
}
constexpr int64_t value_dim(int64_t d) { return 2 * d; }

}  // namespace alignedserve::tiled
