// Argument checks and the packed-weight trailer shared by the per-ISA kernels of one op: the
// AVX512-BF16 and AVX2 linears take the same contract (csrc/linear_avx512.cpp,
// csrc/linear_avx2.cpp), the AVX512-BF16 and AMX linears the same epilogues
// (csrc/small_gemm.cpp), and so do the AVX512-BF16 and AVX2 prefill attentions
// (csrc/prefill_attention_avx512.cpp, csrc/prefill_attention_avx2.cpp). Each message starts
// with the calling kernel's name. Linears raise ValueError (TORCH_CHECK_VALUE), prefill
// attention RuntimeError (TORCH_CHECK), as their Python callers and tests expect.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>

#include "tiled_layout.h"

namespace alignedserve::checks {

// A packed weight ends in kTrailer bf16 slots (64 bytes) holding the int32 words
// {magic, N, K, 0, ...}: the kernel reads N from it and checks K and the packer.
constexpr int64_t kTrailer = 32;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Writes the trailer at `dst` (the slot after the panels).
inline void write_trailer(uint16_t* dst, int32_t magic, int64_t N, int64_t K) {
  const int32_t meta[kTrailer / 2] = {magic, static_cast<int32_t>(N), static_cast<int32_t>(K)};
  std::memcpy(dst, meta, sizeof(meta));
}

// N and K of a weight packed by `packer` (its trailer says `magic`) into panels of `panel`
// output columns over ceil(K / 2) depth pairs; anything else is rejected.
inline std::pair<int64_t, int64_t> packed_shape(const at::Tensor& packed, int32_t magic,
                                                int64_t panel, const char* kernel,
                                                const char* packer) {
  TORCH_CHECK_VALUE(packed.dim() == 1 && packed.scalar_type() == at::kBFloat16 &&
                        packed.device().is_cpu() && packed.is_contiguous() &&
                        packed.numel() > kTrailer,
                    kernel, ": packed must come from ", packer);
  int32_t meta[3];
  std::memcpy(meta,
              reinterpret_cast<const uint16_t*>(packed.data_ptr()) + packed.numel() - kTrailer,
              sizeof(meta));
  const int64_t N = meta[1], K = meta[2];
  TORCH_CHECK_VALUE(meta[0] == magic && N > 0 && K > 0 &&
                        packed.numel() == ceil_div(N, panel) * panel * ceil_div(K, 2) * 2 + kTrailer,
                    kernel, ": packed must come from ", packer);
  return {N, K};
}

// x [M, K]: bf16 on CPU, rows dense (one row, or K == 1, may have any strides).
inline void linear_input(const at::Tensor& x, int64_t K, const char* kernel) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
                    kernel, ": x must be a 2-d bf16 CPU tensor, got ", x.scalar_type(), " ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.size(1) == K, kernel, ": x has ", x.size(1),
                    " features, the weight takes ", K);
  TORCH_CHECK_VALUE(x.size(0) <= 1 || x.stride(1) == 1 || K == 1,
                    kernel, ": x's rows must be dense (stride(1) == 1)");
}

// The bias as the kernels read it: undefined (none), or N contiguous bf16 or fp32 values
// (other float types are converted to fp32).
inline at::Tensor linear_bias(const std::optional<at::Tensor>& bias_opt, int64_t N,
                              const char* kernel) {
  if (!bias_opt.has_value() || !bias_opt->defined()) return at::Tensor();
  at::Tensor bias = *bias_opt;
  TORCH_CHECK_VALUE(bias.device().is_cpu() && bias.is_floating_point() && bias.numel() == N,
                    kernel, ": bias must be a float CPU tensor of ", N, " elements, got ",
                    bias.scalar_type(), " ", bias.sizes());
  if (bias.scalar_type() != at::kBFloat16) bias = bias.to(at::kFloat);
  return bias.contiguous();
}

// The epilogue arguments of a linear of M rows and N output columns (linear_epilogue.h):
// swiglu needs a block-interleaved [gate | up] weight, N % 32 == 0; rotary comes as cos, sin
// ([M, 32] bf16 CPU rows) and rotary_cols, a multiple of 64 within N (heads of 64 dims), with
// N % 32 == 0 and without swiglu.
inline void linear_epilogue_args(int64_t M, int64_t N, bool swiglu,
                                 const std::optional<at::Tensor>& cos_opt,
                                 const std::optional<at::Tensor>& sin_opt, int64_t rotary_cols,
                                 const char* kernel) {
  TORCH_CHECK_VALUE(!swiglu || N % 32 == 0, kernel, ": the swiglu epilogue needs a "
                    "block-interleaved [gate | up] weight, N % 32 == 0; got N = ", N);
  TORCH_CHECK_VALUE(cos_opt.has_value() == sin_opt.has_value() &&
                    cos_opt.has_value() == (rotary_cols > 0),
                    kernel, ": the rotary epilogue takes cos, sin and rotary_cols > 0 together");
  if (rotary_cols <= 0) return;
  TORCH_CHECK_VALUE(!swiglu && rotary_cols % 64 == 0 && rotary_cols <= N && N % 32 == 0,
                    kernel, ": rotary_cols must be a multiple of 64 within N = ", N,
                    " (heads of 64 dims; N a multiple of 32), without swiglu; got ",
                    rotary_cols);
  for (const at::Tensor* t : {&*cos_opt, &*sin_opt})
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == M && t->size(1) == 32 &&
                      t->scalar_type() == at::kBFloat16 && t->device().is_cpu() &&
                      t->stride(1) == 1, kernel, ": cos / sin must be [", M, ", 32] bf16 "
                      "CPU rows with a contiguous last dim, got ", t->scalar_type(), " ",
                      t->sizes(), " strides ", t->strides());
}

// The rotary_cols of a qkv projection's rotary epilogue: its q and k heads' columns, 64 each
// (positive head counts).
inline int64_t rotary_qkv_cols(int64_t num_heads, int64_t num_kv_heads, const char* kernel) {
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0, kernel, ": need positive head counts, "
                    "got ", num_heads, " and ", num_kv_heads);
  return (num_heads + num_kv_heads) * 64;
}

// The rotary epilogue's product [M, (H + 2 KVH) * 64] as the attention takes it: views q
// [M, H, 64], k and v [M, KVH, 64].
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_views(const at::Tensor& qkv,
                                                                int64_t num_heads,
                                                                int64_t num_kv_heads,
                                                                const char* kernel) {
  constexpr int64_t kHeadDim = 64;
  const int64_t t = qkv.size(0), q_width = num_heads * kHeadDim,
                kv_width = num_kv_heads * kHeadDim;
  TORCH_CHECK_VALUE(qkv.size(1) == q_width + 2 * kv_width, kernel, ": the product is ",
                    qkv.sizes(), ", not [T, (", num_heads, " + 2*", num_kv_heads, ") * 64]");
  return std::make_tuple(qkv.narrow(1, 0, q_width).view({t, num_heads, kHeadDim}),
                         qkv.narrow(1, q_width, kv_width).view({t, num_kv_heads, kHeadDim}),
                         qkv.narrow(1, q_width + kv_width, kv_width)
                             .view({t, num_kv_heads, kHeadDim}));
}

// Causal prefill attention: q [T, H, D] (heads dense within a token row), k and v
// [KVH, S, D] with dense token rows, S == start + T (``tiled``: a tiled cache's planes, S >=
// start + T and S % 16 == 0), H a multiple of KVH, D a multiple of `dim_multiple` up to 256, a
// positive scale; all bf16 on CPU.
inline void prefill_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           int64_t start, double scale, int64_t dim_multiple,
                           const char* kernel, bool tiled = false) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, kernel, ": q, k, v must be 3-d");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, kernel, ": bf16 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), kernel,
              ": CPU tensors");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(0);
  TORCH_CHECK(q.stride(2) == 1 && (H == 1 || q.stride(1) == D),
              kernel, ": q heads must be dense within a token row");
  TORCH_CHECK(D % dim_multiple == 0 && D > 0 && D <= 256, kernel,
              ": head_dim must be a multiple of ", dim_multiple, " in [", dim_multiple,
              ", 256], got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, kernel, ": heads must be a multiple of kv heads");
  TORCH_CHECK(scale > 0 && scale < 1e6, kernel, ": scale must be positive (and sane)");
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D,
              kernel, ": k and v must both be [KVH, S, head_dim]");
  TORCH_CHECK(k.stride(2) == 1 && (k.size(1) <= 1 || k.stride(1) == D),
              kernel, ": k token rows must be dense");
  TORCH_CHECK(v.stride(2) == 1 && (v.size(1) <= 1 || v.stride(1) == D),
              kernel, ": v token rows must be dense");
  if (tiled) {  // a tiled cache's planes: at least start + T positions, in whole K blocks
    TORCH_CHECK(start >= 0 && k.size(1) >= start + T && k.size(1) % tiled::kKeyBlock == 0,
                kernel, ": tiled k/v must hold start + T positions, capacity % ",
                tiled::kKeyBlock, " == 0");
  } else {
    TORCH_CHECK(start >= 0 && k.size(1) == start + T, kernel, ": need S == start + T");
  }
}

}  // namespace alignedserve::checks
