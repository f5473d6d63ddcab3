// Linear layers for small batches (decode steps) on Intel AMX: y = x . W^T (+ bias), bf16.
//
// Contract (checked in amx_linear below):
//   x      : [M, K] bf16, rows dense (stride(1) == 1; stride(0) free), K % 32 == 0.
//   packed : [N / 16, K / 32, 16, 16, 2] bf16 = W [N, K] cut into 16-column x 32-deep blocks,
//            each in AMX's pair-interleaved ("VNNI") B layout: packed[j, i, r, c, e] =
//            W[16 j + c, 32 i + 2 r + e]. pack_weight() makes it.
//   bias   : [N] (any float dtype) or empty.
//   out    : [M, N] bf16; products and sums in fp32, one rounding to bf16 at the end.
//
// Why: at decode shapes (tens of rows) a linear layer should stream its weight once at memory
// speed, with the arithmetic hidden behind the loads. oneDNN's prepacked bf16 matmul reaches
// neither the memory nor the compute bound at 16-64 rows (measured: docs/results/). Here
// each thread takes a contiguous range of 32-column blocks (one sequential weight stream),
// and per 32-deep step loads two 1 KiB weight tiles and multiplies them with the activation
// tiles of up to 32 rows (four accumulator tiles). More rows repeat the pass over the same
// weight blocks, now hot in L1/L2.
//
// Results do not depend on M or on how the columns are split across threads: every output
// element is the same sequence of tile products (k-blocks in order), so a row's result is
// the same whichever batch it is in.
//
// Built only where the compiler targets AMX-BF16 (as prefill_attention.cpp);
// elsewhere amx::available() is false and callers use oneDNN / F.linear.

// Narrow includes on purpose: <torch/extension.h> alone takes ~30 s to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "amx.h"  // defines ALIGNEDSERVE_AMX where the build targets AMX-BF16
#include "release_gil.h"

namespace alignedserve {
namespace {

#ifdef ALIGNEDSERVE_AMX

constexpr int64_t kRows = 16;  // rows of an activation / accumulator tile
constexpr int64_t kCols = 16;  // output columns of a weight tile
constexpr int64_t kDepth = 32; // bf16 products summed by one tile multiply
constexpr int64_t kTileBytes = 1024;

// Tile roles (amx::configure_tiles: all 16 rows x 64 bytes): 0-3 accumulators C[m][n] at
// 2 m + n (m, n in {0, 1}), 4-5 activations, 6-7 weights.

struct Problem {
  const uint16_t* x;     // [m_pad, K], zero rows past M
  int64_t x_stride;      // elements between rows of x
  const uint16_t* w;     // packed weight
  const float* bias;     // [N] fp32 or null
  uint16_t* out;         // [M, N]
  int64_t M, N, K, m_tiles;
};

// fp32 accumulator tile (16 x 16, in `acc`) -> bf16 output rows [row0, min(row0 + 16, M)).
inline void store_tile(const Problem& P, const float* acc, int64_t row0, int64_t col0) {
  const __m512 b = P.bias ? _mm512_loadu_ps(P.bias + col0) : _mm512_setzero_ps();
  const int64_t rows = std::min(kRows, P.M - row0);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + r * kCols), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(P.out + (row0 + r) * P.N + col0),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// Output columns [32 j, 32 j + 32) (or 16 when kPair is false: the last odd block) for row
// tiles m0 and m0 + 1 (m0 only when kTwoRows is false). The tile numbers are compile-time constants, as the
// intrinsics require.
template <bool kPair, bool kTwoRows>
void block(const Problem& P, int64_t j, int64_t m0, float* acc) {
  const int64_t k_blocks = P.K / kDepth;
  const int64_t a_stride = P.x_stride * 2;
  const char* a0 = reinterpret_cast<const char*>(P.x + m0 * kRows * P.x_stride);
  const char* a1 = a0 + kRows * a_stride;
  const char* b0 = reinterpret_cast<const char*>(P.w) + 2 * j * k_blocks * kTileBytes;
  const char* b1 = b0 + k_blocks * kTileBytes;
  _tile_zero(0);
  if constexpr (kPair) _tile_zero(1);
  if constexpr (kTwoRows) _tile_zero(2);
  if constexpr (kPair && kTwoRows) _tile_zero(3);
  for (int64_t i = 0; i < k_blocks; ++i) {
    _tile_loadd(6, b0 + i * kTileBytes, 64);
    _tile_loadd(4, a0 + i * kDepth * 2, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kPair) {
      _tile_loadd(7, b1 + i * kTileBytes, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kTwoRows) {
      _tile_loadd(5, a1 + i * kDepth * 2, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kPair) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t col0 = 2 * j * kCols, row0 = m0 * kRows;
  _tile_stored(0, acc, 64);
  store_tile(P, acc, row0, col0);
  if constexpr (kPair) {
    _tile_stored(1, acc, 64);
    store_tile(P, acc, row0, col0 + kCols);
  }
  if constexpr (kTwoRows) {
    _tile_stored(2, acc, 64);
    store_tile(P, acc, row0 + kRows, col0);
    if constexpr (kPair) {
      _tile_stored(3, acc, 64);
      store_tile(P, acc, row0 + kRows, col0 + kCols);
    }
  }
}

// All row tiles of column pair j (the weight blocks stay in L1/L2 after the first pass).
// Asking for the next pair's weights ahead (software prefetch into L2) measured no gain: at
// 16 rows the hardware prefetchers already stream at DRAM speed; at 64 the passes compute.
void column_pair(const Problem& P, int64_t j, float* acc) {
  const bool pair = 2 * j + 1 < P.N / kCols;
  for (int64_t m0 = 0; m0 < P.m_tiles; m0 += 2) {
    const bool two = m0 + 1 < P.m_tiles;
    if (pair && two) block<true, true>(P, j, m0, acc);
    else if (pair) block<true, false>(P, j, m0, acc);
    else if (two) block<false, true>(P, j, m0, acc);
    else block<false, false>(P, j, m0, acc);
  }
}

#endif  // ALIGNEDSERVE_AMX

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
                    "pack_weight: need a 2-d bf16 CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK_VALUE(N % 16 == 0 && K % 32 == 0 && N > 0 && K > 0,
                    "pack_weight: need out_features % 16 == 0 and in_features % 32 == 0, got ",
                    w.sizes());
  return w.reshape({N / 16, 16, K / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias_opt) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  TORCH_CHECK_VALUE(amx::available(), "amx_linear: AMX-BF16 is not available");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                        (x.size(0) <= 1 || x.stride(1) == 1),
                    "amx_linear: x must be a 2-d bf16 CPU tensor with dense rows");
  TORCH_CHECK_VALUE(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 &&
                        packed.is_contiguous() && packed.size(2) == 16 &&
                        packed.size(3) == 16 && packed.size(4) == 2,
                    "amx_linear: packed must come from pack_weight");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK_VALUE(packed.size(1) * 32 == K, "amx_linear: x has ", K,
                    " features, the weight takes ", packed.size(1) * 32);
  TORCH_CHECK_VALUE(!bias.defined() || bias.numel() == N, "amx_linear: bias must have ", N,
                    " elements");
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef ALIGNEDSERVE_AMX
  if (M == 0) return out;
  // Whole row tiles: the last tile's missing rows read zeros, their results are not stored.
  const int64_t m_tiles = (M + kRows - 1) / kRows;
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();  // only 1 row can be strided
  at::Tensor xp = rows;
  if (M % kRows) {  // padded by hand: torch's zeros + copy_ cost more than the call
    xp = at::empty({m_tiles * kRows, K}, x.options());
    const auto* src = reinterpret_cast<const uint16_t*>(rows.data_ptr());
    auto* dst = reinterpret_cast<uint16_t*>(xp.data_ptr());
    for (int64_t r = 0; r < M; ++r) std::memcpy(dst + r * K, src + r * rows.stride(0), K * 2);
    std::memset(dst + M * K, 0, (m_tiles * kRows - M) * K * 2);
  }
  at::Tensor bias_f = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
  const Problem P{reinterpret_cast<const uint16_t*>(xp.data_ptr()), xp.stride(0),
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                  reinterpret_cast<uint16_t*>(out.data_ptr()), M, N, K, m_tiles};
  const int64_t pairs = (N / kCols + 1) / 2;
  // Contiguous ranges: each thread streams one run of weight memory front to back.
  at::parallel_for(0, pairs, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float acc[kRows * kCols];
    amx::configure_tiles();
    for (int64_t j = lo; j < hi; ++j) column_pair(P, j, acc);
    _tile_release();
  });
#endif
  return out;
}

}  // namespace

void register_small_gemm(pybind11::module_& m) {
  using pybind11::arg;
  m.def("amx_linear_available", &amx::available,
        "True when this build has the AMX small-batch linear and the OS granted AMX state.");
  m.def("pack_weight", &pack_weight, kReleaseGil,
        "W [N, K] bf16 -> [N/16, K/32, 16, 16, 2], the tile layout amx_linear takes.",
        arg("weight"));
  m.def("amx_linear", &amx_linear, kReleaseGil,
        "y = x . W^T + bias on AMX, for small batches (bf16).",
        arg("x"), arg("packed"), arg("bias"));
}

}  // namespace alignedserve
