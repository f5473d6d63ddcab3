// Prefill attention on AVX2 + FMA CPUs (x86-64-v3: no AVX-512, no bf16 dot product): the
// sibling of csrc/prefill_attention_avx512.cpp, in fp32 FMA on 8-lane ymm vectors.
//
// Contract (checked in prefill_attention_avx2 below; the same as the AVX512-BF16 kernel's):
//   q     : [T, H, D] bf16, heads dense within a token row (stride(0) free: a view of a fused
//           qkv projection); query i sits at absolute position start + i.
//   k, v  : [KVH, S, D] bf16 with S == start + T, token rows dense (stride(2) == 1,
//           stride(1) == D; stride(0) free, so a layer slice of a request's cache works),
//           or, `tiled`, a tiled cache's K and V planes (alignedserve/kernels/kv_layout.py;
//           D == 64, at least start + T positions, capacity % 16 == 0).
//   out   : [T, H, D] bf16 (contiguous) = softmax(scale * q.k) . v over keys 0..start+i of kv
//           head h / (H / KVH), i.e. SDPA with a bottom-right causal mask. Scores, softmax,
//           probabilities and accumulators are all fp32 (P is not rounded to bf16).
//   D % 8 == 0, D <= 256, H % KVH == 0, scale > 0.
//
// Layout: each query is one fp32 lane of a ymm "query vector" (8 consecutive queries of one
// head), so the online softmax (running max, sum, rescale) is lane-wise vector code with no
// horizontal reductions, as in the AVX-512 kernels.
//   * Addressing: element (t, d) of a plane is at row(t) + dim(d) (TokenRows, TiledKeys,
//     TiledValues below), so a tiled cache is read where it lies, as a token-major one is: each
//     key's row offset is taken once per register block, each dim's once per dim. Which
//     element a broadcast reads is all that changes, so both layouts give the same bits.
//   * bf16 -> fp32 widening: K and V are read in place from the cache. Each broadcast operand
//     is the 32-bit word starting at the wanted element, shifted left by 16: its high half, now
//     the fp32 with the same value (exact), is all that survives. K and V are never copied or
//     repacked (a widened copy would cost a pass over the cache per call, which small chunks
//     over long contexts do not amortise), at the price of one shift per broadcast.
//   * Scores S^T = K . Q^T: Q^T is packed per work item as [D][8] fp32 per query vector; each
//     key's dim is broadcast from its cache row. A register block holds NV query vectors x NK
//     keys (NV * NK = 12 accumulators; AVX2 has 16 ymm registers, the rest hold the operands
//     reused across the block).
//   * Softmax: the block's max is taken while the scores are in registers; the exponentials
//     (scale folded into the argument's FMA) overwrite the scores in place: P^T, fp32.
//   * O^T += V^T . P^T: each key's row of V is broadcast dim by dim against the P^T vectors, a
//     register block of NV query vectors x ND dims (NV * ND <= 12); the accumulators live in
//     memory between key blocks.
//
// Batch invariance: the output of the query at absolute position p depends only on q[p] and
// K/V[0..p], never on T, start, the thread count or the work split. Keys are taken in blocks
// aligned to absolute positions (block b = keys [b*kB, (b+1)*kB)), always from block 0 in
// increasing order, and each lane's arithmetic is the same whoever shares its item or register
// block: every score is one FMA chain in dim order, the block max is exact, the exponential is
// lane-wise, the block's two sum chains take rows by their index within the block, and each
// output accumulator is one FMA chain in key order (rescaled by 2^(old - new max) at block
// boundaries, exactly 1 in lanes whose max did not move). The register block shapes (which
// depend on how many heads an item holds) only group independent chains. A lane may see keys
// past its position (the rest of its last block, later blocks when its item reaches into
// them): they get probability exactly +0 and never raise the max, so whether a chunk computes
// them or stops before them changes no result (accumulators start at +0 and a sum that
// starts at +0 never becomes -0, so adding +0 * v is exact). GCC contracts a multiply and a
// later add into an FMA by default, possibly in one inlined copy and not another (there is
// one per register batch size), so wherever a product feeds a sum the code spells out the
// FMA (or uses none); builds for x86-64-v3 and v4 give bit-identical outputs.
//
// Work item: (kv head, up to 32 consecutive queries of the chunk = up to four query vectors
// per head) with all H / KVH query heads of the group, so the group shares every K and V row
// it reads; 16 queries, or (query head, 16 queries), when that leaves too few items for the
// threads (small chunks). The item's vectors are taken in register batches of up to four,
// position-major, and each batch stops at the key step holding its own last position. Items
// are pulled from an atomic counter kv head by kv head (one head's K and V stay in the caches
// while both threads sweep its query blocks), latest positions (most keys) first.
//
// Compiled in where the target has AVX2 and FMA (x86-64-v3, and the AVX-512 builds, which run
// their own kernels); elsewhere prefill_attention_avx2_available() is false and the entry
// point raises.

// Narrow includes on purpose: <torch/extension.h> alone takes ~30 s to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "release_gil.h"
#include "tiled_layout.h"
#include "work_queue.h"

#if defined(__AVX2__) && defined(__FMA__)
#define ALIGNEDSERVE_PREFILL_AVX2 1
#include <immintrin.h>
#endif

namespace alignedserve {
namespace {

#ifdef ALIGNEDSERVE_PREFILL_AVX2

constexpr int kL = 8;         // fp32 lanes per ymm: queries per query vector
constexpr int kMaxParts = 4;  // query vectors per head in an item: at most 32 queries
constexpr int kAcc = 12;      // accumulators per register block (of the 16 ymm registers)
constexpr int kMaxNV = 4;     // query vectors per register block
// Keys are processed in steps of kStep: every score register block (12 / NV keys for NV of
// 1..4 vectors) divides it. A register batch's last block is cut after the step holding its
// last query.
constexpr int kStep = 12;
constexpr int kB = 144;  // keys per block (a multiple of kStep), blocks aligned to positions
constexpr float kLog2e = 1.4426950408889634f;
// Raw score of a key in a query's future: finite (exp2_nonpos needs finite input) yet far
// below any real score, so it never wins the max and its probability is exactly +0.
constexpr float kMaskedScore = -1e30f;

// 2^x for finite x <= 0: 2^floor(x) * q(x - floor(x)), q a degree-4 polynomial fitted to 2^f
// on [0, 1) for relative error (q(0) = 1 exactly); 2^floor(x) is added to q's exponent
// field. Results below 2^-126 (including every masked score) are exactly +0.
inline __m256 exp2_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fl = _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, fl);
  __m256 q = _mm256_set1_ps(0.013426604680716991f);
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(0.05224260315299034f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(0.24128015339374542f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(0.6930448412895203f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(fl), 23);
  const __m256 r = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(q), e));
  return _mm256_and_ps(r, keep);
}

struct Problem {
  const uint16_t* q;  // query i, head h at q + i * q_stride + h * D
  int64_t q_stride;
  const uint16_t* k;  // kv head g, token t at k + g * k_hstride + t * D
  int64_t k_hstride;
  const uint16_t* v;  // likewise
  int64_t v_hstride;
  uint16_t* out;      // [T, H, D]
  int64_t T, H, KVH, D, S, start, group;
  float scale_log2;
};

// A register batch of an item: query vectors [first, first + size), whose lanes hold
// positions lo .. last.
struct Batch {
  int first, size;
  int64_t lo, last;
};

// Per-thread buffers, 32-byte aligned: per-vector state for a whole GQA group (up to four
// query vectors per head), score / probability rows for one register batch.
struct Scratch {
  std::unique_ptr<float[]> raw;  // not zeroed: every buffer is written before it is read
  std::vector<Batch> batches;
  float* qt;        // [4 * group][D][8]: Q^T per query vector, fp32
  float* s;         // [kMaxNV][kB][8]: one block's raw scores, then P^T in place
  float* acc;       // [4 * group][D][8]: O^T accumulators
  float* m;         // [4 * group][8]: running max (log2 domain, scaled)
  float* l;         // [4 * group][8]: running sum
  uint32_t* obuf;   // [D][8]: one vector's output, bf16 in the low half of each word
  __m256i* qpos;    // [4 * group]: absolute position of each lane of each query vector
  uint16_t* kpad;   // [kStep + 1][D]: an item's last step of K rows, zero past S
  uint16_t* vpad;   // [kStep + 1][D]: likewise for V

  explicit Scratch(const Problem& P) {
    const int64_t NV = kMaxParts * P.group, D = P.D;
    const int64_t sizes[] = {NV * D * kL, kMaxNV * kB * kL, NV * D * kL, NV * kL, NV * kL,
                             D * kL, NV * kL, (kStep + 1) * D / 2, (kStep + 1) * D / 2};
    int64_t words = kL;  // room to align the start
    for (int64_t n : sizes) words += (n + kL - 1) / kL * kL;
    raw.reset(new float[words]);
    auto* base = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(raw.get()) + 31) & ~uintptr_t{31});
    int next = 0;
    auto take = [&]() {  // the next buffer of `sizes`, 32-byte aligned
      float* r = base;
      base += (sizes[next++] + kL - 1) / kL * kL;
      return r;
    };
    qt = take();
    s = take();
    acc = take();
    m = take();
    l = take();
    obuf = reinterpret_cast<uint32_t*>(take());
    qpos = reinterpret_cast<__m256i*>(take());
    kpad = reinterpret_cast<uint16_t*>(take());
    vpad = reinterpret_cast<uint16_t*>(take());
    batches.resize((NV + kMaxNV - 1) / kMaxNV);
  }
};

// Work item: kv head g, the chunk's queries [i0, i0 + nq) (nq <= 32; lanes past them are
// zero padding), query heads [h_lo, h_lo + h_n) of the group.
struct Item {
  int64_t g, i0;
  int nq, h_lo, h_n;
};

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Where element (t, d) of a kv head's plane lives, as row(t) + dim(d) elements from its start.
struct TokenRows {  // token-major rows of D
  static int64_t row(int64_t t, int64_t D) { return t * D; }
  static int64_t dim(int64_t d) { return d; }
};
struct TiledKeys {  // a tiled K plane (tiled_layout.h)
  static int64_t row(int64_t t, int64_t D) { return tiled::key_row(t, D); }
  static int64_t dim(int64_t d) { return tiled::key_dim(d); }
};
struct TiledValues {  // a tiled V plane
  static int64_t row(int64_t t, int64_t D) { return tiled::value_row(t, D); }
  static int64_t dim(int64_t d) { return tiled::value_dim(d); }
};

// Q^T of head `head` for the chunk's queries i0 .. i0 + nq - 1 (lanes 0 .. nq - 1, nq <= 8);
// other lanes are 0.
void pack_queries(const Problem& P, int64_t i0, int nq, int64_t head, float* qt) {
  std::memset(qt, 0, P.D * kL * sizeof(float));
  for (int lane = 0; lane < nq; ++lane) {
    const uint16_t* row = P.q + (i0 + lane) * P.q_stride + head * P.D;
    for (int64_t d = 0; d < P.D; ++d) qt[d * kL + lane] = bf16_to_float(row[d]);
  }
}

// A float read through a pointer to bf16 storage: unaligned, may alias anything.
typedef float float_alias __attribute__((may_alias, aligned(2)));

// bf16 element x[0] as fp32 in all lanes: the 32-bit word (x[0], x[1]) broadcast, then shifted
// so that x[0] becomes the high half of an fp32 (exact). Reads one element past x: callers
// make sure a row is followed by another row or by padding.
__attribute__((always_inline)) inline __m256 bcast(const uint16_t* x) {
  const __m256 w = _mm256_broadcast_ss(reinterpret_cast<const float_alias*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(w), 16));
}

// Raw scores of NK consecutive keys (rows key .. key + NK - 1 of plane `k`, addressed by Rows)
// for NV query vectors: s[v] row kk = sum over dims d (in order, one FMA chain) of
// Q^T[v][d] * K[kk][d]. kMask: keys after a lane's position (key0 + kk) get kMaskedScore.
// Raises bmax[v] to the keys' max.
template <int NV, int NK, bool kMask, class Rows>
__attribute__((always_inline)) inline void block_scores(const float* const* qt,
                                                        const uint16_t* k, int64_t key,
                                                        int64_t D, float* const* s,
                                                        const __m256i* qpos, int32_t key0,
                                                        __m256* bmax) {
  const uint16_t* krow[NK];
#pragma GCC unroll 12
  for (int kk = 0; kk < NK; ++kk) krow[kk] = k + Rows::row(key + kk, D);
  __m256 acc[NV][NK];
#pragma GCC unroll 12
  for (int i = 0; i < NV * NK; ++i) acc[i / NK][i % NK] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const int64_t dd = Rows::dim(d);
    // Hold the smaller operand set in registers: NV * NK + min(NV, NK) + 1 <= 16.
    if constexpr (NV <= NK) {
      __m256 qv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) qv[v] = _mm256_load_ps(qt[v] + d * kL);
#pragma GCC unroll 12
      for (int kk = 0; kk < NK; ++kk) {
        const __m256 kb = bcast(krow[kk] + dd);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[v][kk] = _mm256_fmadd_ps(qv[v], kb, acc[v][kk]);
      }
    } else {
      __m256 kb[NK];
#pragma GCC unroll 12
      for (int kk = 0; kk < NK; ++kk) kb[kk] = bcast(krow[kk] + dd);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __m256 qv = _mm256_load_ps(qt[v] + d * kL);
#pragma GCC unroll 12
        for (int kk = 0; kk < NK; ++kk) acc[v][kk] = _mm256_fmadd_ps(qv, kb[kk], acc[v][kk]);
      }
    }
  }
#pragma GCC unroll 12
  for (int kk = 0; kk < NK; ++kk) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if constexpr (kMask) {
        const __m256i future = _mm256_cmpgt_epi32(_mm256_set1_epi32(key0 + kk), qpos[v]);
        acc[v][kk] = _mm256_blendv_ps(acc[v][kk], _mm256_set1_ps(kMaskedScore),
                                      _mm256_castsi256_ps(future));
      }
      _mm256_store_ps(s[v] + kk * kL, acc[v][kk]);
    }
  }
  // The keys' max, taken while the scores are in registers. Max is exact: its order cannot
  // change a result.
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    __m256 mx = acc[v][0];
#pragma GCC unroll 12
    for (int kk = 1; kk < NK; ++kk) mx = _mm256_max_ps(mx, acc[v][kk]);
    bmax[v] = _mm256_max_ps(bmax[v], mx);
  }
}

// Online softmax over the first n (a multiple of 4) score rows of one query vector's block,
// whose max over raw scores is raw_max. Overwrites the scores with P^T; updates the running
// max m and sum l. Returns true when some lane's max rose: the caller must then scale that
// vector's accumulators by corr (2^(old - new max), exactly 1 in the lanes that did not move).
// The max is taken over raw scores (scale > 0 keeps the order) and the scale is folded into
// the exponent's FMA. Two sum chains keep the dependencies short; their shape is fixed by the
// row index, and rows past n would only add +0.
inline bool softmax_rows(float* s, int n, __m256 raw_max, float* m, float* l, __m256& corr,
                         float scale_log2) {
  const __m256 scale = _mm256_set1_ps(scale_log2);
  const __m256 old_max = _mm256_load_ps(m);
  const __m256 block_max = _mm256_mul_ps(raw_max, scale);
  const __m256 up = _mm256_cmp_ps(block_max, old_max, _CMP_GT_OQ);
  const __m256 new_max = _mm256_blendv_ps(old_max, block_max, up);
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int r = 0; r < n; r += 4) {
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      float* row = s + (r + 2 * u) * kL;
      const __m256 p0 = exp2_nonpos(_mm256_fmsub_ps(_mm256_load_ps(row), scale, new_max));
      const __m256 p1 = exp2_nonpos(_mm256_fmsub_ps(_mm256_load_ps(row + kL), scale, new_max));
      _mm256_store_ps(row, p0);
      _mm256_store_ps(row + kL, p1);
      sum[u] = _mm256_add_ps(sum[u], _mm256_add_ps(p0, p1));
    }
  }
  const __m256 l_old = _mm256_load_ps(l);
  const __m256 l_block = _mm256_add_ps(sum[0], sum[1]);
  const bool moved = _mm256_movemask_ps(up) != 0;
  if (moved) {
    // The old max is -inf before the first block: clamp so that 2^(-inf) is computed as 0.
    corr = exp2_nonpos(_mm256_max_ps(_mm256_sub_ps(old_max, new_max), _mm256_set1_ps(-150.0f)));
    // One explicit FMA (exactly l_old + l_block where corr is 1): a separate multiply and add
    // would leave GCC (which contracts across statements by default) free to fuse them in
    // some inlined copies and not others, and then a lane's sum would depend on the register
    // batch its vector landed in.
    _mm256_store_ps(l, _mm256_fmadd_ps(l_old, corr, l_block));
    _mm256_store_ps(m, new_max);
  } else {
    _mm256_store_ps(l, _mm256_add_ps(l_old, l_block));
  }
  return moved;
}

// O^T[v][d0 .. d0 + ND) += sum over the block's n keys (in order) of P^T[v][kk] * V[kk][d] for
// NV query vectors (P^T rows at p[v], accumulators at acc[v]); the keys are rows t0 .. of
// `plane`, addressed by Rows.
template <int NV, int ND, class Rows>
__attribute__((always_inline)) inline void block_values(const float* const* p, int n,
                                                        const uint16_t* plane, int64_t t0,
                                                        int64_t D, int64_t d0,
                                                        float* const* acc) {
  __m256 a[NV][ND];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
#pragma GCC unroll 12
    for (int dd = 0; dd < ND; ++dd) a[v][dd] = _mm256_load_ps(acc[v] + (d0 + dd) * kL);
  }
  for (int kk = 0; kk < n; ++kk) {
    const uint16_t* vrow = plane + Rows::row(t0 + kk, D);
    if constexpr (NV <= ND) {
      __m256 pv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) pv[v] = _mm256_load_ps(p[v] + kk * kL);
#pragma GCC unroll 12
      for (int dd = 0; dd < ND; ++dd) {
        const __m256 vb = bcast(vrow + Rows::dim(d0 + dd));
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) a[v][dd] = _mm256_fmadd_ps(pv[v], vb, a[v][dd]);
      }
    } else {
      __m256 vb[ND];
#pragma GCC unroll 12
      for (int dd = 0; dd < ND; ++dd) vb[dd] = bcast(vrow + Rows::dim(d0 + dd));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __m256 pv = _mm256_load_ps(p[v] + kk * kL);
#pragma GCC unroll 12
        for (int dd = 0; dd < ND; ++dd) a[v][dd] = _mm256_fmadd_ps(pv, vb[dd], a[v][dd]);
      }
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
#pragma GCC unroll 12
    for (int dd = 0; dd < ND; ++dd) _mm256_store_ps(acc[v] + (d0 + dd) * kL, a[v][dd]);
  }
}

// All D dims of O^T for NV vectors over n keys: register blocks of 12 / NV dims, then the
// remainder in blocks of 8, 4, 2, 1 dims.
template <int NV, class Rows>
__attribute__((noinline)) void batch_values(const float* const* p, int n,
                                            const uint16_t* plane, int64_t t0, int64_t D,
                                            float* const* acc) {
  constexpr int ND = kAcc / NV;
  int64_t d0 = 0;
  for (; d0 + ND <= D; d0 += ND) block_values<NV, ND, Rows>(p, n, plane, t0, D, d0, acc);
  if constexpr (ND > 8) {
    if (D - d0 >= 8) { block_values<NV, 8, Rows>(p, n, plane, t0, D, d0, acc); d0 += 8; }
  }
  if constexpr (ND > 4) {
    if (D - d0 >= 4) { block_values<NV, 4, Rows>(p, n, plane, t0, D, d0, acc); d0 += 4; }
  }
  if constexpr (ND > 2) {
    if (D - d0 >= 2) { block_values<NV, 2, Rows>(p, n, plane, t0, D, d0, acc); d0 += 2; }
  }
  if constexpr (ND > 1) {
    if (D - d0 >= 1) { block_values<NV, 1, Rows>(p, n, plane, t0, D, d0, acc); d0 += 1; }
  }
}

// Raw scores of the block's n keys [t0, t0 + n) for NV query vectors, and their max per
// vector (keys from pad_from on are rows of kpad, token-major; the others of k_head, addressed
// by Rows). Not inlined, nor the P.V pass: compiled on their own, their register blocks keep
// every reused operand in the 16 registers (inlined into the item loop, GCC took some from
// memory in every FMA instead).
template <int NV, class Rows>
__attribute__((noinline)) void block_scores_all(const float* const* qt, const uint16_t* k_head,
                                                const uint16_t* kpad, int64_t pad_from, int64_t D,
                                                float* const* s, int64_t t0, int n, int64_t p0,
                                                const __m256i* qpos, __m256* bmax) {
  constexpr int NK = kAcc / NV;
  for (int j = 0; j < NV; ++j) bmax[j] = _mm256_set1_ps(kMaskedScore);
  for (int c = 0; c < n; c += NK) {
    const int64_t key = t0 + c;
    float* rows[NV];
    for (int j = 0; j < NV; ++j) rows[j] = s[j] + c * kL;
    const auto key0 = static_cast<int32_t>(key);
    if (key >= pad_from) {  // the padded copy (the mask leaves visible keys as they are)
      block_scores<NV, NK, true, TokenRows>(qt, kpad, key - pad_from, D, rows, qpos, key0,
                                            bmax);
    } else if (key + NK - 1 > p0) {  // some key is in some lane's future
      block_scores<NV, NK, true, Rows>(qt, k_head, key, D, rows, qpos, key0, bmax);
    } else {
      block_scores<NV, NK, false, Rows>(qt, k_head, key, D, rows, qpos, key0, bmax);
    }
  }
}

// One key block [t0, t0 + n) for the NV query vectors v0 .. v0 + NV - 1 of the item: scores,
// softmax, and the P.V update of their accumulators. p0: the item's first position (keys up to
// it are visible to every lane). Keys from pad_from on are rows of sc.kpad / sc.vpad, the
// others of the planes, addressed by KRows and VRows.
template <int NV, class KRows, class VRows>
void run_block(const Problem& P, Scratch& sc, const uint16_t* k_head, const uint16_t* v_head,
               int v0, int64_t t0, int n, int64_t p0, int64_t pad_from) {
  constexpr int NK = kAcc / NV;
  static_assert(kStep % NK == 0, "a register block of keys must divide the key step");
  const int64_t D = P.D;
  const float* qt[NV];
  float* s[NV];
  float* acc[NV];
  for (int j = 0; j < NV; ++j) {
    qt[j] = sc.qt + (v0 + j) * D * kL;
    s[j] = sc.s + j * kB * kL;
    acc[j] = sc.acc + (v0 + j) * D * kL;
  }
  __m256 bmax[NV];
  block_scores_all<NV, KRows>(qt, k_head, sc.kpad, pad_from, D, s, t0, n, p0, sc.qpos + v0,
                              bmax);
  for (int j = 0; j < NV; ++j) {
    __m256 corr;
    if (softmax_rows(s[j], n, bmax[j], sc.m + (v0 + j) * kL, sc.l + (v0 + j) * kL, corr,
                     P.scale_log2)) {
      float* a = acc[j];
      for (int64_t d = 0; d < D; ++d) {
        _mm256_store_ps(a + d * kL, _mm256_mul_ps(_mm256_load_ps(a + d * kL), corr));
      }
    }
  }
  // Keys from pad_from on come from the padded copy: the same chains, continued.
  const int n_direct = static_cast<int>(std::clamp<int64_t>(pad_from - t0, 0, n));
  if (n_direct > 0) batch_values<NV, VRows>(s, n_direct, v_head, t0, D, acc);
  if (n_direct < n) {
    const float* sp[NV];
    for (int j = 0; j < NV; ++j) sp[j] = s[j] + n_direct * kL;
    batch_values<NV, TokenRows>(sp, n - n_direct, sc.vpad, t0 + n_direct - pad_from, D, acc);
  }
}

// fp32 -> bf16 bits (low half of each lane), rounding to nearest even with NaN -> 0x7FC0:
// c10::BFloat16's conversion, so the output matches converting the fp32 result with torch.
inline __m256i to_bf16_bits(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
                       nan));
}

// out rows i0 .. i0 + nq - 1 (nq <= 8) of head `head` = O^T / l, rounded to bf16.
void store_outputs(const Problem& P, const float* acc, const float* l, int64_t i0, int nq,
                   int64_t head, uint32_t* obuf) {
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_load_ps(l));
  const int64_t D = P.D;
  for (int64_t d = 0; d < D; ++d) {
    const __m256 o = _mm256_mul_ps(_mm256_load_ps(acc + d * kL), inv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(obuf + d * kL), to_bf16_bits(o));
  }
  for (int lane = 0; lane < nq; ++lane) {
    uint16_t* o = P.out + ((i0 + lane) * P.H + head) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<uint16_t>(obuf[d * kL + lane]);
  }
}

// Rows [from, to) of a plane (addressed by Rows) into token-major rows at dst.
template <class Rows>
void copy_rows(const uint16_t* plane, int64_t from, int64_t to, int64_t D, uint16_t* dst) {
  if constexpr (std::is_same_v<Rows, TokenRows>) {  // already token-major: one block copy
    if (to > from) std::memcpy(dst, plane + from * D, (to - from) * D * 2);
  } else {
    for (int64_t t = from; t < to; ++t, dst += D) {
      const uint16_t* row = plane + Rows::row(t, D);
      for (int64_t d = 0; d < D; ++d) dst[d] = row[Rows::dim(d)];
    }
  }
}

template <class KRows, class VRows>
void run_item(const Problem& P, const Item& it, Scratch& sc) {
  const int64_t g = it.g, i0 = it.i0, D = P.D;
  const int nq = it.nq, h_lo = it.h_lo, h_n = it.h_n;
  const int64_t p0 = P.start + i0;  // absolute position of lane 0
  const int64_t p_max = p0 + nq - 1;
  // Query vectors, part-major: vector j holds queries i0 + (j / h_n) * 8 .. of head
  // h_lo + j % h_n, so that a register batch of consecutive vectors spans few positions.
  const int nparts = (nq + kL - 1) / kL;
  const int nv = nparts * h_n;
  for (int j = 0; j < nv; ++j) {
    const int part = j / h_n;
    const int64_t head = g * P.group + h_lo + j % h_n;
    pack_queries(P, i0 + part * kL, std::min(kL, nq - part * kL), head, sc.qt + j * D * kL);
    sc.qpos[j] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(p0 + part * kL)),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    std::fill_n(sc.m + j * kL, kL, -std::numeric_limits<float>::infinity());
    std::fill_n(sc.l + j * kL, kL, 0.0f);
    std::fill_n(sc.acc + j * D * kL, D * kL, 0.0f);
  }
  const uint16_t* k_head = P.k + g * P.k_hstride;
  const uint16_t* v_head = P.v + g * P.v_hstride;
  // Keys run up to t_end, after the kStep keys holding the last position (per register batch
  // below, the batch's last). When the item's last step reaches S (keys past S do not exist,
  // or in a tiled plane hold stale values, and the broadcasts of row S - 1 read one element
  // past it), it is read from a zero-padded token-major copy instead; any other row is
  // followed by a real one (in a tiled plane too: the element after any of a row's is one of
  // the rows up to the next, all below S).
  auto end_of = [](int64_t last) { return (last + kStep) / kStep * kStep; };
  const int64_t t_end = end_of(p_max);
  int64_t pad_from = std::numeric_limits<int64_t>::max();
  if (t_end >= P.S) {
    pad_from = t_end - kStep;
    const int64_t have = P.S - pad_from;
    copy_rows<KRows>(k_head, pad_from, P.S, D, sc.kpad);
    std::memset(sc.kpad + have * D, 0, (kStep + 1 - have) * D * 2);
    copy_rows<VRows>(v_head, pad_from, P.S, D, sc.vpad);
    std::memset(sc.vpad + have * D, 0, (kStep + 1 - have) * D * 2);
  }
  // Register batches of at most kMaxNV vectors, as even as possible. Each takes the blocks up
  // to the one holding its last position; lanes whose position lies in an earlier block see
  // the later ones fully masked, which changes nothing for them (probabilities +0, max
  // unmoved).
  const int batches = (nv + kMaxNV - 1) / kMaxNV;
  for (int bi = 0, done = 0; bi < batches; ++bi) {
    Batch& bt = sc.batches[bi];
    bt.first = done;
    bt.size = (nv - done + (batches - bi) - 1) / (batches - bi);
    done += bt.size;
    bt.lo = p0 + bt.first / h_n * kL;
    bt.last = std::min(p_max, p0 + (done - 1) / h_n * kL + kL - 1);
  }
  for (int64_t b = 0; b <= p_max / kB; ++b) {
    const int64_t t0 = b * kB;
    for (int bi = 0; bi < batches; ++bi) {
      const Batch& bt = sc.batches[bi];
      if (t0 > bt.last) continue;
      const int n = static_cast<int>(std::min<int64_t>(kB, end_of(bt.last) - t0));
      switch (bt.size) {
        case 4:
          run_block<4, KRows, VRows>(P, sc, k_head, v_head, bt.first, t0, n, bt.lo, pad_from);
          break;
        case 3:
          run_block<3, KRows, VRows>(P, sc, k_head, v_head, bt.first, t0, n, bt.lo, pad_from);
          break;
        case 2:
          run_block<2, KRows, VRows>(P, sc, k_head, v_head, bt.first, t0, n, bt.lo, pad_from);
          break;
        default:
          run_block<1, KRows, VRows>(P, sc, k_head, v_head, bt.first, t0, n, bt.lo, pad_from);
          break;
      }
    }
  }
  for (int j = 0; j < nv; ++j) {
    const int part = j / h_n;
    const int64_t head = g * P.group + h_lo + j % h_n;
    store_outputs(P, sc.acc + j * D * kL, sc.l + j * kL, i0 + part * kL,
                  std::min(kL, nq - part * kL), head, sc.obuf);
  }
}

#endif  // ALIGNEDSERVE_PREFILL_AVX2

bool prefill_avx2_available() {
#ifdef ALIGNEDSERVE_PREFILL_AVX2
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention_avx2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t start, double scale, bool tiled) {
  TORCH_CHECK(prefill_avx2_available(),
              "prefill_attention_avx2: this build has no AVX2 kernel");
  checks::prefill_inputs(q, k, v, start, scale, 8, "prefill_attention_avx2", tiled);
  TORCH_CHECK(!tiled || q.size(2) == tiled::kDim,
              "prefill_attention_avx2: tiled planes need head_dim ", tiled::kDim);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(0);
  const int64_t S = start + T;  // keys that exist (a tiled plane holds more rows)
  at::Tensor out = at::empty({T, H, D}, q.options());
#ifdef ALIGNEDSERVE_PREFILL_AVX2
  if (T == 0) return out;
  const int64_t group = H / KVH;
  Problem P{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0),
            reinterpret_cast<const uint16_t*>(k.data_ptr()), k.stride(0),
            reinterpret_cast<const uint16_t*>(v.data_ptr()), v.stride(0),
            reinterpret_cast<uint16_t*>(out.data_ptr()),
            T, H, KVH, D, S, start, group,
            static_cast<float>(scale) * kLog2e};
  const int threads = at::get_num_threads();
  // Items of 32 queries with the whole group (each K / V read serves the most FMAs) when
  // there are enough of them to balance the threads; else 16 queries, and when even those are
  // too few (small chunks), the group's heads as separate items.
  int64_t qi = kMaxParts * kL;
  while (qi > 16 && KVH * ((T + qi - 1) / qi) < 4 * threads) qi /= 2;
  const int64_t qb_count = (T + qi - 1) / qi;
  const int64_t splits = KVH * qb_count < 4 * threads ? group : 1;
  const int per_split = static_cast<int>(group / splits);
  const int64_t items = KVH * qb_count * splits;
  auto item_at = [&](int64_t i) {
    const int64_t g = i / (qb_count * splits), rest = i % (qb_count * splits);
    const int64_t qb = qb_count - 1 - rest / splits;  // most keys first
    return Item{g, qb * qi, static_cast<int>(std::min(qi, T - qb * qi)),
                static_cast<int>((rest % splits) * per_split), per_split};
  };
  each_thread_pulls([&](auto claim) {
    Scratch scratch(P);
    for_each_claimed(claim, items, [&](int64_t i) {
      if (tiled) {
        run_item<TiledKeys, TiledValues>(P, item_at(i), scratch);
      } else {
        run_item<TokenRows, TokenRows>(P, item_at(i), scratch);
      }
    });
  });
#endif
  return out;
}

}  // namespace

void register_prefill_avx2(pybind11::module_& m) {
  using pybind11::arg;
  m.def("prefill_attention_avx2_available", &prefill_avx2_available,
        "True when this build has the AVX2 + FMA prefill kernel.");
  m.def("prefill_attention_avx2", &prefill_attention_avx2, kReleaseGil,
        "Causal attention of q [T, H, D] (absolute positions start..start+T-1) over k/v "
        "[KVH, start+T, D], or a tiled cache's planes (tiled: [KVH, capacity, 64]) (bf16, "
        "AVX2 + FMA, fp32 arithmetic); batch-invariant.",
        arg("q"), arg("k"), arg("v"), arg("start"), arg("scale"), arg("tiled") = false);
}

}  // namespace alignedserve
