// Prefill attention on Intel AMX: a chunk of queries attends causally over a bf16 KV cache.
//
// Contract (checked in prefill_attention below):
//   q     : [T, H, D] bf16, heads dense within a token row (stride(0) free); query i sits at
//           absolute position start + i.
//   k, v  : [KVH, S, D] bf16 with S == start + T, token rows dense (stride(2) == 1,
//           stride(1) == D; stride(0) free, so a layer slice of a request's cache works).
//           With tiled = true they are instead the planes of a tiled cache
//           (alignedserve/kernels/kv_layout.py), [KVH, capacity >= S, D], capacity % 16 == 0;
//           K is then copied to token-major rows first (V is transposed either way).
//   out   : [T, H, D] bf16 = softmax(scale * q.k) . v over keys 0..start+i of kv head
//           h / (H / KVH). Scores, softmax and the accumulators are fp32; the probabilities are
//           rounded to bf16 for the P.V product, as torch's CPU flash attention does.
//   D % 32 == 0, D <= 256, H % KVH == 0.
//
// Layout: the kernel computes S^T = K . Q^T, so K rows load straight from the cache as AMX A
// tiles and each of the 16 query columns of a score tile is one fp32 lane; the online softmax
// (running max, sum, rescale) is then lane-wise vector code over token rows. P.V is computed as
// O^T = V^T . P^T: V is transposed once per call (zero-padded to whole 32-token blocks) and
// P^T is packed into the pair-interleaved ("VNNI") layout AMX takes for its B operand.
//
// Work item: (kv head, block of 16 query positions) with all H / KVH query heads of the group,
// so the group reuses each K/V block while it is hot. Items are pulled from an atomic counter,
// kv head by kv head (one head's K and V^T, up to ~1 MB each at 4K tokens, stay in L2 while
// both threads sweep its query blocks; cycling over the heads instead made long chunks
// memory-bound), latest positions (most keys) first.
//
// Built only where the compiler targets AMX-BF16 (-march=native on Sapphire Rapids and later);
// elsewhere amx::available() is false and callers use torch's SDPA.

// Narrow includes on purpose: <torch/extension.h> alone takes ~30 s to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"  // defines ALIGNEDSERVE_AMX where the build targets AMX-BF16
#include "checks.h"
#include "release_gil.h"
#include "tiled_layout.h"
#include "work_queue.h"

namespace alignedserve {
namespace {

#ifdef ALIGNEDSERVE_AMX

constexpr int kQ = 16;  // queries per tile: one fp32 lane each
constexpr int kT = 32;  // tokens per kv block: the bf16 depth of one AMX product
constexpr float kLog2e = 1.4426950408889634f;

// Tiles: amx::configure_tiles (eight of 16 rows x 64 bytes); block_scores and block_values say
// how they are used.

// Lanes of cvtne2ps_pbh(b, a) (a0..a15, b0..b15) reordered to pairs (a0, b0, a1, b1, ...).
inline __m512i pair_interleave() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

struct Problem {
  const uint16_t* q;   // query i, head h at q + i * q_stride + h * D
  int64_t q_stride;
  const uint16_t* k;   // head g, token t at k + g * k_hstride + t * D
  int64_t k_hstride;
  const uint16_t* vt;  // [KVH, D, s_pad]: V transposed, zero past S
  uint16_t* out;       // [T, H, D]
  int64_t T, H, KVH, D, S, start, s_pad, group;
  float scale_log2;
};

// Per-thread buffers (64-byte aligned for tile loads).
struct Scratch {
  std::vector<uint32_t> raw;
  uint32_t* qt;   // [group][D/32][16 rows][16 queries]: Q^T in pair layout (bf16 pairs)
  float* acc;     // [group][D][16]: O^T accumulators
  float* m;       // [group][16]: running max (log2 domain)
  float* l;       // [group][16]: running sum
  float* s;       // [3][32][16]: one block's scores, per head of a 3-head batch
  uint16_t* p;    // [3][16][32]: P^T pairs, per head of the batch
  uint16_t* kpad; // [32][D]: the last K block, zero past S
  uint32_t* pairs;  // [D/2][16]: one head's output, bf16 pairs of dims per query lane

  Scratch(const Problem& P) {
    const int64_t words = P.group * (P.D / 32) * 256 + P.group * P.D * 16 + 2 * P.group * 16 +
                          3 * kT * 16 + 3 * 256 + kT * P.D / 2 + P.D * 8 + 16 * 8;
    raw.assign(words + 16, 0u);
    auto* base = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63});
    auto take = [&base](int64_t n) {  // keep every buffer 64-byte aligned
      uint32_t* r = base;
      base += (n + 15) / 16 * 16;
      return r;
    };
    qt = take(P.group * (P.D / 32) * 256);
    acc = reinterpret_cast<float*>(take(P.group * P.D * 16));
    m = reinterpret_cast<float*>(take(P.group * 16));
    l = reinterpret_cast<float*>(take(P.group * 16));
    s = reinterpret_cast<float*>(take(3 * kT * 16));
    p = reinterpret_cast<uint16_t*>(take(3 * 256));
    kpad = reinterpret_cast<uint16_t*>(take(kT * P.D / 2));
    pairs = take(P.D * 8);
  }
};

// Q^T of query rows [i0, i0 + nq) of head `head`, as AMX B tiles (one per 32 dims): row r of
// part c holds, for every query lane, the bf16 pair of dims c*32 + 2r, +1. Missing lanes are 0.
void pack_queries(const Problem& P, int64_t i0, int64_t nq, int64_t head, uint32_t* qt) {
  const int64_t parts = P.D / 32;
  for (int64_t c = 0; c < parts; ++c) {
    uint32_t* tile = qt + c * 256;
    for (int64_t mq = 0; mq < kQ; ++mq) {
      const uint16_t* row = P.q + (i0 + mq) * P.q_stride + head * P.D + c * 32;
      for (int r = 0; r < 16; ++r) {
        uint32_t w = 0;
        if (mq < nq) std::memcpy(&w, row + 2 * r, 4);
        tile[r * 16 + mq] = w;
      }
    }
  }
}

// Online softmax over one block's 32 raw score rows of one head (lanes = queries). Writes P^T
// in pairs to p; returns true when some lane's running max rose, and then the caller must
// scale that head's accumulators by `corr` (2^(old max - new max), 1 in the other lanes);
// blocks that raise no max (most, once the first keys are seen) skip that pass. The max is
// taken over raw scores (scale > 0 keeps the order) and the scale is folded into the
// exponent's FMA, so the scores are read twice and written never (except masked ones). The
// max is always exact, never a stale upper guess: the dominant probability is then 1 and
// survives the bf16 rounding of P (a stale max with slack was faster, but doubled the
// error). The loops are unrolled so the max and sum chains stay in registers.
template <bool kMask>
inline bool softmax_block(float* s, float* m, float* l, uint16_t* p, __m512& corr, __m512i qpos,
                          int64_t t0, float scale_log2) {
  const __m512 scale = _mm512_set1_ps(scale_log2);
  __m512 mx[4];
#pragma GCC unroll 32
  for (int t = 0; t < kT; ++t) {
    __m512 x = _mm512_load_ps(s + t * 16);
    if (kMask) {  // key t0 + t is in the future of lanes whose position is smaller
      const __mmask16 future = _mm512_cmplt_epi32_mask(qpos, _mm512_set1_epi32(t0 + t));
      x = _mm512_mask_mov_ps(x, future, _mm512_set1_ps(amx::kMaskedScore));
      _mm512_store_ps(s + t * 16, x);
    }
    mx[t % 4] = t < 4 ? x : _mm512_max_ps(mx[t % 4], x);
  }
  const __m512 raw_max = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
  // The first block moves every lane off -inf (key 0 is no one's future); a lane whose keys
  // in this block are all masked never moves.
  const __m512 old_max = _mm512_load_ps(m);
  const __m512 block_max = _mm512_mul_ps(raw_max, scale);
  const __mmask16 moved = _mm512_cmp_ps_mask(block_max, old_max, _CMP_GT_OQ);
  const __m512 new_max = _mm512_mask_mov_ps(old_max, moved, block_max);
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
  for (int r = 0; r < kT / 2; ++r) {
    const __m512 p0 =
        amx::exp2_nonpos(_mm512_fmsub_ps(_mm512_load_ps(s + 2 * r * 16), scale, new_max));
    const __m512 p1 =
        amx::exp2_nonpos(_mm512_fmsub_ps(_mm512_load_ps(s + (2 * r + 1) * 16), scale, new_max));
    sum[r % 2] = _mm512_add_ps(sum[r % 2], _mm512_add_ps(p0, p1));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_store_si512(p + r * 32, _mm512_permutexvar_epi16(pair_interleave(), both));
  }
  __m512 l_old = _mm512_load_ps(l);
  if (moved) {
    // old max is -inf before the first block: clamp so that 2^(-inf) is computed as 2^-150 = 0
    corr = amx::exp2_nonpos(
        _mm512_max_ps(_mm512_sub_ps(old_max, new_max), _mm512_set1_ps(-150.0f)));
    l_old = _mm512_mul_ps(l_old, corr);
    _mm512_store_ps(m, new_max);
  }
  _mm512_store_ps(l, _mm512_add_ps(l_old, _mm512_add_ps(sum[0], sum[1])));
  return moved != 0;
}

// GCC's tile intrinsics are macros that paste the tile number into the instruction, so the
// numbers are literals and the helpers below unroll over up to 3 heads by hand.

// S^T (2 tiles per head: tokens 0-15 and 16-31 of the block) for HN heads of the group, K
// tile loaded once per (half, part) and shared by the heads. Tiles 0..2HN-1, 6 (Q^T), 7 (K).
template <int HN>
void block_scores(const Problem& P, const uint16_t* kb, const uint32_t* const* qt, float* const* s) {
  const int64_t parts = P.D / 32, k_stride = P.D * 2;
  _tile_zero(0); _tile_zero(1);
  if (HN > 1) { _tile_zero(2); _tile_zero(3); }
  if (HN > 2) { _tile_zero(4); _tile_zero(5); }
  for (int64_t c = 0; c < parts; ++c) {
    _tile_loadd(7, kb + c * 32, k_stride);  // tokens 0-15
    _tile_loadd(6, qt[0] + c * 256, 64);
    _tile_dpbf16ps(0, 7, 6);
    if (HN > 1) { _tile_loadd(6, qt[1] + c * 256, 64); _tile_dpbf16ps(2, 7, 6); }
    if (HN > 2) { _tile_loadd(6, qt[2] + c * 256, 64); _tile_dpbf16ps(4, 7, 6); }
    _tile_loadd(7, kb + 16 * P.D + c * 32, k_stride);  // tokens 16-31
    _tile_loadd(6, qt[0] + c * 256, 64);
    _tile_dpbf16ps(1, 7, 6);
    if (HN > 1) { _tile_loadd(6, qt[1] + c * 256, 64); _tile_dpbf16ps(3, 7, 6); }
    if (HN > 2) { _tile_loadd(6, qt[2] + c * 256, 64); _tile_dpbf16ps(5, 7, 6); }
  }
  _tile_stored(0, s[0], 64); _tile_stored(1, s[0] + 256, 64);
  if (HN > 1) { _tile_stored(2, s[1], 64); _tile_stored(3, s[1] + 256, 64); }
  if (HN > 2) { _tile_stored(4, s[2], 64); _tile_stored(5, s[2] + 256, 64); }
}

// O^T += V^T . P^T for HN heads, accumulators loaded into tiles 0..HN-1 and stored back per 16
// dims; V^T (tile 6) is loaded once per 16 dims and shared; P^T of head j sits in tile 3 + j.
template <int HN>
void block_values(const Problem& P, const uint16_t* vt_head, int64_t t0, const uint16_t* const* p,
                  float* const* acc) {
  _tile_loadd(3, p[0], 64);
  if (HN > 1) _tile_loadd(4, p[1], 64);
  if (HN > 2) _tile_loadd(5, p[2], 64);
  for (int64_t dt = 0; dt < P.D / 16; ++dt) {
    _tile_loadd(0, acc[0] + dt * 256, 64);
    if (HN > 1) _tile_loadd(1, acc[1] + dt * 256, 64);
    if (HN > 2) _tile_loadd(2, acc[2] + dt * 256, 64);
    _tile_loadd(6, vt_head + dt * 16 * P.s_pad + t0, P.s_pad * 2);
    _tile_dpbf16ps(0, 6, 3);
    if (HN > 1) _tile_dpbf16ps(1, 6, 4);
    if (HN > 2) _tile_dpbf16ps(2, 6, 5);
    _tile_stored(0, acc[0] + dt * 256, 64);
    if (HN > 1) _tile_stored(1, acc[1] + dt * 256, 64);
    if (HN > 2) _tile_stored(2, acc[2] + dt * 256, 64);
  }
}

inline void scale_rows(float* acc, int64_t rows, __m512 factor) {
  for (int64_t d = 0; d < rows; ++d) {
    _mm512_store_ps(acc + d * 16, _mm512_mul_ps(_mm512_load_ps(acc + d * 16), factor));
  }
}

// One block of 32 keys for heads h0 .. h0+HN-1 of the group.
template <int HN>
void run_block(const Problem& P, Scratch& sc, const uint16_t* kb, const uint16_t* vt_head,
               int64_t t0, int64_t h0, __m512i qpos, bool mask) {
  const int64_t parts = P.D / 32;
  const uint32_t* qt[3];
  float* s[3];
  const uint16_t* pp[3];
  float* acc[3];
  for (int j = 0; j < HN; ++j) {
    qt[j] = sc.qt + (h0 + j) * parts * 256;
    s[j] = sc.s + j * kT * 16;
    pp[j] = sc.p + j * kT * 16;
    acc[j] = sc.acc + (h0 + j) * P.D * 16;
  }
  block_scores<HN>(P, kb, qt, s);
  for (int j = 0; j < HN; ++j) {
    __m512 corr;
    float* m = sc.m + (h0 + j) * 16;
    float* l = sc.l + (h0 + j) * 16;
    uint16_t* pj = sc.p + j * kT * 16;
    const bool moved = mask ? softmax_block<true>(s[j], m, l, pj, corr, qpos, t0, P.scale_log2)
                            : softmax_block<false>(s[j], m, l, pj, corr, qpos, t0, P.scale_log2);
    if (moved) {
      scale_rows(acc[j], P.D, corr);
    }
  }
  block_values<HN>(P, vt_head, t0, pp, acc);
}

// out rows i0 .. i0+nq-1 of head `head` = O^T / l, rounded to bf16 (nearest even). Each pair
// of accumulator rows (dims d, d+1 over the 16 query lanes) becomes 16 bf16 pairs in `pairs`
// ([D/2][16] words), and each query's output row gathers its D/2 words from that transpose.
void store_outputs(const Problem& P, const float* acc, const float* l, int64_t i0, int64_t nq,
                   int64_t head, uint32_t* pairs) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(l));
  for (int64_t d = 0; d < P.D; d += 2) {
    const __m512 lo = _mm512_mul_ps(_mm512_load_ps(acc + d * 16), inv);
    const __m512 hi = _mm512_mul_ps(_mm512_load_ps(acc + (d + 1) * 16), inv);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    _mm512_store_si512(pairs + d * 8, _mm512_permutexvar_epi16(pair_interleave(), both));
  }
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                             5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t mq = 0; mq < nq; ++mq) {
    auto* o = reinterpret_cast<int*>(P.out + ((i0 + mq) * P.H + head) * P.D);
    for (int64_t w = 0; w < P.D / 2; w += 16) {  // words w .. w+15 of the row
      const __m512i idx = _mm512_add_epi32(column, _mm512_set1_epi32(w * 16 + mq));
      _mm512_storeu_si512(o + w, _mm512_i32gather_epi32(idx, pairs, 4));
    }
  }
}

void run_item(const Problem& P, int64_t g, int64_t qb, Scratch& sc) {
  const int64_t i0 = qb * kQ;
  const int64_t nq = std::min<int64_t>(kQ, P.T - i0);
  const int64_t p_first = P.start + i0, p_last = p_first + nq - 1;
  const int64_t parts = P.D / 32;
  alignas(64) int32_t pos[kQ];
  for (int mq = 0; mq < kQ; ++mq) {
    pos[mq] = static_cast<int32_t>(p_first + std::min<int64_t>(mq, nq - 1));  // pad lanes copy
  }
  const __m512i qpos = _mm512_load_si512(pos);
  for (int64_t h = 0; h < P.group; ++h) {
    pack_queries(P, i0, nq, g * P.group + h, sc.qt + h * parts * 256);
    std::fill_n(sc.m + h * 16, 16, -std::numeric_limits<float>::infinity());
    std::fill_n(sc.l + h * 16, 16, 0.0f);
  }
  std::fill_n(sc.acc, P.group * P.D * 16, 0.0f);
  const uint16_t* k_head = P.k + g * P.k_hstride;
  const uint16_t* vt_head = P.vt + g * P.D * P.s_pad;

  for (int64_t t0 = 0; t0 <= p_last; t0 += kT) {
    const uint16_t* kb = k_head + t0 * P.D;
    if (t0 + kT > P.S) {  // past the cache's valid rows: copy what exists, zero the rest
      const int64_t have = P.S - t0;
      std::memcpy(sc.kpad, kb, have * P.D * 2);
      std::memset(sc.kpad + have * P.D, 0, (kT - have) * P.D * 2);
      kb = sc.kpad;
    }
    const bool mask = t0 + kT - 1 > p_first;
    for (int64_t h0 = 0; h0 < P.group; h0 += 3) {
      switch (std::min<int64_t>(3, P.group - h0)) {
        case 3: run_block<3>(P, sc, kb, vt_head, t0, h0, qpos, mask); break;
        case 2: run_block<2>(P, sc, kb, vt_head, t0, h0, qpos, mask); break;
        default: run_block<1>(P, sc, kb, vt_head, t0, h0, qpos, mask); break;
      }
    }
  }
  for (int64_t h = 0; h < P.group; ++h) {
    store_outputs(P, sc.acc + h * P.D * 16, sc.l + h * 16, i0, nq, g * P.group + h, sc.pairs);
  }
}

// V^T per kv head, zero-padded to s_pad tokens: the A operand of O^T = V^T . P^T.
at::Tensor transpose_values(const at::Tensor& v, int64_t s_pad) {
  const int64_t kvh = v.size(0), S = v.size(1), D = v.size(2);
  at::Tensor vt = at::zeros({kvh, D, s_pad}, v.options());
  const auto* src = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(vt.data_ptr());
  const int64_t hs = v.stride(0), blocks = (S + kT - 1) / kT;
  at::parallel_for(0, kvh * blocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t g = i / blocks, t0 = (i % blocks) * kT, t1 = std::min(S, t0 + kT);
      for (int64_t d = 0; d < D; ++d) {
        uint16_t* row = dst + (g * D + d) * s_pad;
        for (int64_t t = t0; t < t1; ++t) row[t] = src[g * hs + t * D + d];
      }
    }
  });
  return vt;
}

// The same from a tiled cache's V plane (tiled_layout.h: token pairs stored [D][2]): V^T row
// d is the 32-bit word holding dim d of every pair, so whole pairs move at once.
at::Tensor transpose_values_tiled(const at::Tensor& v, int64_t S, int64_t s_pad) {
  const int64_t kvh = v.size(0), D = v.size(2), pairs = (S + 1) / 2;
  at::Tensor vt = at::zeros({kvh, D, s_pad}, v.options());
  const auto* src = reinterpret_cast<const uint32_t*>(v.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(vt.data_ptr());
  const int64_t hs = v.stride(0) / 2;  // in pairs of bf16
  at::parallel_for(0, kvh * D, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t g = i / D, d = i % D;
      uint32_t* row = dst + i * (s_pad / 2);
      // Word offsets are element offsets / 2: every row and dim offset of a pair is even.
      const uint32_t* dim = src + g * hs + tiled::value_dim(d) / 2;
      for (int64_t j = 0; j < pairs; ++j) row[j] = dim[tiled::value_row(2 * j, D) / 2];
    }
  });
  if (S % 2) {  // the last pair's second token lies past S: zero it
    auto* v16 = reinterpret_cast<uint16_t*>(vt.data_ptr());
    for (int64_t i = 0; i < kvh * D; ++i) v16[i * s_pad + S] = 0;
  }
  return vt;
}

// Token-major K rows [KVH, S, D] from a tiled cache's K plane (tiled_layout.h: blocks of
// kKeyBlock tokens stored [D/2][kKeyBlock][2]), for the A tiles of S^T = K . Q^T.
at::Tensor untile_keys(const at::Tensor& k, int64_t S) {
  const int64_t kvh = k.size(0), D = k.size(2);
  at::Tensor rows = at::empty({kvh, S, D}, k.options());
  const auto* src = reinterpret_cast<const uint32_t*>(k.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(rows.data_ptr());
  constexpr int64_t kBlock = tiled::kKeyBlock;
  const int64_t hs = k.stride(0) / 2, blocks = (S + kBlock - 1) / kBlock;
  at::parallel_for(0, kvh * blocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t g = i / blocks, t0 = (i % blocks) * kBlock, t1 = std::min(S, t0 + kBlock);
      for (int64_t t = t0; t < t1; ++t) {
        uint32_t* row = dst + (g * S + t) * (D / 2);
        // Word offsets are element offsets / 2: a key's row and its dim pairs' offsets are even.
        const uint32_t* key = src + g * hs + tiled::key_row(t, D) / 2;
        for (int64_t p = 0; p < D / 2; ++p) row[p] = key[tiled::key_dim(2 * p) / 2];
      }
    }
  });
  return rows;
}

#endif  // ALIGNEDSERVE_AMX

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v,
                             int64_t start, double scale, bool tiled) {
  TORCH_CHECK(amx::available(), "prefill_attention: AMX-BF16 is not available");
  checks::prefill_inputs(q, k_in, v, start, scale, 32, "prefill_attention", tiled);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor out = at::empty({T, H, D}, q.options());
#ifdef ALIGNEDSERVE_AMX
  if (T == 0) return out;
  const int64_t KVH = k_in.size(0);
  const int64_t S = start + T;  // keys attended; a tiled plane may hold more (whole blocks)
  const int64_t s_pad = (S + kT - 1) / kT * kT;
  const at::Tensor k = tiled ? untile_keys(k_in, S) : k_in;
  const at::Tensor vt = tiled ? transpose_values_tiled(v, S, s_pad) : transpose_values(v, s_pad);
  Problem P{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0),
            reinterpret_cast<const uint16_t*>(k.data_ptr()), k.stride(0),
            reinterpret_cast<const uint16_t*>(vt.data_ptr()),
            reinterpret_cast<uint16_t*>(out.data_ptr()),
            T, H, KVH, D, S, start, s_pad, H / KVH,
            static_cast<float>(scale) * kLog2e};
  const int64_t q_blocks = (T + kQ - 1) / kQ, items = q_blocks * KVH;
  each_thread_pulls([&](auto claim) {
    amx::configure_tiles();
    Scratch scratch(P);
    for_each_claimed(claim, items, [&](int64_t i) {
      run_item(P, i / q_blocks, q_blocks - 1 - i % q_blocks, scratch);  // most keys first
    });
    _tile_release();
  });
#endif
  return out;
}

}  // namespace

void register_prefill(pybind11::module_& m) {
  using pybind11::arg;
  m.def("prefill_attention_available", &amx::available,
        "True when this build has the AMX prefill kernel and the OS granted AMX state.");
  m.def("prefill_attention", &prefill_attention, kReleaseGil,
        "Causal attention of q (absolute positions start..start+T-1) over k/v [KVH, S, D] "
        "(bf16, AMX); tiled: k/v are a tiled cache's planes (alignedserve.kernels.kv_layout).",
        arg("q"), arg("k"), arg("v"), arg("start"), arg("scale"), arg("tiled") = false);
}

}  // namespace alignedserve
