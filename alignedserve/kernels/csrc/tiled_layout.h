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

inline int64_t key_row(int64_t t, int64_t dim) {
  return t / kKeyBlock * (kKeyBlock * dim) + t % kKeyBlock * 2;
}
inline int64_t key_dim(int64_t d) { return d / 2 * (2 * kKeyBlock) + d % 2; }
inline int64_t value_row(int64_t t, int64_t dim) { return t / 2 * (2 * dim) + t % 2; }
inline int64_t value_dim(int64_t d) { return 2 * d; }

}  // namespace alignedserve::tiled
