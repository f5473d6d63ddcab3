// Linear layers for small batches (decode steps) on Intel AMX: y = x . W^T (+ bias), bf16.
//
// Contract (checked in amx_linear below):
//   x      : [M, K] bf16, rows dense (stride(1) == 1; stride(0) free), K % 32 == 0.
//   packed : [N / 16, K / 32, 16, 16, 2] bf16 = W [N, K] cut into 16-column x 32-deep blocks,
//            each in AMX's pair-interleaved ("VNNI") B layout: packed[j, i, r, c, e] =
//            W[16 j + c, 32 i + 2 r + e]. pack_weight() makes it.
//   bias   : [N] (any float dtype) or empty.
//   out    : [M, N] bf16; products and sums in fp32, one rounding to bf16 at the end.
//   Epilogues, as linear_avx512 has them and with its contract (that file's comment;
//   linear_epilogue.h computes them for both): swiglu (W a block-interleaved [gate | up]
//   projection, N % 32 == 0: out [M, N / 2] = silu(gate) * up), rotary (cos / sin [M, 32]
//   bf16 and rotary_cols: RoPE on the q and k heads of a qkv projection packed with each
//   head's 16-row blocks in the order dims [0, 16), [32, 48), [16, 32), [48, 64); out in W's
//   natural order), and amx_linear_argmax (each row's first maximum of its bf16 outputs, -1
//   where one is a NaN; out never stored). Each is bit-identical to amx_linear followed by
//   fused.cpp's op. A weight column pair (32 columns, two accumulator tiles) is one (gate, up)
//   or (x1, x2) block pair of those packings.
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
#include <tuple>
#include <vector>

#include "amx.h"  // defines ALIGNEDSERVE_AMX where the build targets AMX-BF16
#include "checks.h"
#include "release_gil.h"

#ifdef ALIGNEDSERVE_AMX
#include "linear_epilogue.h"
#endif

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
  uint16_t* out;         // [M, out_cols], or null with the greedy epilogue
  int64_t M, N, K, m_tiles;
  bool swiglu;           // column pairs (gate, up) -> silu(gate) * up; out_cols = N / 2
  int64_t out_cols;
  // RoPE epilogue: columns below rotary_cols, cos / sin rows (elements apart).
  int64_t rotary_cols = 0;
  const uint16_t* cos = nullptr;
  const uint16_t* sin = nullptr;
  int64_t cos_stride = 0, sin_stride = 0;
  // Greedy epilogue: rows [0, M) of this thread's columns.
  epilogue::RowMax* row_max = nullptr;
};

inline __m512 bias_at(const Problem& P, int64_t col) {
  return P.bias ? _mm512_loadu_ps(P.bias + col) : _mm512_setzero_ps();
}

// Accumulator tiles (16 x 16 fp32) of row tile row0 -> output: acc0 holds columns
// [col0, col0 + 16), acc1 (null for a last odd block) the next 16. Plain: bias, one rounding,
// store. Epilogues (file comment): the pair is one (gate, up) or (x1, x2) block pair, or feeds
// each row's greedy state in column order.
void finish(const Problem& P, const float* acc0, const float* acc1, int64_t row0,
            int64_t col0) {
  const __m512 b0 = bias_at(P, col0);
  const __m512 b1 = acc1 ? bias_at(P, col0 + kCols) : _mm512_setzero_ps();
  const int64_t rows = std::min(kRows, P.M - row0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = row0 + r;
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(acc0 + r * kCols), b0);
    const __m512 v1 = acc1 ? _mm512_add_ps(_mm512_load_ps(acc1 + r * kCols), b1) : v0;
    if (P.row_max) {
      epilogue::RowMaxRegs state(P.row_max[m]);
      state.track(v0, 0xFFFF, col0);
      if (acc1) state.track(v1, 0xFFFF, col0 + kCols);
      state.store(P.row_max[m]);
    } else if (P.swiglu) {
      epilogue::store_silu_times(P.out + m * P.out_cols + col0 / 2, v0, v1);
    } else if (col0 < P.rotary_cols) {
      // Block pair col0 / 32 of a head holds dims [d, d + 16) and [d + 32, d + 48).
      const int64_t d = col0 % 64 / 2, x1_col = col0 / 64 * 64 + d;
      epilogue::store_rotated(P.out + m * P.N + x1_col, v0, v1, P.cos + m * P.cos_stride + d,
                              P.sin + m * P.sin_stride + d);
    } else {
      uint16_t* out = P.out + m * P.N + col0;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v0)));
      if (acc1)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kCols),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v1)));
    }
  }
}

// Output columns [32 j, 32 j + 32) (or 16 when kPair is false: the last odd block) for row
// tiles m0 and m0 + 1 (m0 only when kTwoRows is false). The tile numbers are compile-time
// constants, as the intrinsics require. `acc`: two tiles' room.
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
  float* acc1 = kPair ? acc + kRows * kCols : nullptr;
  _tile_stored(0, acc, 64);
  if constexpr (kPair) _tile_stored(1, acc1, 64);
  finish(P, acc, acc1, row0, col0);
  if constexpr (kTwoRows) {
    _tile_stored(2, acc, 64);
    if constexpr (kPair) _tile_stored(3, acc1, 64);
    finish(P, acc, acc1, row0 + kRows, col0);
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

// amx_linear, or with `greedy` each row's first-maximum index (file comment) in place of the
// product.
at::Tensor run_amx_linear(const at::Tensor& x, const at::Tensor& packed,
                          const std::optional<at::Tensor>& bias_opt, bool swiglu,
                          const std::optional<at::Tensor>& cos_opt,
                          const std::optional<at::Tensor>& sin_opt, int64_t rotary_cols,
                          bool greedy) {
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
  checks::linear_epilogue_args(M, N, swiglu, cos_opt, sin_opt, rotary_cols, "amx_linear");
  const int64_t out_cols = swiglu ? N / 2 : N;
  at::Tensor out = greedy ? at::empty({M}, x.options().dtype(at::kLong))
                          : at::empty({M, out_cols}, x.options());
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
  Problem P{reinterpret_cast<const uint16_t*>(xp.data_ptr()), xp.stride(0),
            reinterpret_cast<const uint16_t*>(packed.data_ptr()),
            bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
            greedy ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr()),
            M, N, K, m_tiles, swiglu, out_cols};
  if (rotary_cols > 0) {
    P.rotary_cols = rotary_cols;
    P.cos = static_cast<const uint16_t*>(cos_opt->data_ptr());
    P.sin = static_cast<const uint16_t*>(sin_opt->data_ptr());
    P.cos_stride = cos_opt->stride(0), P.sin_stride = sin_opt->stride(0);
  }
  // Contiguous ranges of column pairs: each part streams one run of weight memory front to
  // back; with the greedy epilogue each part keeps its rows' states, merged in column order.
  const int64_t pairs = (N / kCols + 1) / 2;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs));
  std::vector<epilogue::RowMax> states(greedy ? T * M : 0);
  for (epilogue::RowMax& s : states) s.reset();
  at::parallel_for(0, T, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float acc[2 * kRows * kCols];
    amx::configure_tiles();
    for (int64_t t = lo; t < hi; ++t) {  // hi > lo + 1 only where the region runs serially
      Problem own = P;
      if (greedy) own.row_max = states.data() + t * M;
      for (int64_t j = pairs * t / T; j < pairs * (t + 1) / T; ++j) column_pair(own, j, acc);
    }
    _tile_release();
  });
  if (greedy) {
    int64_t* tokens = out.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) tokens[m] = epilogue::first_max(states.data(), T, M, m);
  }
#endif
  return out;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, bool swiglu,
                      const std::optional<at::Tensor>& cos,
                      const std::optional<at::Tensor>& sin, int64_t rotary_cols) {
  return run_amx_linear(x, packed, bias, swiglu, cos, sin, rotary_cols, false);
}

// An LM head's greedy tokens without its logits (file comment).
at::Tensor amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed,
                             const std::optional<at::Tensor>& bias) {
  return run_amx_linear(x, packed, bias, false, std::nullopt, std::nullopt, 0, true);
}

// The rotary epilogue's call as the attention takes it: views (q [M, H, 64], k and v
// [M, KVH, 64]) of the one product.
std::tuple<at::Tensor, at::Tensor, at::Tensor> amx_linear_rotary_qkv(
    const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
    const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads) {
  constexpr const char* kName = "amx_linear_rotary_qkv";
  const at::Tensor qkv = amx_linear(x, packed, bias, false, cos, sin,
                                    checks::rotary_qkv_cols(num_heads, num_kv_heads, kName));
  return checks::qkv_views(qkv, num_heads, num_kv_heads, kName);
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
        "y = x . W^T + bias on AMX, for small batches (bf16); a row's result does not depend "
        "on the batch it is in. swiglu, cos / sin and rotary_cols: the epilogues, as "
        "linear_avx512 takes them.",
        arg("x"), arg("packed"), arg("bias") = pybind11::none(), arg("swiglu") = false,
        arg("cos") = pybind11::none(), arg("sin") = pybind11::none(), arg("rotary_cols") = 0);
  m.def("amx_linear_argmax", &amx_linear_argmax, kReleaseGil,
        "int64 [M]: each row's index of the first maximum of x . W^T + bias (bf16, as "
        "amx_linear rounds it), or -1 where the row holds a NaN; the product is never stored.",
        arg("x"), arg("packed"), arg("bias") = pybind11::none());
  m.def("amx_linear_rotary_qkv", &amx_linear_rotary_qkv, kReleaseGil,
        "amx_linear with the rotary epilogue on the q and k heads (64 dims each) of a qkv "
        "projection packed for it; views (q, k, v) of the product.",
        arg("x"), arg("packed"), arg("bias"), arg("cos"), arg("sin"), arg("num_heads"),
        arg("num_kv_heads"));
}

}  // namespace alignedserve
