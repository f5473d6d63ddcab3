// What the linear kernels do with a finished fp32 accumulator vector (16 output columns of one
// row), shared by the AVX-512 linear (linear_avx512.cpp) and the AMX one (small_gemm.cpp) so
// that both epilogues round and compute exactly alike:
//
//   * swiglu: 16 gate and the 16 matching up columns -> silu(gate) * up (fused.cpp's silu_mul);
//   * rotary: the x1 and x2 halves (16 dims each) of one 64-dim head -> RoPE-rotated
//     (fused.cpp's rotary_row);
//   * greedy: a row's running first maximum over its columns, merged over the threads'
//     column ranges at the end (fused.cpp's argmax_rows).
//
// Each starts from the accumulator plus bias rounded to bf16 as the plain linear stores it
// (`rounded`), so every epilogue's result is bit-identical to the plain linear's output
// followed by the separate fused.cpp op; the [rows, N] product is never stored.
// Needs AVX-512 F/BW/VL (the includer checks ALIGNEDSERVE_AVX512 from bf16_pairs.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>

#include "bf16_pairs.h"  // bf16::round16
#include "vec.h"         // Vec, vload / vstore / vround, silu_times

#if defined(ALIGNEDSERVE_AVX512)

namespace alignedserve::epilogue {

constexpr int64_t kBlock = 16;  // output columns per vector

// v rounded to bf16 as the linear stores it, widened back to fp32 exactly.
inline __attribute__((always_inline)) Vec rounded(__m512 v) {
  const __m512i bf = _mm512_cvtepu16_epi32(bf16::round16(v));
  return Vec{_mm512_castsi512_ps(_mm512_slli_epi32(bf, 16))};
}

// silu(gate) * up of one row's 16 columns, stored at out.
inline __attribute__((always_inline)) void store_silu_times(uint16_t* out, __m512 gate,
                                                            __m512 up) {
  vstore(out, silu_times(rounded(gate), rounded(up)), kBlock);
}

// Rotate-half RoPE of dims [d, d + 16) (x1) and [d + 32, d + 48) (x2) of one head of one row,
// with that row's cos / sin at dims [d, d + 16) of the table's half (cos, sin point there);
// x1's result is stored at out, x2's at out + 32.
inline __attribute__((always_inline)) void store_rotated(uint16_t* out, __m512 x1_acc,
                                                         __m512 x2_acc, const uint16_t* cos,
                                                         const uint16_t* sin) {
  const Vec cs = vload(cos, kBlock), sn = vload(sin, kBlock);
  const Vec x1 = rounded(x1_acc), x2 = rounded(x2_acc);
  vstore(out, vround(x1 * cs) - vround(x2 * sn), kBlock);
  vstore(out + 2 * kBlock, vround(x2 * cs) + vround(x1 * sn), kBlock);
}

// The greedy epilogue's state of one row over one thread's columns: per lane, the largest
// rounded output seen so far and its column (the first such: columns come in ascending order
// and only a strictly larger value replaces it), and the lanes that saw a NaN.
struct alignas(64) RowMax {
  float best[kBlock];
  int32_t at[kBlock];
  uint32_t nan;

  void reset() {
    std::fill(std::begin(best), std::end(best), -std::numeric_limits<float>::infinity());
    std::fill(std::begin(at), std::end(at), 0);
    nan = 0;
  }
};

// A row's state in registers while a kernel feeds it blocks in ascending column order.
struct RowMaxRegs {
  __m512 best;
  __m512i at;
  __mmask16 nan;

  explicit RowMaxRegs(const RowMax& s)
      : best(_mm512_load_ps(s.best)), at(_mm512_load_si512(s.at)),
        nan(static_cast<__mmask16>(s.nan)) {}

  void store(RowMax& s) const {
    _mm512_store_ps(s.best, best);
    _mm512_store_si512(s.at, at);
    s.nan = nan;
  }

  // Columns [col, col + 16) (the lanes in `valid`) of the row, before rounding.
  inline __attribute__((always_inline)) void track(__m512 acc, __mmask16 valid, int64_t col) {
    const __m512i lane =
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 v = rounded(acc).r;
    nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
    const __mmask16 up = _mm512_mask_cmp_ps_mask(valid, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, up, v);
    at = _mm512_mask_mov_epi32(at, up,
                               _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(col))));
  }
};

// Row m's greedy token from the parts' states (`parts` column ranges in column order, each
// holding M rows): a part's first maximum is the smallest column among the lanes holding its
// largest value; a later part wins only with a strictly larger one. -1 where any part saw a
// NaN.
inline int64_t first_max(const RowMax* states, int64_t parts, int64_t M, int64_t m) {
  int64_t token = 0;
  float top = 0.0f;
  for (int64_t j = 0; j < parts; ++j) {
    const RowMax& s = states[j * M + m];
    if (s.nan) return -1;
    const __m512 best = _mm512_load_ps(s.best);
    const float t = _mm512_reduce_max_ps(best);
    if (j == 0 || t > top) {
      const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(t), _CMP_EQ_OQ);
      top = t;
      token = _mm512_mask_reduce_min_epi32(holders, _mm512_load_si512(s.at));
    }
  }
  return token;
}

}  // namespace alignedserve::epilogue

#endif  // ALIGNEDSERVE_AVX512
