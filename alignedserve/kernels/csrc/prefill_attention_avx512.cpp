// Prefill attention on AVX-512 CPUs without AMX (e.g. AMD Zen 4): the sibling of
// csrc/prefill_attention.cpp, built around `vdpbf16ps` (16 fp32 lanes, each += the dot product
// of one bf16 pair of each operand), or without AVX512-BF16 its AVX-512F equivalent
// (bf16_pairs.h: the same results but for denormals).
//
// Contract (checked in prefill_attention_avx512 below; the AMX kernel's non-tiled call):
//   q     : [T, H, D] bf16, heads dense within a token row (stride(0) free: a view of a fused
//           qkv projection); query i sits at absolute position start + i.
//   k, v  : [KVH, S, D] bf16 with S == start + T, token rows dense (stride(2) == 1,
//           stride(1) == D; stride(0) free, so a layer slice of a request's cache works);
//           or, `tiled`, a tiled cache's K and V planes (alignedserve/kernels/kv_layout.py)
//           holding at least start + T positions, capacity % 16 == 0 (stale data past
//           start + T is never used).
//   out   : [T, H, D] bf16 (contiguous) = softmax(scale * q.k) . v over keys 0..start+i of kv
//           head h / (H / KVH), i.e. SDPA with a bottom-right causal mask. Scores, softmax and
//           accumulators are fp32; the probabilities are rounded to bf16 for the P.V product,
//           as torch's CPU flash attention does.
//   D % 32 == 0, D <= 256, H % KVH == 0, scale > 0.
//
// Layout: as in the AMX kernel, each of 16 queries is one fp32 lane, so the online softmax
// (running max, sum, rescale) is lane-wise vector code with no horizontal reductions.
//   * Scores S^T = K . Q^T: Q^T is packed per work item into pairs of dims per query lane
//     ([D/2][16] words), and each key's pair of dims (2j, 2j+1) is broadcast straight from
//     the cache row, so K needs no repacking. A register block of up to 3 heads x 8 keys
//     (24 independent accumulators) shares each broadcast between the heads of a GQA group.
//   * Softmax: the block's max is taken while the scores are still in registers; the
//     exponentials (scale folded into the argument) are rounded to bf16 pairs of keys per
//     query lane: P^T.
//   * O^T += V^T . P^T: V is packed once per call into pairs of keys per dim ([S/2][D] words)
//     so that (V[2r][d], V[2r+1][d]) is one broadcast. A register block of up to 3 heads x 8
//     dims; the accumulators live in memory between key blocks.
//   * Without AVX512-BF16 (the avx512 path) every operand is widened to fp32 first (kWide
//     below): each vdpbf16ps step is then two FMAs broadcasting from memory, with nothing
//     split or broadcast through the FMA ports.
//   * A tiled cache is read in place (widened in its own layout without AVX512-BF16), with no
//     repacking per call: its V plane is that packed layout already, and its K plane keeps
//     each key's pair of dims as one word too (16 keys of a block side by side per pair), so
//     only the addressing of the broadcasts changes. Results
//     agree with the token-major call to rounding (a rare score moves by an fp32 ulp; the
//     cause was not found), so a caller sends all of a prompt's chunks the same way.
//
// Batch invariance: the output of the query at absolute position p depends only on q[p] and
// K/V[0..p], never on T, start, the thread count or the work split. Keys are taken in blocks
// aligned to absolute positions (block b = keys [b*kB, (b+1)*kB)), always from block 0 in
// increasing order, and each lane's arithmetic (dot products in dim order, the block max,
// exponentials, sum chains, P.V in key order) is the same whoever shares its item or register
// block. A lane may see keys past its position (the rest of its block, later blocks when its
// item reaches into them): they get probability exactly +0 and never raise the max, so whether
// a chunk computes them or stops before them changes no result (the one exception would be an
// accumulator that is exactly -0, which + 0 * v turns into +0).
//
// Work item: (kv head, 16 consecutive queries of the chunk) with all H / KVH query heads of the
// group, so the group shares every K broadcast and V broadcast; when that leaves too few items
// for the threads, (query head, 16 queries). Items are pulled from an atomic counter kv head by kv
// head (one head's K and packed V stay in L2 while both threads sweep its query blocks), latest
// positions (most keys) first.
//
// Compiled in where the target has AVX-512 F, BW and VL (x86-64-v4, with or without
// avx512bf16); elsewhere prefill_attention_avx512_available() is false and the entry point
// raises.

// Narrow includes on purpose: <torch/extension.h> alone takes ~30 s to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "amx.h"  // exp2_nonpos, kMaskedScore (defined on every AVX-512 build)
#include "bf16_pairs.h"  // vdpbf16ps, or its AVX-512F equivalent (the avx512 path)
#include "checks.h"
#include "release_gil.h"
#include "tiled_layout.h"
#include "work_queue.h"

#if defined(ALIGNEDSERVE_AVX512)
#define ALIGNEDSERVE_PREFILL_AVX512 1
#endif

namespace alignedserve {
namespace {

#ifdef ALIGNEDSERVE_PREFILL_AVX512

constexpr int kQ = 16;     // query positions per item: one fp32 lane each
constexpr int kB = 128;    // keys per block, blocks aligned to absolute positions
constexpr int kStep = 16;  // the last block is cut after the 16 keys holding the item's last query
constexpr int kMaxBatch = 3;  // query heads per register block
// Widened operands (no AVX512-BF16: the avx512 path). There each vdpbf16ps is two FMAs
// (bf16_pairs.h), and the pair steps of block_scores / block_values also split one operand
// into its odd and even elements and broadcast the other's two from a general register, all
// on the FMA ports. So that build widens everything to fp32 first, once: K and V per call,
// element for element in their layouts (widen_kv), Q^T per item, P^T as the softmax writes
// it; each FMA then takes its broadcast straight from memory. The products and their order are the
// emulated steps' (odd element first), so the results are the same bits.
#if defined(__AVX512BF16__)
constexpr bool kWide = false;
#else
constexpr bool kWide = true;
#endif
constexpr int64_t kWidth = kWide ? 2 : 1;  // 32-bit words per pair element in Q^T and P^T
constexpr float kLog2e = 1.4426950408889634f;
// The softmax exponential and the masked score shared with the AMX kernels (amx.h): 2^x for
// x <= 0 with q(0) = 1 exactly, so the dominant probability of a row is exactly 1.
using amx::exp2_nonpos;
using amx::kMaskedScore;

// Lanes of cvtne2ps_pbh(b, a) (a0..a15, b0..b15) reordered to pairs (a0, b0, a1, b1, ...).
inline __m512i pair_interleave() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

struct Problem {
  const uint16_t* q;   // query i, head h at q + i * q_stride + h * D
  int64_t q_stride;
  const uint16_t* k;   // kv head g at k + g * k_hstride: token-major rows, or a tiled K plane
  int64_t k_hstride;
  const uint32_t* vp;  // kv head g at vp + g * v_hstride: (V[2r][d], V[2r+1][d]) at r * D + d,
  int64_t v_hstride;   //   zero past S (packed), or a tiled V plane (the same layout, not zeroed)
  uint16_t* out;       // [T, H, D]
  int64_t T, H, KVH, D, S, start, group;
  float scale_log2;
  bool tiled;          // k, vp are a tiled cache's planes (kv_layout.py)
  // Without AVX512-BF16 (kWide): K and V widened to fp32 in the layouts of k and vp (widen_kv),
  // kv head g at kw + g * kw_hstride / vw + g * vw_hstride; else null.
  const float* kw;
  int64_t kw_hstride;
  const float* vw;
  int64_t vw_hstride;
};

// Per-thread buffers, 64-byte aligned: per-head state for a whole GQA group, block buffers for
// one batch of heads.
struct Scratch {
  std::vector<uint32_t> raw;
  uint32_t* qt;     // [group][D/2][16]: Q^T, bf16 pairs of dims per query lane (kWide:
                    //   [group][D/2][2][16] floats, dim 2j + 1's lanes, then dim 2j's)
  float* s;         // [kMaxBatch][kB][16]: one block's raw scores per head of the batch
  uint32_t* p;      // [kMaxBatch][kB/2][16]: P^T, bf16 pairs of keys per query lane (kWide:
                    //   [kMaxBatch][kB/2][2][16] floats, key 2r + 1's, then key 2r's)
  float* acc;       // [group][D][16]: O^T accumulators
  float* m;         // [group][16]: running max (log2 domain, scaled)
  float* l;         // [group][16]: running sum
  uint16_t* kpad;   // [kStep][D]: the last keys of the cache, zero past S (token-major)
  uint32_t* vpad;   // [kStep / 2][D]: the last value pairs of a tiled plane, zero past S
  uint32_t* pairs;  // [D/2][16]: one head's output, bf16 pairs of dims per query lane

  explicit Scratch(const Problem& P) {
    const int64_t G = P.group, D = P.D;
    // Q^T and P^T take twice the words where they are widened to fp32 (kWide).
    const int64_t words = kWidth * G * (D / 2) * 16 + kMaxBatch * kB * 16 +
                          kWidth * kMaxBatch * (kB / 2) * 16 + G * D * 16 + 2 * G * 16 +
                          2 * (kStep * D / 2) + (D / 2) * 16 + 9 * 16;
    raw.assign(words + 16, 0u);
    auto* base = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63});
    auto take = [&base](int64_t n) {  // keep every buffer 64-byte aligned
      uint32_t* r = base;
      base += (n + 15) / 16 * 16;
      return r;
    };
    qt = take(kWidth * G * (D / 2) * 16);
    s = reinterpret_cast<float*>(take(kMaxBatch * kB * 16));
    p = take(kWidth * kMaxBatch * (kB / 2) * 16);
    acc = reinterpret_cast<float*>(take(G * D * 16));
    m = reinterpret_cast<float*>(take(G * 16));
    l = reinterpret_cast<float*>(take(G * 16));
    kpad = reinterpret_cast<uint16_t*>(take(kStep * D / 2));
    vpad = take(kStep * D / 2);
    pairs = take((D / 2) * 16);
  }
};

// Work item: kv head g, the chunk's queries [qb * 16, qb * 16 + 16) (lanes past T are zero
// padding), query heads [h_lo, h_lo + h_n) of the group.
struct Item {
  int64_t g, qb;
  int h_lo, h_n;
};

// Q^T of head `head` for the chunk's queries i0 .. i0 + nq - 1 (lanes 0 .. nq - 1); other lanes
// are 0.
// kWide: each pair as two fp32 rows of lanes, the odd dim's first (Scratch::qt).
void pack_queries(const Problem& P, int64_t i0, int nq, int64_t head, uint32_t* qt) {
  const int64_t words = P.D / 2;
  std::memset(qt, 0, kWidth * words * 16 * 4);
  for (int lane = 0; lane < nq; ++lane) {
    const uint16_t* row = P.q + (i0 + lane) * P.q_stride + head * P.D;
    for (int64_t j = 0; j < words; ++j) {
      uint32_t w;
      std::memcpy(&w, row + 2 * j, 4);
      if constexpr (kWide) {  // bf16 -> fp32 is a 16-bit shift
        qt[(2 * j) * 16 + lane] = w & 0xFFFF0000u;
        qt[(2 * j + 1) * 16 + lane] = w << 16;
      } else {
        qt[j * 16 + lane] = w;
      }
    }
  }
}

// In a tiled K block a key's dim pairs j and j + 1 are this many 32-bit words apart.
constexpr int64_t kKeyWordStride = tiled::key_dim(2) / 2;

// A score block's end: masked keys get kMaskedScore, the scores are stored, and the block's
// running max is taken while they are in registers.
template <int NH, int NK, bool kMask>
inline __attribute__((always_inline)) void finish_scores(__m512 (&acc)[NH][NK],
                                                         float* const* s, __m512i qpos,
                                                         int32_t key0, __m512* bmax) {
#pragma GCC unroll 16
  for (int kk = 0; kk < NK; ++kk) {
    __mmask16 future = 0;
    if (kMask) future = _mm512_cmplt_epi32_mask(qpos, _mm512_set1_epi32(key0 + kk));
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) {
      if (kMask) acc[h][kk] = _mm512_mask_mov_ps(acc[h][kk], future, _mm512_set1_ps(kMaskedScore));
      _mm512_store_ps(s[h] + kk * 16, acc[h][kk]);
    }
  }
  // The block's running max, taken here while the scores are in registers (four chains).
  // Max is exact, so its order cannot change a result.
#pragma GCC unroll 3
  for (int h = 0; h < NH; ++h) {
    __m512 mx[4] = {acc[h][0], acc[h][1], acc[h][2], acc[h][3]};
#pragma GCC unroll 16
    for (int kk = 4; kk < NK; ++kk) mx[kk % 4] = _mm512_max_ps(mx[kk % 4], acc[h][kk]);
    const __m512 chunk_max =
        _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    bmax[h] = _mm512_max_ps(bmax[h], chunk_max);
  }
}

// Raw scores of NK consecutive keys for NH heads: s[h] row kk = sum over dim pairs j of
// Q^T[j] . (K[kk][2j], K[kk][2j+1]). The pair (K[kk][2j], K[kk][2j+1]) is word kk * D/2 + j of
// `krows` (token-major rows) or, kTiled, word j * kKeyWordStride + kk (`krows` points at the
// first key's word in its block of tiled::kKeyBlock tokens; the NK keys never cross a block).
// kMask: keys after a lane's position get kMaskedScore.
template <int NH, int NK, bool kMask, bool kTiled>
inline void block_scores(const uint32_t* const* qt, const uint16_t* krows, int64_t D,
                         float* const* s, __m512i qpos, int32_t key0, __m512* bmax) {
  __m512 acc[NH][NK];
#pragma GCC unroll 24
  for (int i = 0; i < NH * NK; ++i) acc[i / NK][i % NK] = _mm512_setzero_ps();
  const auto* kw = reinterpret_cast<const uint32_t*>(krows);
  const int64_t words = D / 2;
  for (int64_t j = 0; j < words; ++j) {
    bf16::Pairs qv[NH];
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) qv[h] = bf16::to_pairs(_mm512_load_si512(qt[h] + j * 16));
#pragma GCC unroll 16
    for (int kk = 0; kk < NK; ++kk) {
      const uint32_t word = kTiled ? kw[j * kKeyWordStride + kk] : kw[kk * words + j];
#pragma GCC unroll 3
      for (int h = 0; h < NH; ++h) acc[h][kk] = bf16::dot_word(acc[h][kk], qv[h], word);
    }
  }
  finish_scores<NH, NK, kMask>(acc, s, qpos, key0, bmax);
}

// Online softmax over the first n (a multiple of 16) score rows of one head's block, whose max
// over raw scores is raw_max. Writes P^T in bf16 pairs; updates the running max m and sum l.
// Returns true when some lane's max rose: the caller must then scale that head's accumulators
// by corr (2^(old - new max), exactly 1 in the lanes that did not move). The max is taken over
// raw scores (scale > 0 keeps the order) and the scale is folded into the exponent's FMA. Two
// sum chains keep the dependencies short; their shape is fixed, and rows past n would only add
// +0. The max is always exact, never a stale upper guess: the dominant probability is then 1
// and survives the bf16 rounding of P.
inline bool softmax_rows(const float* s, int n, __m512 raw_max, float* m, float* l, uint32_t* p,
                         __m512& corr, float scale_log2) {
  const __m512 scale = _mm512_set1_ps(scale_log2);
  const __m512 old_max = _mm512_load_ps(m);
  const __m512 block_max = _mm512_mul_ps(raw_max, scale);
  const __mmask16 moved = _mm512_cmp_ps_mask(block_max, old_max, _CMP_GT_OQ);
  const __m512 new_max = _mm512_mask_mov_ps(old_max, moved, block_max);
  const __m512i perm = pair_interleave();
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int r = 0; r < n / 2; r += 2) {
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      const float* row = s + 2 * (r + u) * 16;
      const __m512 p0 = exp2_nonpos(_mm512_fmsub_ps(_mm512_load_ps(row), scale, new_max));
      const __m512 p1 = exp2_nonpos(_mm512_fmsub_ps(_mm512_load_ps(row + 16), scale, new_max));
      sum[u] = _mm512_add_ps(sum[u], _mm512_add_ps(p0, p1));
      if constexpr (kWide) {  // key 2(r + u) + 1's lanes, then 2(r + u)'s, as fp32
        auto widened = [](__m512 x) {  // rounded to bf16 as the pair form is, widened back
          return _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16::round16(x)), 16));
        };
        float* pw = reinterpret_cast<float*>(p) + (r + u) * 32;
        _mm512_store_ps(pw, widened(p1));
        _mm512_store_ps(pw + 16, widened(p0));
      } else {
        const __m512i both = bf16::round32(p1, p0);
        _mm512_store_si512(p + (r + u) * 16, _mm512_permutexvar_epi16(perm, both));
      }
    }
  }
  __m512 l_old = _mm512_load_ps(l);
  if (moved) {
    // The old max is -inf before the first block: clamp so that 2^(-inf) is computed as 0.
    corr = exp2_nonpos(_mm512_max_ps(_mm512_sub_ps(old_max, new_max), _mm512_set1_ps(-150.0f)));
    l_old = _mm512_mul_ps(l_old, corr);
    _mm512_store_ps(m, new_max);
  }
  _mm512_store_ps(l, _mm512_add_ps(l_old, _mm512_add_ps(sum[0], sum[1])));
  return moved != 0;
}

// O^T += V^T . P^T over npairs key pairs for NH heads (P^T of head j at p + j * kPStride,
// accumulators at acc + j * D * 16), ND dims at a time in registers.
constexpr int64_t kPStride = (kB / 2) * 16;
template <int NH, int ND>
inline void block_values(const uint32_t* p, int npairs, const uint32_t* vp, int64_t D, float* acc) {
  const int64_t acc_stride = D * 16;
  for (int64_t d0 = 0; d0 < D; d0 += ND) {
    float* a_base = acc + d0 * 16;
    __m512 a[NH][ND];
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 16
      for (int dd = 0; dd < ND; ++dd) a[h][dd] = _mm512_load_ps(a_base + h * acc_stride + dd * 16);
    }
    const uint32_t* vrow = vp + d0;
    const uint32_t* prow = p;
    for (int r = 0; r < npairs; ++r, vrow += D, prow += 16) {
      bf16::Pairs pv[NH];
#pragma GCC unroll 3
      for (int h = 0; h < NH; ++h) pv[h] = bf16::to_pairs(_mm512_load_si512(prow + h * kPStride));
#pragma GCC unroll 16
      for (int dd = 0; dd < ND; ++dd) {
#pragma GCC unroll 3
        for (int h = 0; h < NH; ++h) a[h][dd] = bf16::dot_word(a[h][dd], pv[h], vrow[dd]);
      }
    }
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 16
      for (int dd = 0; dd < ND; ++dd) _mm512_store_ps(a_base + h * acc_stride + dd * 16, a[h][dd]);
    }
  }
}

// block_scores on widened operands (kWide): Q^T as fp32 rows (odd dim's lanes, then even's)
// and K widened element for element from the cache's layout, so K[kk][d] is element
// kk * D + d of `krows` (token-major) or, kTiled, kk * 2 + tiled::key_dim(d). Same products,
// same order.
template <int NH, int NK, bool kMask, bool kTiled>
inline void wide_block_scores(const uint32_t* const* qt, const float* krows, int64_t D,
                              float* const* s, __m512i qpos, int32_t key0, __m512* bmax) {
  __m512 acc[NH][NK];
#pragma GCC unroll 24
  for (int i = 0; i < NH * NK; ++i) acc[i / NK][i % NK] = _mm512_setzero_ps();
  const int64_t words = D / 2;
  for (int64_t j = 0; j < words; ++j) {
#pragma GCC unroll 2
    for (int e = 1; e >= 0; --e) {  // dim 2j + 1, then 2j
      __m512 qv[NH];
#pragma GCC unroll 3
      for (int h = 0; h < NH; ++h) {
        qv[h] = _mm512_load_ps(reinterpret_cast<const float*>(qt[h]) + (2 * j + 1 - e) * 16);
      }
#pragma GCC unroll 16
      for (int kk = 0; kk < NK; ++kk) {
        const int64_t d = 2 * j + e;
        const __m512 kv = _mm512_set1_ps(krows[kTiled ? kk * 2 + tiled::key_dim(d) : kk * D + d]);
#pragma GCC unroll 3
        for (int h = 0; h < NH; ++h) acc[h][kk] = _mm512_fmadd_ps(qv[h], kv, acc[h][kk]);
      }
    }
  }
  finish_scores<NH, NK, kMask>(acc, s, qpos, key0, bmax);
}

// block_values on widened operands (kWide): P^T as fp32 rows (key 2r + 1's lanes, then
// 2r's) and V as fp32 pairs from `vrows` (pair r, dim d: V[2r][d], V[2r + 1][d] at
// vrows + (r * D + d) * 2, the tiled V layout widened). Same products, same order.
template <int NH, int ND>
inline void wide_block_values(const uint32_t* p, int npairs, const float* vrows, int64_t D,
                              float* acc) {
  const int64_t acc_stride = D * 16;
  const auto* pf = reinterpret_cast<const float*>(p);
  for (int64_t d0 = 0; d0 < D; d0 += ND) {
    float* a_base = acc + d0 * 16;
    __m512 a[NH][ND];
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 16
      for (int dd = 0; dd < ND; ++dd) a[h][dd] = _mm512_load_ps(a_base + h * acc_stride + dd * 16);
    }
    for (int r = 0; r < npairs; ++r) {
      const float* vrow = vrows + (r * D + d0) * 2;
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {  // key 2r + 1, then 2r
        __m512 pv[NH];
#pragma GCC unroll 3
        for (int h = 0; h < NH; ++h) pv[h] = _mm512_load_ps(pf + h * 2 * kPStride + (2 * r + e) * 16);
#pragma GCC unroll 16
        for (int dd = 0; dd < ND; ++dd) {
          const __m512 vv = _mm512_set1_ps(vrow[2 * dd + 1 - e]);
#pragma GCC unroll 3
          for (int h = 0; h < NH; ++h) a[h][dd] = _mm512_fmadd_ps(pv[h], vv, a[h][dd]);
        }
      }
    }
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 16
      for (int dd = 0; dd < ND; ++dd) _mm512_store_ps(a_base + h * acc_stride + dd * 16, a[h][dd]);
    }
  }
}

// One kv head's keys and values as the kernel reads them: the cache's (k: token-major rows or
// a tiled K plane; v: value pairs), and where widened (kWide) the fp32 copies.
struct Head {
  const uint16_t* k;
  const uint32_t* v;
  const float* kw;
  const float* vw;
};

// One key block [t0, t0 + n) for the NH heads h0 .. h0 + NH - 1 (indices within the group).
// Keys and value pairs from pad_from on come from the scratch's zero-padded copies.
template <int NH, bool kTiled>
void run_block(const Problem& P, Scratch& sc, const Head& head, int h0, int64_t t0, int n,
               int64_t pad_from, bool mask, __m512i qpos) {
  // Keys per score block: 8 whatever NH (16 broadcast streams for a lone head were slower).
  constexpr int NK = 8;
  constexpr int ND = NH == 1 ? 16 : 8;
  const int64_t D = P.D;
  const uint32_t* qt[NH];
  float* s[NH];
  for (int j = 0; j < NH; ++j) {
    qt[j] = sc.qt + (h0 + j) * kWidth * (D / 2) * 16;
    s[j] = sc.s + j * kB * 16;
  }
  __m512 bmax[NH];
  for (int j = 0; j < NH; ++j) bmax[j] = _mm512_set1_ps(kMaskedScore);
  for (int c = 0; c < n; c += NK) {
    const int64_t key = t0 + c;
    float* sc_rows[NH];
    for (int j = 0; j < NH; ++j) sc_rows[j] = s[j] + c * 16;
    if constexpr (kWide) {  // widened K holds whole 16-key blocks: no padded copy needed
      const float* krows = head.kw + (kTiled ? tiled::key_row(key, D) : key * D);
      if (mask) {
        wide_block_scores<NH, NK, true, kTiled>(qt, krows, D, sc_rows, qpos,
                                                static_cast<int32_t>(key), bmax);
      } else {
        wide_block_scores<NH, NK, false, kTiled>(qt, krows, D, sc_rows, qpos,
                                                 static_cast<int32_t>(key), bmax);
      }
      continue;
    }
    // Token-major keys from pad_from on are read from the zero-padded copy of the cache's
    // last rows. A tiled plane is read as it is up to the end of the block holding S - 1: its
    // keys from S on are in every lane's future (masked), or only lanes past T see them.
    const uint16_t* krows =
        kTiled ? head.k + tiled::key_row(key, D)
               : (key >= pad_from ? sc.kpad + (key - pad_from) * D : head.k + key * D);
    if (mask) {
      block_scores<NH, NK, true, kTiled>(qt, krows, D, sc_rows, qpos, static_cast<int32_t>(key),
                                         bmax);
    } else {
      block_scores<NH, NK, false, kTiled>(qt, krows, D, sc_rows, qpos,
                                          static_cast<int32_t>(key), bmax);
    }
  }
  for (int j = 0; j < NH; ++j) {
    __m512 corr;
    if (softmax_rows(s[j], n, bmax[j], sc.m + (h0 + j) * 16, sc.l + (h0 + j) * 16,
                     sc.p + j * kWidth * kPStride, corr, P.scale_log2)) {
      // A separate pass: keeping the factors live through block_values would spill its
      // register block.
      float* acc = sc.acc + (h0 + j) * D * 16;
      for (int64_t d = 0; d < D; ++d) {
        _mm512_store_ps(acc + d * 16, _mm512_mul_ps(_mm512_load_ps(acc + d * 16), corr));
      }
    }
  }
  if constexpr (kWide) {  // widened V is zero past S
    wide_block_values<NH, ND>(sc.p, n / 2, head.vw + t0 * D, D, sc.acc + h0 * D * 16);
    return;
  }
  // A tiled plane's value pairs from pad_from on come from the zero-padded copy (a key past S
  // has probability +0, but 0 * a stale inf would be NaN). Two calls sum in the same order.
  const int plane_pairs = kTiled ? static_cast<int>(std::min<int64_t>(n, pad_from - t0)) / 2
                                 : n / 2;
  block_values<NH, ND>(sc.p, plane_pairs, head.v + (t0 / 2) * D, D, sc.acc + h0 * D * 16);
  if (plane_pairs < n / 2) {
    block_values<NH, ND>(sc.p + plane_pairs * 16, n / 2 - plane_pairs, sc.vpad, D,
                         sc.acc + h0 * D * 16);
  }
}

// out rows i0 .. i0 + nq - 1 of head `head` = O^T / l, rounded to bf16 (nearest even). Each
// pair of accumulator rows (dims d, d+1 over the lanes) becomes 16 bf16 pairs in `pairs`, and
// each query's output row gathers its D/2 words from that transpose.
void store_outputs(const Problem& P, const float* acc, const float* l, int64_t i0, int nq,
                   int64_t head, uint32_t* pairs) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(l));
  const __m512i perm = pair_interleave();
  for (int64_t d = 0; d < P.D; d += 2) {
    const __m512 lo_row = _mm512_mul_ps(_mm512_load_ps(acc + d * 16), inv);
    const __m512 hi_row = _mm512_mul_ps(_mm512_load_ps(acc + (d + 1) * 16), inv);
    const __m512i both = bf16::round32(hi_row, lo_row);
    _mm512_store_si512(pairs + d * 8, _mm512_permutexvar_epi16(perm, both));
  }
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  for (int lane = 0; lane < nq; ++lane) {
    auto* o = reinterpret_cast<int*>(P.out + ((i0 + lane) * P.H + head) * P.D);
    for (int64_t w = 0; w < P.D / 2; w += 16) {  // words w .. w+15 of the row
      const __m512i idx =
          _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(w * 16 + lane)));
      _mm512_storeu_si512(o + w, _mm512_i32gather_epi32(idx, pairs, 4));
    }
  }
}

// run_block for a batch of `size` heads (1 to kMaxBatch).
template <bool kTiled>
inline void run_sized(int size, const Problem& P, Scratch& sc, const Head& head, int h0,
                      int64_t t0, int n, int64_t pad_from, bool mask, __m512i qpos) {
  switch (size) {
    case 3: return run_block<3, kTiled>(P, sc, head, h0, t0, n, pad_from, mask, qpos);
    case 2: return run_block<2, kTiled>(P, sc, head, h0, t0, n, pad_from, mask, qpos);
    default: return run_block<1, kTiled>(P, sc, head, h0, t0, n, pad_from, mask, qpos);
  }
}

void run_item(const Problem& P, const Item& it, Scratch& sc) {
  const int64_t g = it.g, i0 = it.qb * kQ;
  const int h_lo = it.h_lo, h_n = it.h_n;
  const int64_t p0 = P.start + i0;  // absolute position of lane 0
  const int nq = static_cast<int>(std::min<int64_t>(kQ, P.T - i0));
  const int64_t p_max = p0 + nq - 1;
  const int64_t D = P.D;
  const __m512i qpos = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int32_t>(p0)),
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  for (int h = h_lo; h < h_lo + h_n; ++h) {
    pack_queries(P, i0, nq, g * P.group + h, sc.qt + h * kWidth * (D / 2) * 16);
    std::fill_n(sc.m + h * 16, 16, -std::numeric_limits<float>::infinity());
    std::fill_n(sc.l + h * 16, 16, 0.0f);
    std::fill_n(sc.acc + h * D * 16, D * 16, 0.0f);
  }
  const Head head{P.k + g * P.k_hstride, P.vp + g * P.v_hstride,
                  kWide ? P.kw + g * P.kw_hstride : nullptr,
                  kWide ? P.vw + g * P.vw_hstride : nullptr};
  const uint16_t* k_head = head.k;
  const uint32_t* v_head = head.v;
  // Blocks up to the one holding p_max; lanes whose position lies in an earlier block see the
  // later ones fully masked, which changes nothing for them (probabilities +0, max unmoved).
  // The last block stops after the 16 keys that hold p_max; keys from S on (at most the last
  // kStep) come from a zero-padded copy (token-major), value pairs of a tiled plane too.
  const int64_t b_last = p_max / kB;
  const int64_t t_end = (p_max + kStep) / kStep * kStep;
  int64_t pad_from = std::numeric_limits<int64_t>::max();
  if (!kWide && t_end > P.S) {  // (widened K and V are zero past S already)
    pad_from = t_end - kStep;
    const int64_t have = P.S - pad_from;
    if (P.tiled) {
      std::memcpy(sc.vpad, v_head + pad_from / 2 * D, kStep / 2 * D * 4);
      auto* halves = reinterpret_cast<uint16_t*>(sc.vpad);  // token 2r + i of pair r: half i
      for (int64_t t = have; t < kStep; ++t) {
        for (int64_t d = 0; d < D; ++d) halves[(t / 2 * D + d) * 2 + t % 2] = 0;
      }
    } else {
      std::memcpy(sc.kpad, k_head + pad_from * D, have * D * 2);
      std::memset(sc.kpad + have * D, 0, (kStep - have) * D * 2);
    }
  }
  // Head batches of at most kMaxBatch, as even as possible.
  const int batches = (h_n + kMaxBatch - 1) / kMaxBatch;
  for (int64_t b = 0; b <= b_last; ++b) {
    const int64_t t0 = b * kB;
    const int n = b == b_last ? static_cast<int>(t_end - t0) : kB;
    const bool mask = t0 + n - 1 > p0;  // some key is in some lane's future
    int done = 0;
    for (int bi = 0; bi < batches; ++bi) {
      const int size = (h_n - done + (batches - bi) - 1) / (batches - bi);
      const int batch = h_lo + done;
      if (P.tiled) {
        run_sized<true>(size, P, sc, head, batch, t0, n, pad_from, mask, qpos);
      } else {
        run_sized<false>(size, P, sc, head, batch, t0, n, pad_from, mask, qpos);
      }
      done += size;
    }
  }
  for (int h = h_lo; h < h_lo + h_n; ++h) {
    store_outputs(P, sc.acc + h * D * 16, sc.l + h * 16, i0, nq, g * P.group + h, sc.pairs);
  }
}

// V per kv head in pairs of keys per dim, [KVH][s_pad / 2][D] words, zero past S: the
// broadcast operand of O^T += V^T . P^T.
at::Tensor pack_values(const at::Tensor& v, int64_t s_pad) {
  const int64_t kvh = v.size(0), S = v.size(1), D = v.size(2);
  at::Tensor vp = at::empty({kvh, s_pad / 2, D}, v.options().dtype(at::kInt));
  const auto* src = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(vp.data_ptr());
  const int64_t hs = v.stride(0), pairs = s_pad / 2;
  constexpr int64_t kChunk = 64;  // pairs per task
  const int64_t chunks = (pairs + kChunk - 1) / kChunk;
  const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                       40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                       32, 0);
  at::parallel_for(0, kvh * chunks, 1, [&](int64_t task_lo, int64_t task_hi) {
    for (int64_t task = task_lo; task < task_hi; ++task) {
      const int64_t g = task / chunks, r0 = (task % chunks) * kChunk;
      const int64_t r1 = std::min(pairs, r0 + kChunk);
      for (int64_t r = r0; r < r1; ++r) {
        uint32_t* out = dst + (g * pairs + r) * D;
        const int64_t t = 2 * r;
        const uint16_t* a = src + g * hs + t * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __m256i ra = t < S ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d))
                                   : _mm256_setzero_si256();
          const __m256i rb = t + 1 < S
                                 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + D + d))
                                 : _mm256_setzero_si256();
          const __m512i both = _mm512_permutex2var_epi16(_mm512_castsi256_si512(ra), idx,
                                                         _mm512_castsi256_si512(rb));
          _mm512_storeu_si512(out + d, both);
        }
      }
    }
  });
  return vp;
}

// kWide: keys [0, s16) (s16 = S rounded up to 16) of every kv head's K, and their value
// pairs (`vp`: pack_values' words or a tiled V plane), widened to fp32 element for element,
// so K keeps its layout (token-major rows or tiled blocks) and V is [s16 / 2][D][2]. Token-
// major keys from S on become zero (the kernel reads whole 16-key blocks), and so do values
// from S on (a key past S has probability +0, but 0 * a stale inf would be NaN).
std::pair<at::Tensor, at::Tensor> widen_kv(const at::Tensor& k, const uint32_t* vp,
                                           int64_t v_hstride, int64_t S, bool tiled) {
  const int64_t kvh = k.size(0), D = k.size(2), s16 = (S + 15) / 16 * 16, blocks = s16 / 16;
  const auto opts = k.options().dtype(at::kFloat);
  at::Tensor kw = at::empty({kvh, s16, D}, opts), vw = at::empty({kvh, s16, D}, opts);
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(vp);
  float* kd = kw.data_ptr<float>();
  float* vd = vw.data_ptr<float>();
  const int64_t k_hs = k.stride(0), block = 16 * D;  // a 16-key block: 16 * D elements
  auto widen = [](const uint16_t* src, float* dst, int64_t n) {  // n % 16 == 0
    for (int64_t i = 0; i < n; i += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(
                                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
  };
  at::parallel_for(0, kvh * blocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t g = task / blocks, t0 = task % blocks * 16;
      float* kb = kd + (g * s16 + t0) * D;
      float* vb = vd + (g * s16 + t0) * D;
      const int64_t have = std::min<int64_t>(16, S - t0);  // keys of the block below S
      if (tiled || have == 16) {
        widen(ks + g * k_hs + t0 * D, kb, block);
      } else {  // the last token-major rows, then zeros
        widen(ks + g * k_hs + t0 * D, kb, have * D);
        std::fill(kb + have * D, kb + block, 0.0f);
      }
      widen(vs + 2 * (g * v_hstride) + t0 * D, vb, block);
      for (int64_t t = t0 + have; t < t0 + 16; ++t)
        for (int64_t d = 0; d < D; ++d) vb[tiled::value_row(t - t0, D) + tiled::value_dim(d)] = 0.0f;
    }
  });
  return {kw, vw};
}

#endif  // ALIGNEDSERVE_PREFILL_AVX512

bool prefill_avx512_available() {
#ifdef ALIGNEDSERVE_PREFILL_AVX512
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention_avx512(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    int64_t start, double scale, bool tiled) {
  TORCH_CHECK(prefill_avx512_available(),
              "prefill_attention_avx512: this build has no AVX-512 kernel");
  checks::prefill_inputs(q, k, v, start, scale, 32, "prefill_attention_avx512", tiled);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor out = at::empty({T, H, D}, q.options());
#ifdef ALIGNEDSERVE_PREFILL_AVX512
  if (T == 0) return out;
  const int64_t KVH = k.size(0), S = start + T;
  const int64_t s_pad = (S + kB - 1) / kB * kB;
  // A tiled V plane already stores pairs of keys per dim: the kernel reads it in place.
  const at::Tensor vp = tiled ? v : pack_values(v, s_pad);
  const int64_t v_hstride = tiled ? v.stride(0) / 2 : (s_pad / 2) * D;
  const int64_t group = H / KVH;
  const auto* v_pairs = reinterpret_cast<const uint32_t*>(vp.data_ptr());
  at::Tensor kw, vw;  // the widened copies (kWide), alive until the items are done
  if constexpr (kWide) std::tie(kw, vw) = widen_kv(k, v_pairs, v_hstride, S, tiled);
  Problem P{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0),
            reinterpret_cast<const uint16_t*>(k.data_ptr()), k.stride(0),
            v_pairs, v_hstride,
            reinterpret_cast<uint16_t*>(out.data_ptr()),
            T, H, KVH, D, S, start, group,
            static_cast<float>(scale) * kLog2e, tiled,
            kWide ? kw.data_ptr<float>() : nullptr, kWide ? kw.size(1) * D : 0,
            kWide ? vw.data_ptr<float>() : nullptr, kWide ? vw.size(1) * D : 0};
  const int64_t qb_count = (T + kQ - 1) / kQ;
  const int threads = at::get_num_threads();
  // Split the group's heads into separate items when whole-group items are too few to
  // balance the threads (small chunks).
  const int64_t parts = KVH * qb_count < 4 * threads ? group : 1;
  const int per_part = static_cast<int>(group / parts);
  const int64_t items = KVH * qb_count * parts;
  auto item_at = [&](int64_t i) {
    const int64_t g = i / (qb_count * parts), rest = i % (qb_count * parts);
    const int64_t qb = qb_count - 1 - rest / parts;  // most keys first
    return Item{g, qb, static_cast<int>((rest % parts) * per_part), per_part};
  };
  each_thread_pulls([&](auto claim) {
    Scratch scratch(P);
    for_each_claimed(claim, items, [&](int64_t i) { run_item(P, item_at(i), scratch); });
  });
#endif
  return out;
}

}  // namespace

void register_prefill_avx512(pybind11::module_& m) {
  using pybind11::arg;
  m.def("prefill_attention_avx512_available", &prefill_avx512_available,
        "True when this build has the AVX-512 prefill kernel.");
  m.def("prefill_attention_avx512", &prefill_attention_avx512, kReleaseGil,
        "Causal attention of q [T, H, D] (absolute positions start..start+T-1) over k/v "
        "[KVH, start+T, D] (bf16, AVX-512), or a tiled cache's planes (tiled: [KVH, "
        ">= start+T, D], kv_layout.py); batch-invariant.",
        arg("q"), arg("k"), arg("v"), arg("start"), arg("scale"), arg("tiled") = false);
}

}  // namespace alignedserve
