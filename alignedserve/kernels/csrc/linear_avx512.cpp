// bf16 linear layer for AVX-512 CPUs without AMX: y = x . W^T (+ bias). Written around
// vdpbf16ps (AVX512-BF16); without it (the avx512 path) bf16_pairs.h gives the same arithmetic
// from AVX-512F FMAs.
//
// Contract (checked in linear_avx512 below):
//   x      : [M, K] bf16 CPU, rows dense (stride(1) == 1; stride(0) free, so x may be a row
//            view of a bigger tensor). Any M >= 0.
//   packed : pack_weight_avx512(W) for W [N, K] bf16, any N >= 1, K >= 1 (below 2^31). A 1-d
//            bf16 tensor: W's columns (output features) in panels of 64 (the last panel
//            narrower when N is not a multiple of 64: ceil(N_left / 16) * 16 wide), each panel
//            the whole depth in KP = ceil(K / 2) steps of pairs; then a 64-byte trailer:
//              panel g (width Wg) starts at element g * KP * 128, and inside it
//              [p * Wg + c] * 2 + e  holds  W[64 g + c, 2 p + e]
//            (zero where the column is >= N or the depth >= K); the trailer is 32 bf16 slots
//            holding the int32 words {kMagic, N, K, 0, ...}, so linear_avx512 knows N and
//            checks K. A step of 16 columns is one zmm: 16 lanes of (W[n, 2p], W[n, 2p + 1]),
//            the operand vdpbf16ps takes; a full panel's step is 4 zmm = 256 contiguous bytes.
//   bias   : [N] bf16 or fp32 (other float types are converted to fp32), or None.
//   out    : [M, N] bf16, new and contiguous.
//   swiglu : optional epilogue for a fused [gate | up] projection packed block-interleaved
//            (W's rows in 16-row blocks gate 0, up 0, gate 1, up 1, ...; N % 32 == 0): out is
//            [M, N / 2] = silu(gate) * up, rounded exactly as linear + silu_mul round it
//            (gate and up to bf16 first, then fused.cpp's silu_mul arithmetic;
//            linear_epilogue.h), so the result is bit-identical to the two calls and the
//            [M, N] product is never stored.
//   rotary : optional epilogue for a fused qkv projection whose first rotary_cols / 64 heads
//            (q and k; head_dim 64, one panel each) take rotate-half RoPE: W's rows packed
//            with each such head's 16-row blocks in the order dims [0, 16), [32, 48),
//            [16, 32), [48, 64) (so each block pair holds the x1 and x2 halves RoPE mixes), and
//            cos / sin [M, 32] bf16 rows. out is [M, N] in W's natural column order with those
//            heads rotated, rounded exactly as linear + fused.cpp's rotary_qkv_ round them
//            (the product to bf16 first, then rotary_row's arithmetic; linear_epilogue.h), so
//            the result is bit-identical to the two calls. Without rotary such a packing's
//            product comes out in the packed order (the caller restores it).
//   greedy : linear_avx512_argmax: instead of out, each row's index of the first maximum of
//            its bf16 outputs (exactly the values out would hold), or -1 where one of them is
//            a NaN; the same index as fused.cpp's argmax_rows over out. The [M, N] product
//            (an LM head's logits) is never stored.
//
// Arithmetic, and why a row's result does not depend on its batch: every output element
// y[m, n] is one fp32 accumulator that starts at +0 and takes, for p = 0, 1, ..., KP - 1 in
// order, one vdpbf16ps step with the pair (x[m, 2p], x[m, 2p + 1]) and (W[n, 2p], W[n, 2p+1])
// (bf16::dot_word; for odd K the missing x[m, K] is a zero, as is its weight); then the bias
// is added in fp32 and the sum rounded once to bf16 (round to nearest even). Every kernel
// variant below (whatever rows x columns it holds in registers, whatever part of the matrix a
// thread takes) issues exactly this sequence for each element, so y[m] depends only on x[m] and W:
// not on M, on the other rows, on the thread count or on the work split.
//
// Speed. At decode shapes (a few rows) a linear layer is a stream of its weight from DRAM;
// from a dozen or so rows on it is bound by the vdpbf16ps rate (on Zen 4 one zmm per cycle
// per core: 16 lanes x 2 products). The register tile is kRows rows x 64 columns (6 x 4 zmm
// accumulators: enough independent chains to cover vdpbf16ps's latency, and 24 + 4 weight
// + 1 broadcast registers fit in 32); per depth step it loads one panel step (4 zmm) and
// broadcasts one pair per row. Each thread takes a contiguous range of 16-column blocks,
// i.e. one run of weight memory front to back; for each panel (or part of one) in its range
// it runs every row tile over it, the panel staying in L2 after the first row tile (part()
// says what is prefetched, and when). Where there are too few columns for the threads, they
// split the rows instead (split_rows()). Without AVX512-BF16 each step is two FMAs on the
// weights' odd and even elements, split once per panel step (8 registers), so the tile is
// 5 x 64: 20 accumulators + 8 weight + 2 broadcast registers; from kWideMinRows rows both
// operands are widened to fp32 first and the tile is 6 x 64 (wide_tile, further down).
//
// Compiled everywhere; the kernel itself only where the compiler targets AVX-512 F, BW and VL
// (with or without AVX512-BF16). Elsewhere linear_avx512_available() is false and
// linear_avx512 throws (pack_weight_avx512 still packs).

// Narrow includes on purpose: <torch/extension.h> is slow to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "bf16_pairs.h"  // vdpbf16ps, or its AVX-512F equivalent (the avx512 path)
#include "checks.h"
#include "linear_epilogue.h"  // what the epilogues compute (SwiGLU, RoPE, greedy)
#include "release_gil.h"

#if defined(ALIGNEDSERVE_AVX512)
#define ALIGNEDSERVE_LINEAR_AVX512 1
#endif

namespace alignedserve {
namespace {

constexpr int64_t kBlock = 16;          // output columns per zmm (fp32 lanes)
constexpr int64_t kPanelBlocks = 4;     // blocks per panel: 64 columns
constexpr int64_t kTrailer = checks::kTrailer;  // bf16 slots (64 bytes) after the panels
constexpr int32_t kMagic = 0x4c415835;  // "5XAL": marks a tensor from pack_weight_avx512

bool available() {
#ifdef ALIGNEDSERVE_LINEAR_AVX512
  return true;
#else
  return false;
#endif
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef ALIGNEDSERVE_LINEAR_AVX512

// Rows per register tile: 6 x 4 = 24 zmm accumulators; 5 where each of the 4 weight vectors
// takes two registers (bf16::Pairs without AVX512-BF16; see "Speed" above).
constexpr int kRows = bf16::kNativeDot ? 6 : 5;

using epilogue::RowMax;

struct Problem {
  const uint16_t* x;  // [M, K], row stride x_stride (elements)
  int64_t x_stride;
  const uint16_t* w;  // packed panels
  const void* bias;   // [N] or null
  bool bias_bf16;     // bias is bf16 (else fp32)
  uint16_t* out;      // [M, N], or [M, N / 2] with swiglu
  int64_t M, N, K, KP;
  bool swiglu;        // block pairs (gate, up) -> silu(gate) * up (file comment)
  int64_t out_cols;   // N, or N / 2 with swiglu
  const float* xw;    // x widened to fp32, [M, 2 KP] (zero-padded), or null: see wide_tile()
  // RoPE epilogue (file comment): columns below rotary_cols, cos / sin rows (elements apart).
  int64_t rotary_cols = 0;
  const uint16_t* cos = nullptr;
  const uint16_t* sin = nullptr;
  int64_t cos_stride = 0, sin_stride = 0;
  // Greedy epilogue (file comment): rows [0, M) of this part's columns; out is then null.
  RowMax* row_max = nullptr;
};

// Where block j's step 0 lies, and how many elements apart its steps are (its panel's width
// in columns times 2).
std::pair<const uint16_t*, int64_t> block_at(const Problem& P, int64_t j) {
  const int64_t nb = ceil_div(P.N, kBlock);
  const int64_t g = j / kPanelBlocks;
  const int64_t width = std::min(kPanelBlocks, nb - g * kPanelBlocks) * kBlock;
  return {P.w + g * P.KP * kPanelBlocks * kBlock * 2 + (j % kPanelBlocks) * kBlock * 2,
          width * 2};
}

// Where output row m's column `col` (of the packed product) is stored: with swiglu a block
// pair's 32 product columns become 16 output columns.
uint16_t* out_at_row(const Problem& P, int64_t m, int64_t col) {
  return P.swiglu ? P.out + m * P.out_cols + col / 2 : P.out + m * P.N + col;
}

// What a tile pulls into L2 while it computes (see part()): `steps` depth steps of the next
// weight group from `w` on (`w_step` bytes apart, `lines` 64-byte lines each), one of them
// every 2^shift of its own depth steps; and the `rows` activation rows starting at `x`
// (`x_row` bytes apart, `x_bytes` bytes a depth step), one line of each whenever a step
// starts a new line.
struct Ahead {
  const char* w;
  int64_t w_step;
  int64_t lines;
  int64_t steps;
  int shift;
  const char* x;
  int64_t x_row;
  int64_t x_bytes;
  int64_t rows;
};

// The per-step prefetches of a tile at depth step p (of `full`): its output lines 32 steps
// before the end (with many rows the output is bigger than L2, and stores that each wait for
// their line from L3 stall the next tile), then `ahead`'s share of what the next tile needs.
template <int R, int C>
inline __attribute__((always_inline)) void pull(const Problem& P, int64_t m, int64_t col,
                                                const Ahead& ahead, int64_t p, int64_t full) {
  if (P.out && p == std::max<int64_t>(0, full - 32))
    for (int r = 0; r < R; ++r) {
      const char* o = reinterpret_cast<const char*>(out_at_row(P, m + r, col));
      const int64_t bytes = (P.swiglu ? C / 2 : C) * kBlock * 2;
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(o + b, _MM_HINT_T0);
      _mm_prefetch(o + bytes - 1, _MM_HINT_T0);
    }
  const int64_t s = p >> ahead.shift;
  if (s << ahead.shift == p && s < ahead.steps)
    for (int64_t q = 0; q < ahead.lines; ++q)
      _mm_prefetch(ahead.w + s * ahead.w_step + q * 64, _MM_HINT_T1);
  if ((p * ahead.x_bytes & 63) == 0)
    for (int64_t r = 0; r < ahead.rows; ++r)
      _mm_prefetch(ahead.x + r * ahead.x_row + p * ahead.x_bytes, _MM_HINT_T1);
}

// The rotary epilogue's store (file comment): packed block pair (c, c + 1) of the tile holds
// dims [d, d + 16) and [d + 32, d + 48) of head (col / 16 + c) / 4, d = 0 or 16 by the pair's
// place in the head.
template <int R, int C>
inline __attribute__((always_inline)) void rotate(const Problem& P, int64_t m, int64_t col,
                                                  __m512 (&acc)[R][C], const __m512 (&bias)[C]) {
#pragma GCC unroll 2
  for (int c = 0; c + 1 < C; c += 2) {
    const int64_t block = col / kBlock + c;
    const int64_t d = block % kPanelBlocks / 2 * kBlock;
    const int64_t x1_col = block / kPanelBlocks * kPanelBlocks * kBlock + d;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
      epilogue::store_rotated(P.out + (m + r) * P.N + x1_col,
                              _mm512_add_ps(acc[r][c], bias[c]),
                              _mm512_add_ps(acc[r][c + 1], bias[c + 1]),
                              P.cos + (m + r) * P.cos_stride + d,
                              P.sin + (m + r) * P.sin_stride + d);
  }
}

// The greedy epilogue (file comment): each row's blocks in column order into its state (only
// the valid columns of a block).
template <int R, int C>
inline __attribute__((always_inline)) void track_max(const Problem& P, int64_t m, int64_t col,
                                                     __m512 (&acc)[R][C],
                                                     const __m512 (&bias)[C],
                                                     const __mmask16 (&mask)[C]) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    epilogue::RowMaxRegs s(P.row_max[m + r]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      s.track(_mm512_add_ps(acc[r][c], bias[c]), mask[c], col + c * kBlock);
    s.store(P.row_max[m + r]);
  }
}

// Bias (or +0), one rounding, store of a tile's accumulators; inlined so they stay in
// registers.
template <int R, int C>
inline __attribute__((always_inline)) void finish(const Problem& P, int64_t m, int64_t col,
                                                  __m512 (&acc)[R][C]) {
  __m512 bias[C];
  __mmask16 mask[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t cc = col + c * kBlock;
    mask[c] = static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, P.N - cc)) - 1);
    if (!P.bias) {
      bias[c] = _mm512_setzero_ps();
    } else if (P.bias_bf16) {
      // bf16 -> fp32 is a 16-bit shift. (The masked forms: GCC 12's unmasked ones warn about
      // their undefined pass-through operand.)
      const __m256i raw =
          _mm256_maskz_loadu_epi16(mask[c], static_cast<const uint16_t*>(P.bias) + cc);
      bias[c] = _mm512_castsi512_ps(
          _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, raw), 16));
    } else {
      bias[c] = _mm512_maskz_loadu_ps(mask[c], static_cast<const float*>(P.bias) + cc);
    }
  }
  if (P.row_max) {
    track_max<R, C>(P, m, col, acc, bias, mask);
    return;
  }
  if (P.swiglu) {  // C is even here: blocks (gate, up) side by side, full (N % 32 == 0)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int c = 0; c + 1 < C; c += 2) {
        epilogue::store_silu_times(out_at_row(P, m + r, col) + c / 2 * kBlock,
                                   _mm512_add_ps(acc[r][c], bias[c]),
                                   _mm512_add_ps(acc[r][c + 1], bias[c + 1]));
      }
    return;
  }
  if (col < P.rotary_cols) {  // C is even: block pairs (x1, x2) of one head's dims
    if constexpr (C % 2 == 0) rotate<R, C>(P, m, col, acc, bias);
    return;
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i y = bf16::round16(_mm512_add_ps(acc[r][c], bias[c]));
      _mm256_mask_storeu_epi16(out_at_row(P, m + r, col) + c * kBlock, mask[c], y);
    }
}

// Rows [m, m + R) x the C blocks from `w` on (steps `w_step` elements apart; output columns
// from col on) over the whole depth, then bias, rounding and store. The arithmetic is the
// same for every R and C (file comment).
template <int R, int C>
void tile(const Problem& P, int64_t m, const uint16_t* w, int64_t w_step, int64_t col,
          const Ahead& ahead) {
  const int64_t full = P.K / 2;  // complete pairs
  // Rows r < 3 are addressed from x0, the others from x3 (base + r * stride with scale 1 or
  // 2), so R row pointers cost three registers.
  const char* x0 = reinterpret_cast<const char*>(P.x + m * P.x_stride);
  const char* x3 = x0 + 3 * P.x_stride * 2;
  const int64_t xs = P.x_stride * 2;  // bytes
  auto row = [&](int r) { return r < 3 ? x0 + r * xs : x3 + (r - 3) * xs; };

  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();

  // One depth step. The weights are loaded first and each row's pair is broadcast just
  // before its C products, so at most C + 1 inputs are live beside the R x C accumulators.
  auto step = [&](const uint16_t* ws, auto pair_of_row) {
    bf16::Pairs b[C];
    for (int c = 0; c < C; ++c) b[c] = bf16::to_pairs(_mm512_loadu_si512(ws + c * kBlock * 2));
    for (int r = 0; r < R; ++r) {
      const auto a = static_cast<uint32_t>(pair_of_row(r));
      for (int c = 0; c < C; ++c) acc[r][c] = bf16::dot_word(acc[r][c], b[c], a);
    }
  };

  const uint16_t* ws = w;
  for (int64_t p = 0; p < full; ++p, ws += w_step) {
    pull<R, C>(P, m, col, ahead, p, full);
    step(ws, [&](int r) {
      int32_t v;
      std::memcpy(&v, row(r) + 4 * p, 4);
      return v;
    });
  }
  if (P.K & 1)  // the last, half pair: (x[m, K - 1], 0)
    step(ws, [&](int r) {
      uint16_t v;
      std::memcpy(&v, row(r) + 4 * full, 2);
      return static_cast<int32_t>(v);
    });
  finish<R, C>(P, m, col, acc);
}

template <int C>
void tile_rows(const Problem& P, int64_t m, int64_t rows, const uint16_t* w, int64_t w_step,
               int64_t col, const Ahead& ahead) {
  switch (rows) {
    case 1: return tile<1, C>(P, m, w, w_step, col, ahead);
    case 2: return tile<2, C>(P, m, w, w_step, col, ahead);
    case 3: return tile<3, C>(P, m, w, w_step, col, ahead);
    case 4: return tile<4, C>(P, m, w, w_step, col, ahead);
    case 5: return tile<5, C>(P, m, w, w_step, col, ahead);
    default: return tile<kRows, C>(P, m, w, w_step, col, ahead);
  }
}

// The avx512 path's many-row calls (from kWideMinRows rows; not built with AVX512-BF16, whose
// vdpbf16ps is one instruction a pair). The emulated pair step above spends, beside its
// 2 R C FMAs, 2 C ops splitting the weights and two broadcasts a row, and those share the FMA
// ports. Here the call widens x to fp32 once (Problem::xw, zero-padded to 2 KP) and each
// thread widens the weight group it is about to run into fp32 scratch (widen_group), so a
// step is loads and FMAs only: each FMA takes its row's element straight from memory as a
// broadcast operand. The products and their order are the emulated step's exactly (odd
// element first, then even; the half pair of an odd K is a full step with a zero odd element
// and weight, as there), so results are bit-identical to tile() and a row's result still
// does not depend on which variant ran it.
#if defined(ALIGNEDSERVE_LINEAR_AVX512) && !defined(__AVX512BF16__)
#define ALIGNEDSERVE_LINEAR_WIDE 1
constexpr int kWideRows = 6;  // 6 x 4 accumulators + 4 weight registers
// Below this many rows a call is too short for the widening to pay: its scratch stores (the
// whole group, to L2) cost about what the split ops they save do.
constexpr int64_t kWideMinRows = 6 * kWideRows;

// Blocks [j, j + C) of the packed weight (block_at(P, j) = {w, w_step}) as fp32 in `out`:
// step p at out + 2 C kBlock p holds the C blocks' odd elements, then their even elements.
void widen_group(const Problem& P, const uint16_t* w, int64_t w_step, int64_t C, float* out) {
  for (int64_t p = 0; p < P.KP; ++p, w += w_step, out += 2 * C * kBlock)
    for (int64_t c = 0; c < C; ++c) {
      const bf16::Pairs b = bf16::to_pairs(_mm512_loadu_si512(w + c * kBlock * 2));
      _mm512_storeu_ps(out + c * kBlock, b.odd);
      _mm512_storeu_ps(out + (C + c) * kBlock, b.even);
    }
}

// tile() for rows [m, m + R) with widened operands: `w` is widen_group's output for the C
// blocks from output column col on.
template <int R, int C>
void wide_tile(const Problem& P, int64_t m, const float* w, int64_t col, const Ahead& ahead) {
  const int64_t xs = 2 * P.KP;  // floats between rows of P.xw
  // Rows r < 3 are addressed from x0, the others from x3, as in tile().
  const float* x0 = P.xw + m * xs;
  const float* x3 = x0 + 3 * xs;
  auto row = [&](int r) { return r < 3 ? x0 + r * xs : x3 + (r - 3) * xs; };
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P.KP; ++p, w += 2 * C * kBlock) {
    pull<R, C>(P, m, col, ahead, p, P.KP);
    for (int h = 1; h >= 0; --h) {  // element 2p + 1 (odd), then 2p
      __m512 b[C];
      for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(w + ((1 - h) * C + c) * kBlock);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(row(r)[2 * p + h]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(b[c], a, acc[r][c]);
      }
    }
  }
  finish<R, C>(P, m, col, acc);
}

template <int C>
void wide_tile_rows(const Problem& P, int64_t m, int64_t rows, const float* w, int64_t col,
                    const Ahead& ahead) {
  switch (rows) {
    case 1: return wide_tile<1, C>(P, m, w, col, ahead);
    case 2: return wide_tile<2, C>(P, m, w, col, ahead);
    case 3: return wide_tile<3, C>(P, m, w, col, ahead);
    case 4: return wide_tile<4, C>(P, m, w, col, ahead);
    case 5: return wide_tile<5, C>(P, m, w, col, ahead);
    default: return wide_tile<kWideRows, C>(P, m, w, col, ahead);
  }
}

// This thread's scratch for one widened group (grown, never shrunk: a call's pages are
// already mapped by the next).
float* wide_scratch(int64_t floats) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buffer;
  thread_local int64_t capacity = 0;
  if (floats > capacity) {
    const int64_t bytes = (floats * 4 + 63) / 64 * 64;
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buffer, "linear_avx512: out of memory for ", bytes, " bytes of scratch");
    capacity = floats;
  }
  return buffer.get();
}
#endif

// Rows [m0, m1) x blocks [j0, j1), one group at a time: the blocks of one panel inside the
// range (a whole panel but maybe at the ends), all row tiles over it. Each tile pulls the
// rows of the tile after it into L2 (with many rows they come from L3). With at least two
// full row tiles, the tiles also pull the next group's weights into L2, so the weight stream
// from memory overlaps the arithmetic: tile t takes the t-th run of the next group's depth
// steps and requests one step (all its lines) every 2^shift of its own steps, the largest
// power of two at which the tiles still cover the group. So the stream goes in address order
// and is spread over the group's whole time; before, each of the first tiles requested a
// line of every step (strided, in a burst), which measured slower on weights from DRAM.
// With fewer rows the group is a stream from memory that the hardware prefetchers serve
// better alone: a second, software stream one panel ahead made it slower.
void part(const Problem& P, int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
#ifdef ALIGNEDSERVE_LINEAR_WIDE
  const bool wide = P.xw != nullptr;
  const int64_t tile_rows_max = wide ? kWideRows : kRows;
  float* scratch = wide ? wide_scratch(P.KP * 2 * kPanelBlocks * kBlock) : nullptr;
#else
  const int64_t tile_rows_max = kRows;
#endif
  const int64_t row_tiles = ceil_div(m1 - m0, tile_rows_max);
  const bool pull = m1 - m0 >= 2 * tile_rows_max;
  auto group_end = [&](int64_t j) {
    return std::min(j1, (j / kPanelBlocks + 1) * kPanelBlocks);
  };
  // Own steps of a tile (the half pair of an odd K has none) and the pull's rate, the same
  // for every group.
  const int64_t own = P.xw != nullptr ? P.KP : P.K / 2;
  int shift = 0;
  while (shift < 16 && row_tiles * ceil_div(own, int64_t{2} << shift) >= P.KP) ++shift;
  const int64_t per_tile = ceil_div(own, int64_t{1} << shift);  // next-group steps a tile
  for (int64_t j = j0; j < j1;) {
    const int64_t j_end = group_end(j), cols = j_end - j;
    const auto [w, w_step] = block_at(P, j);
    const int64_t next = pull && j_end < j1 ? group_end(j_end) - j_end : 0;  // lines a step
    const auto [w_next, w_next_step] = next ? block_at(P, j_end) : std::pair{w, w_step};
#ifdef ALIGNEDSERVE_LINEAR_WIDE
    if (wide) widen_group(P, w, w_step, cols, scratch);
    const char* x_base = wide ? reinterpret_cast<const char*>(P.xw)
                              : reinterpret_cast<const char*>(P.x);
    const int64_t x_row = wide ? 2 * P.KP * 4 : P.x_stride * 2, x_bytes = wide ? 8 : 4;
#else
    const char* x_base = reinterpret_cast<const char*>(P.x);
    const int64_t x_row = P.x_stride * 2, x_bytes = 4;
#endif
    for (int64_t m = m0, t = 0; m < m1; m += tile_rows_max, ++t) {
      const int64_t rows = std::min<int64_t>(tile_rows_max, m1 - m);
      const int64_t s0 = std::min(P.KP, t * per_tile);
      const int64_t m_next = m + tile_rows_max < m1 ? m + tile_rows_max : m0;
      const Ahead ahead{reinterpret_cast<const char*>(w_next + s0 * w_next_step),
                        w_next_step * 2, next, std::min(P.KP, s0 + per_tile) - s0, shift,
                        x_base + m_next * x_row, x_row, x_bytes,
                        row_tiles > 1 ? std::min<int64_t>(tile_rows_max, m1 - m_next) : 0};
      const int64_t col = j * kBlock;
#ifdef ALIGNEDSERVE_LINEAR_WIDE
      if (wide) {
        switch (cols) {
          case 1: wide_tile_rows<1>(P, m, rows, scratch, col, ahead); break;
          case 2: wide_tile_rows<2>(P, m, rows, scratch, col, ahead); break;
          case 3: wide_tile_rows<3>(P, m, rows, scratch, col, ahead); break;
          default: wide_tile_rows<4>(P, m, rows, scratch, col, ahead); break;
        }
        continue;
      }
#endif
      switch (cols) {
        case 1: tile_rows<1>(P, m, rows, w, w_step, col, ahead); break;
        case 2: tile_rows<2>(P, m, rows, w, w_step, col, ahead); break;
        case 3: tile_rows<3>(P, m, rows, w, w_step, col, ahead); break;
        default: tile_rows<4>(P, m, rows, w, w_step, col, ahead); break;
      }
    }
    j = j_end;
  }
}

// How T threads share M rows x NB column blocks: a grid of tm row ranges x tn block ranges
// (tm * tn = T). A part costs its blocks times (its rows plus what streaming a block from
// memory costs, in rows of arithmetic): few rows favour splitting the columns (each weight
// read once), many rows over few blocks favour splitting the rows.
int64_t split_rows(int64_t M, int64_t NB, int64_t T) {
  constexpr int64_t kStreamRows = 16;
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t tm = 1; tm <= T; ++tm) {
    if (T % tm) continue;
    const int64_t cost = ceil_div(NB, T / tm) * (ceil_div(M, tm) + kStreamRows);
    if (cost < best_cost) best = tm, best_cost = cost;
  }
  return best;
}

#endif  // ALIGNEDSERVE_LINEAR_AVX512

at::Tensor pack_weight_avx512(const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
                    "pack_weight_avx512: need a 2-d bf16 CPU weight [N, K], got ",
                    w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK_VALUE(N > 0 && K > 0 && N < INT32_MAX && K < INT32_MAX,
                    "pack_weight_avx512: bad weight shape ", w.sizes());
  const int64_t NB = ceil_div(N, kBlock), KP = ceil_div(K, 2);
  const at::Tensor src = w.contiguous();
  at::Tensor packed = at::empty({NB * kBlock * KP * 2 + kTrailer}, w.options());
  const auto* s = reinterpret_cast<const uint16_t*>(src.data_ptr());
  auto* d = reinterpret_cast<uint16_t*>(packed.data_ptr());
  for (int64_t n0 = 0; n0 < NB * kBlock; n0 += kPanelBlocks * kBlock) {
    const int64_t width = std::min(kPanelBlocks * kBlock, NB * kBlock - n0);
    for (int64_t p = 0; p < KP; ++p)
      for (int64_t c = 0; c < width; ++c)
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t n = n0 + c, k = 2 * p + e;
          *d++ = n < N && k < K ? s[n * K + k] : 0;
        }
  }
  checks::write_trailer(d, kMagic, N, K);
  return packed;
}


// linear_avx512, or with `greedy` each row's first-maximum index (file comment) in place of
// the product.
at::Tensor run_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias_opt, bool swiglu,
                      const std::optional<at::Tensor>& cos_opt,
                      const std::optional<at::Tensor>& sin_opt, int64_t rotary_cols,
                      bool greedy) {
  TORCH_CHECK_VALUE(available(), "linear_avx512: this build has no AVX-512 kernel");
  const auto [N, K] = checks::packed_shape(packed, kMagic, kBlock, "linear_avx512",
                                           "pack_weight_avx512");
  checks::linear_input(x, K, "linear_avx512");
  const at::Tensor bias = checks::linear_bias(bias_opt, N, "linear_avx512");
  const int64_t M = x.size(0);
  checks::linear_epilogue_args(M, N, swiglu, cos_opt, sin_opt, rotary_cols, "linear_avx512");
  const int64_t out_cols = swiglu ? N / 2 : N;
  at::Tensor out = greedy ? at::empty({M}, x.options().dtype(at::kLong))
                          : at::empty({M, out_cols}, x.options());
#ifdef ALIGNEDSERVE_LINEAR_AVX512
  if (M == 0) return out;
  // One row (or K == 1) may come with any strides; make it dense.
  at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  int64_t x_stride = M == 1 ? K : rows.stride(0);
  if (M > 1 && (x_stride * 2) % 4096 == 0) {
    // Rows a multiple of 4 KiB apart all fall in the same L1 sets and evict one another while
    // a tile walks them (measurably slower at K = 14336): copy them 64 bytes apart.
    at::Tensor padded = at::empty({M, K + 32}, x.options());
    for (int64_t r = 0; r < M; ++r)
      std::memcpy(static_cast<uint16_t*>(padded.data_ptr()) + r * (K + 32),
                  static_cast<const uint16_t*>(rows.data_ptr()) + r * x_stride, K * 2);
    rows = padded;
    x_stride = K + 32;
  }
  // Declared first so that a widened copy of x (wide_tile) outlives the call's threads.
  at::Tensor widened;
  auto widened_rows = [&](const at::Tensor& x_rows, int64_t stride, int64_t M,
                          int64_t K) -> const float* {
#ifdef ALIGNEDSERVE_LINEAR_WIDE
    if (M < kWideMinRows) return nullptr;
    const int64_t KP2 = ceil_div(K, 2) * 2;
    widened = at::empty({M, KP2}, x_rows.options().dtype(at::kFloat));
    const auto* src = static_cast<const uint16_t*>(x_rows.data_ptr());
    auto* dst = static_cast<float*>(widened.data_ptr());
    at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const uint16_t* in = src + r * stride;
        float* out = dst + r * KP2;
        for (int64_t k = 0; k < K; ++k) {  // bf16 -> fp32 is a 16-bit shift
          const uint32_t bits = static_cast<uint32_t>(in[k]) << 16;
          std::memcpy(out + k, &bits, 4);
        }
        if (KP2 > K) dst[r * KP2 + K] = 0.0f;
      }
    });
    return dst;
#else
    (void)x_rows, (void)stride, (void)M, (void)K;
    return nullptr;
#endif
  };
  Problem P{reinterpret_cast<const uint16_t*>(rows.data_ptr()), x_stride,
            reinterpret_cast<const uint16_t*>(packed.data_ptr()),
            bias.defined() ? bias.data_ptr() : nullptr,
            bias.defined() && bias.scalar_type() == at::kBFloat16,
            greedy ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr()),
            M, N, K, ceil_div(K, 2), swiglu, out_cols, widened_rows(rows, x_stride, M, K)};
  if (rotary_cols > 0) {
    P.rotary_cols = rotary_cols;
    P.cos = static_cast<const uint16_t*>(cos_opt->data_ptr());
    P.sin = static_cast<const uint16_t*>(sin_opt->data_ptr());
    P.cos_stride = cos_opt->stride(0), P.sin_stride = sin_opt->stride(0);
  }
  const int64_t NB = ceil_div(N, kBlock);
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NB * M));
  const int64_t tm = split_rows(M, NB, T), tn = T / tm;
  // With swiglu a thread's blocks start and end on (gate, up) pair boundaries, with rotary on
  // (x1, x2) pair boundaries (N is then a multiple of 32 columns: an even count of blocks).
  const int64_t unit = swiglu || rotary_cols > 0 ? 2 : 1, units = NB / unit;
  // Greedy: one state per row for each of the tn column ranges (a part's rows own theirs).
  std::vector<RowMax> states(greedy ? tn * M : 0);
  for (RowMax& s : states) s.reset();
  at::parallel_for(0, T, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {  // hi > lo + 1 only where the region runs serially
      const int64_t i = t / tn, jn = t % tn;
      Problem own = P;
      if (greedy) own.row_max = states.data() + jn * M;
      part(own, M * i / tm, M * (i + 1) / tm, unit * (units * jn / tn),
           unit * (units * (jn + 1) / tn));
    }
  });
  if (greedy) {
    int64_t* tokens = out.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) tokens[m] = epilogue::first_max(states.data(), tn, M, m);
  }
#endif
  return out;
}

at::Tensor linear_avx512(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias_opt, bool swiglu,
                         const std::optional<at::Tensor>& cos_opt,
                         const std::optional<at::Tensor>& sin_opt, int64_t rotary_cols) {
  return run_linear(x, packed, bias_opt, swiglu, cos_opt, sin_opt, rotary_cols, false);
}

// The greedy epilogue's call (file comment): an LM head's greedy tokens without its logits.
at::Tensor linear_avx512_argmax(const at::Tensor& x, const at::Tensor& packed,
                                const std::optional<at::Tensor>& bias) {
  return run_linear(x, packed, bias, false, std::nullopt, std::nullopt, 0, true);
}

// The rotary epilogue's call as the attention takes it: views (q [M, H, 64], k and v
// [M, KVH, 64]) of the one product.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_avx512_rotary_qkv(
    const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
    const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads) {
  constexpr const char* kName = "linear_avx512_rotary_qkv";
  const at::Tensor qkv = linear_avx512(x, packed, bias, false, cos, sin,
                                       checks::rotary_qkv_cols(num_heads, num_kv_heads, kName));
  return checks::qkv_views(qkv, num_heads, num_kv_heads, kName);
}

}  // namespace

void register_linear_avx512(pybind11::module_& m) {
  using pybind11::arg;
  m.def("linear_avx512_available", &available,
        "True when this build has the AVX-512 linear kernel.");
  m.def("pack_weight_avx512", &pack_weight_avx512, kReleaseGil,
        "W [N, K] bf16 -> the 1-d packed layout linear_avx512 takes (64-column panels of "
        "pair-interleaved depth steps, then a trailer holding N and K).",
        arg("weight"));
  m.def("linear_avx512", &linear_avx512, kReleaseGil,
        "y = x . W^T + bias in bf16 (fp32 accumulation, one rounding); a row's result does "
        "not depend on the batch it is in. swiglu: W is a block-interleaved [gate | up] "
        "projection and the result is silu(gate) * up [M, N / 2]. cos, sin ([M, 32] bf16) "
        "and rotary_cols: W is a qkv projection packed for RoPE on its first rotary_cols "
        "columns (heads of 64 dims), applied to the result.",
        arg("x"), arg("packed"), arg("bias") = pybind11::none(), arg("swiglu") = false,
        arg("cos") = pybind11::none(), arg("sin") = pybind11::none(), arg("rotary_cols") = 0);
  m.def("linear_avx512_argmax", &linear_avx512_argmax, kReleaseGil,
        "int64 [M]: for each row of x . W^T + bias (bf16, as linear_avx512 rounds it), the "
        "index of its first maximum, or -1 where the row holds a NaN; the product is never "
        "stored (an LM head's greedy tokens without the logits).",
        arg("x"), arg("packed"), arg("bias") = pybind11::none());
  m.def("linear_avx512_rotary_qkv", &linear_avx512_rotary_qkv, kReleaseGil,
        "linear_avx512 with the rotary epilogue on the q and k heads (64 dims each) of a qkv "
        "projection packed for it; views (q, k, v) of the product.",
        arg("x"), arg("packed"), arg("bias"), arg("cos"), arg("sin"), arg("num_heads"),
        arg("num_kv_heads"));
}

}  // namespace alignedserve
