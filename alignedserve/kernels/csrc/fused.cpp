// Fused bf16 elementwise kernels of the Llama block, on CPU: RMSNorm, residual add + RMSNorm,
// rotary embedding applied in place to the fused qkv rows, and SiLU(gate) * up.
//
// Each replaces a chain of PyTorch ops (alignedserve/model/ops.py has the references) that
// reads and writes [T, width] temporaries several times; here every row is read once and
// written once. Rows are independent and split over threads with at::parallel_for.
//
// Rounding contract: arithmetic is fp32 and the result is rounded to bf16 (round to nearest
// even, as c10::BFloat16 does) exactly where the PyTorch chain rounds, i.e. after every bf16
// op, so outputs are bit-identical to the reference, with two caveats:
//   * RMSNorm's sum of squares is accumulated in the order of ATen's cascade sum as torch
//     2.x x86 builds run it (8-lane AVX2 kernel, see sum_squares), so it matches bit for bit
//     there; an ATen that sums in another order moves the fp32 mean by an ulp now and then,
//     which flips a rare output by one bf16 ulp.
//   * SiLU's exp is a port of SLEEF's expf_u10 (the one ATen's vectorised exp calls, error
//     <= 1 ulp). ATen computes row tails (and, with its own thread split, arbitrary spans)
//     with std::exp instead, as does the portable build here, so a rare output can differ by
//     one bf16 ulp there.
// bf16 widening is exact (the bf16 bits are the high half of the fp32). Narrowing uses the
// integer RNE formula rather than vcvtneps2bf16, which flushes denormals to zero.
//
// Products are kept separate from sums on purpose (no FMA contraction: the extension is built
// with -std=c++20, where GCC leaves fp-contract off; vec.h's intrinsics say mul/add).

// Narrow includes on purpose: <torch/extension.h> alone takes ~30 s to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "release_gil.h"
#include "vec.h"  // Vec, vload / vstore / vround, vexp, bf16 helpers

namespace alignedserve {
namespace {

// Smallest per-thread chunk, in elements: below this the fork/join costs
// more than the second core saves, so small T (decode steps) stays single-threaded.
constexpr int64_t kGrainElems = 16384;

// ----------------------------------------------------------------------------------------------
// Row kernels. `n` is the row width in elements; pointers are to the row's first element.
// ----------------------------------------------------------------------------------------------

// ATen's utils::CeilLog2 (1 for x <= 2).
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// ATen's fp32 sum runs 8 lanes wide on x86, AVX-512 CPUs included (its dispatch picks the
// AVX2 kernel; checked against torch 2.13). The order below depends on that width.
constexpr int64_t kSumLanes = 8;

// sum(x^2) over the row in fp32, accumulated in exactly the order ATen's cascade sum uses for
// a contiguous fp32 row (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum), so
// the mean matches `h.pow(2).mean(-1)` bit for bit. ATen keeps 4 interleaved 8-lane
// accumulators (8-lane vector 4i+k goes to acc[k]) feeding a 4-level cascade, then adds the
// leftover vectors to acc[0], folds acc[1..3] into it, adds the scalar tail and finally the 8
// lanes in order. Here one 16-lane vector holds two of those accumulators: vector 2i covers
// acc[0] | acc[1] and 2i+1 covers acc[2] | acc[3], so the cascade runs on whole vectors.
float sum_squares(const uint16_t* x, int64_t n) {
  constexpr int64_t kLevels = 4;
  const int64_t nvec = n / kSumLanes;
  const int64_t rows = nvec / 4;  // ATen's ILP rows: 4 x 8 lanes = two 16-lane vectors
  const auto square = [x](int64_t v) {
    const Vec a = vload(x + v * kLanes, kLanes);
    return a * a;  // ATen materialises pow(2) before summing: no fused multiply-add
  };
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t step = int64_t{1} << power;
  const int64_t mask = step - 1;
  Vec acc[kLevels][2];
  for (auto& level : acc) level[0] = level[1] = vset1(0.0f);
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      acc[0][0] = acc[0][0] + square(2 * i);
      acc[0][1] = acc[0][1] + square(2 * i + 1);
    }
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < 2; ++k) {
        acc[j][k] = acc[j][k] + acc[j - 1][k];
        acc[j - 1][k] = vset1(0.0f);
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    acc[0][0] = acc[0][0] + square(2 * i);
    acc[0][1] = acc[0][1] + square(2 * i + 1);
  }
  for (int64_t j = 1; j < kLevels; ++j) {
    acc[0][0] = acc[0][0] + acc[j][0];
    acc[0][1] = acc[0][1] + acc[j][1];
  }
  // Back to ATen's four 8-lane accumulators for the short, order-sensitive finish.
  float part[2 * kLanes];
  vstore_f32(part, acc[0][0]);
  vstore_f32(part + kLanes, acc[0][1]);
  float* acc0 = part;
  for (int64_t v = rows * 4; v < nvec; ++v) {
    for (int64_t l = 0; l < kSumLanes; ++l) {
      const float f = bf16_to_float(x[v * kSumLanes + l]);
      const float sq = f * f;
      acc0[l] += sq;
    }
  }
  for (int64_t k = 1; k < 4; ++k) {
    for (int64_t l = 0; l < kSumLanes; ++l) acc0[l] += part[k * kSumLanes + l];
  }
  float total = 0.0f;
  for (int64_t e = nvec * kSumLanes; e < n; ++e) {
    const float f = bf16_to_float(x[e]);
    const float sq = f * f;
    total += sq;
  }
  for (int64_t l = 0; l < kSumLanes; ++l) total += acc0[l];
  return total;
}

// out = r(w * r(x * rsqrt(mean(x^2) + eps))).
void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
  const float mean = sum_squares(x, n) / static_cast<float>(n);
  const Vec inv = vset1(1.0f / std::sqrt(mean + eps));  // ATen's rsqrt is 1 / sqrt
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t m = n - j;
    vstore(out + j, vload(w + j, m) * vround(vload(x + j, m) * inv), m);
  }
}

// residual = r(residual + x) in place, then out = norm(residual).
void add_norm_row(const uint16_t* x, uint16_t* res, const uint16_t* w, uint16_t* out, int64_t n,
                  float eps) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t m = n - j;
    vstore(res + j, vload(res + j, m) + vload(x + j, m), m);
  }
  norm_row(res, w, out, n, eps);  // the row is in L1 now
}

// Rotate-half RoPE on `heads` consecutive heads of width 2*half, in place:
// x1' = r(r(x1*c) - r(x2*s)), x2' = r(r(x2*c) + r(x1*s)).
void rotary_row(uint16_t* row, const uint16_t* cos, const uint16_t* sin, int64_t heads,
                int64_t half) {
  for (int64_t j = 0; j < half; j += kLanes) {
    const int64_t m = half - j;
    const Vec c = vload(cos + j, m), s = vload(sin + j, m);
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* p1 = row + 2 * half * h + j;
      uint16_t* p2 = p1 + half;
      const Vec x1 = vload(p1, m), x2 = vload(p2, m);
      vstore(p1, vround(x1 * c) - vround(x2 * s), m);
      vstore(p2, vround(x2 * c) + vround(x1 * s), m);
    }
  }
}

// out = r(r(g / (1 + exp(-g))) * u) for gate g = row[:n], up u = row[n:2n].
void silu_mul_row(const uint16_t* gate_up, uint16_t* out, int64_t n) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t m = n - j;
    vstore(out + j, silu_times(vload(gate_up + j, m), vload(gate_up + n + j, m)), m);
  }
}

// ----------------------------------------------------------------------------------------------
// Entry points: checks, then rows split over threads.
// ----------------------------------------------------------------------------------------------

// Input checks raise ValueError in Python, like attention.cpp's.
#define FUSED_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

// Why t is not a matrix the row kernels take, or nullptr when it is: a [rows, width] bf16 CPU
// matrix with unit column stride (rows may have any stride). The one definition of what they
// take: check_rows raises it, fits_rows (the try_* entry points) tests it.
const char* rows_misfit(const at::Tensor& t, bool written) {
  if (t.dim() != 2) return "must be 2-d";
  if (t.scalar_type() != at::kBFloat16) return "must be bfloat16";
  if (!t.device().is_cpu()) return "must be on CPU";
  if (t.size(1) > 1 && t.stride(1) != 1) return "must have a contiguous last dim";
  // Rows written in place must not overlap, or two threads would race on them.
  if (written && t.size(0) > 1 && t.stride(0) < t.size(1)) return "has overlapping rows";
  return nullptr;
}

void check_rows(const char* fn, const char* name, const at::Tensor& t, bool written) {
  const char* why = rows_misfit(t, written);
  FUSED_CHECK(why == nullptr, fn, ": ", name, " ", why, " (", t.scalar_type(), ", sizes ",
              t.sizes(), ", strides ", t.strides(), ")");
}

bool fits_rows(const at::Tensor& t, bool written) { return rows_misfit(t, written) == nullptr; }

// Why w is not a weight the norms take (a contiguous bf16 CPU vector), or nullptr.
const char* weight_misfit(const at::Tensor& w) {
  if (w.dim() != 1) return "must be 1-d";
  if (w.scalar_type() != at::kBFloat16 || !w.device().is_cpu()) {
    return "must be a bfloat16 CPU tensor";
  }
  if (!w.is_contiguous()) return "must be contiguous";
  return nullptr;
}

void check_weight(const char* fn, const at::Tensor& w, int64_t width) {
  const char* why = weight_misfit(w);
  FUSED_CHECK(why == nullptr, fn, ": weight ", why);
  FUSED_CHECK(w.size(0) == width, fn, ": weight must be [", width, "], got ", w.sizes());
}

bool fits_weight(const at::Tensor& w) { return weight_misfit(w) == nullptr; }

int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(width, 1));
}

const uint16_t* row_ptr(const at::Tensor& t) {
  return static_cast<const uint16_t*>(t.const_data_ptr());
}
uint16_t* mut_row_ptr(const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows("rms_norm", "x", x, false);
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight("rms_norm", weight, n);
  at::Tensor out = at::empty({rows, n}, x.options());
  const uint16_t* xp = row_ptr(x);
  const uint16_t* wp = row_ptr(weight);
  uint16_t* op = mut_row_ptr(out);
  const int64_t xs = x.stride(0);
  const float e = static_cast<float>(eps);  // ATen adds a Python float as fp32
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * xs, wp, op + t * n, n, e);
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows("add_rms_norm", "x", x, false);
  check_rows("add_rms_norm", "residual", residual, true);
  FUSED_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x ", x.sizes(), " and residual ",
              residual.sizes(), " differ");
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight("add_rms_norm", weight, n);
  at::Tensor out = at::empty({rows, n}, x.options());
  const uint16_t* xp = row_ptr(x);
  uint16_t* rp = mut_row_ptr(residual);
  const uint16_t* wp = row_ptr(weight);
  uint16_t* op = mut_row_ptr(out);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      add_norm_row(xp + t * xs, rp + t * rs, wp, op + t * n, n, e);
    }
  });
  return out;
}

void rotary_qkv_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_rows("rotary_qkv_", "qkv", qkv, true);
  check_rows("rotary_qkv_", "cos", cos, false);
  check_rows("rotary_qkv_", "sin", sin, false);
  FUSED_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0,
              "rotary_qkv_: need positive heads and an even head_dim");
  const int64_t rows = qkv.size(0), half = head_dim / 2;
  FUSED_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "rotary_qkv_: qkv ",
              qkv.sizes(), " is not [T, (", num_heads, " + 2*", num_kv_heads, ") * ", head_dim,
              "]");
  FUSED_CHECK(cos.size(0) == rows && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rotary_qkv_: cos/sin must be [", rows, ", ", half, "], got ", cos.sizes(), " and ",
              sin.sizes());
  uint16_t* qp = mut_row_ptr(qkv);
  const uint16_t* cp = row_ptr(cos);
  const uint16_t* sp = row_ptr(sin);
  const int64_t qs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  const int64_t heads = num_heads + num_kv_heads;  // q then k; v is left alone
  at::parallel_for(0, rows, grain_rows(heads * head_dim), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      rotary_row(qp + t * qs, cp + t * cs, sp + t * ss, heads, half);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows("silu_mul", "gate_up", gate_up, false);
  FUSED_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up width ", gate_up.size(1), " is odd");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const uint16_t* gp = row_ptr(gate_up);
  uint16_t* op = mut_row_ptr(out);
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) silu_mul_row(gp + t * gs, op + t * n, n);
  });
  return out;
}

// Index of the first maximum of a bf16 row, or -1 when the row holds a NaN (the caller asks
// torch then, whose max treats NaN as largest). bf16 widens to fp32 exactly, so comparing the
// widened values is comparing the bf16 ones. Each lane keeps its first maximum (strict >); of
// the lanes holding the row's maximum the smallest index wins: the row's first maximum.
int64_t argmax_row(const uint16_t* x, int64_t n) {
#if defined(ALIGNEDSERVE_FUSED_AVX512)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_at = _mm512_set1_epi32(0);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(kLanes);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 valid = lanes(n - j);
    const __m512 v = _mm512_mask_mov_ps(best, valid, vload(x + j, n - j).r);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 up = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, up, v);
    best_at = _mm512_mask_mov_epi32(best_at, up, at);
    at = _mm512_add_epi32(at, step);
  }
  if (nan) return -1;
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(holders, best_at);
#else
  int64_t at = 0;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const float v = bf16_to_float(x[j]);
    if (std::isnan(v)) return -1;
    if (v > top) top = v, at = j;
  }
  return at;
#endif
}

// Greedy token per row: first argmax of each bf16 row of `logits` ([rows, vocab]); -1 marks a
// row holding a NaN.
at::Tensor argmax_rows(const at::Tensor& logits) {
  check_rows("argmax_rows", "logits", logits, false);
  const int64_t rows = logits.size(0), n = logits.size(1);
  FUSED_CHECK(n > 0 && n < (int64_t{1} << 31), "argmax_rows: need 0 < vocab < 2^31, got ", n);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const uint16_t* lp = row_ptr(logits);
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ls = logits.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) op[t] = argmax_row(lp + t * ls, n);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// The model's entry points (Kernels in alignedserve/kernels/dispatch.py): each op above, or
// nothing where the kernel does not take these tensors (not bf16 rows on CPU in the layout
// check_rows accepts, or autograd must see the op), so the caller runs the PyTorch reference.
// Deciding here costs a few C++ field reads; the same decision in Python took ~10 tensor
// attribute calls per op, each slow when a decode step's KV stream has just swept the caches.
// ---------------------------------------------------------------------------------------------

// True when autograd must record the op (the kernels have no backward).
bool wants_grad(std::initializer_list<const at::Tensor*> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors) {
    if (t->requires_grad()) return true;
  }
  return false;
}

std::optional<at::Tensor> try_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                       double eps) {
  if (!fits_rows(x, false) || !fits_weight(weight) || wants_grad({&x, &weight})) return {};
  return rms_norm(x, weight, eps);
}

std::optional<at::Tensor> try_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                           const at::Tensor& weight, double eps) {
  if (!fits_rows(x, false) || !fits_rows(residual, true) || !fits_weight(weight) ||
      wants_grad({&x, &residual, &weight}))
    return {};
  return add_rms_norm(x, residual, weight, eps);
}

// cos / sin may be [T, D/2] or the model's [T, 1, D/2]. Returns views of the rotated qkv:
// q [T, heads, D], k and v [T, kv_heads, D].
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> try_rotary_qkv(
    const at::Tensor& qkv, const at::Tensor& cos_in, const at::Tensor& sin_in,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const bool squeeze = cos_in.dim() == 3 && cos_in.size(1) == 1 && sin_in.dim() == 3;
  const at::Tensor cos = squeeze ? cos_in.squeeze(1) : cos_in;
  const at::Tensor sin = squeeze ? sin_in.squeeze(1) : sin_in;
  if (!fits_rows(qkv, true) || !fits_rows(cos, false) || !fits_rows(sin, false) ||
      wants_grad({&qkv, &cos, &sin}))
    return {};
  rotary_qkv_(qkv, cos, sin, num_heads, num_kv_heads, head_dim);
  const int64_t t = qkv.size(0), q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  return std::make_tuple(qkv.narrow(1, 0, q_width).view({t, num_heads, head_dim}),
                         qkv.narrow(1, q_width, kv_width).view({t, num_kv_heads, head_dim}),
                         qkv.narrow(1, q_width + kv_width, kv_width)
                             .view({t, num_kv_heads, head_dim}));
}

std::optional<at::Tensor> try_silu_mul(const at::Tensor& gate_up) {
  if (!fits_rows(gate_up, false) || wants_grad({&gate_up})) return {};
  return silu_mul(gate_up);
}

// Greedy tokens as a list, or nothing where the kernel does not take the logits (argmax has no
// gradient, so autograd does not matter here).
std::optional<std::vector<int64_t>> try_argmax_rows(const at::Tensor& logits) {
  if (!fits_rows(logits, false) || logits.size(1) == 0 || logits.size(1) >= (int64_t{1} << 31))
    return {};
  const at::Tensor tokens = argmax_rows(logits);
  const int64_t* p = tokens.const_data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + tokens.numel());
}

}  // namespace

void register_fused(pybind11::module_& m) {
  using pybind11::arg;
  m.def("rms_norm", &rms_norm, kReleaseGil,
        "out = r(w * r(x * rsqrt(mean(x^2) + eps))) per row (bf16).",
        arg("x"), arg("weight"), arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, kReleaseGil,
        "residual = r(residual + x) in place, then return rms_norm(residual) (bf16).", arg("x"),
        arg("residual"), arg("weight"), arg("eps"));
  m.def("rotary_qkv_", &rotary_qkv_, kReleaseGil,
        "Rotate-half RoPE in place on the q and k heads of each fused qkv row (bf16).",
        arg("qkv"), arg("cos"), arg("sin"), arg("num_heads"), arg("num_kv_heads"),
        arg("head_dim"));
  m.def("silu_mul", &silu_mul, kReleaseGil,
        "r(r(silu(gate)) * up) for gate_up = [gate | up] rows (bf16).",
        arg("gate_up"));
  m.def("try_rms_norm", &try_rms_norm, kReleaseGil,
        "rms_norm, or None where it does not take the inputs.",
        arg("x"), arg("weight"), arg("eps"));
  m.def("try_add_rms_norm", &try_add_rms_norm, kReleaseGil,
        "add_rms_norm, or None where it does not take the inputs.", arg("x"), arg("residual"),
        arg("weight"), arg("eps"));
  m.def("try_rotary_qkv", &try_rotary_qkv, kReleaseGil,
        "rotary_qkv_ (cos / sin also [T, 1, D/2]), then views (q, k, v) of qkv; or None where "
        "it does not take the inputs.",
        arg("qkv"), arg("cos"), arg("sin"), arg("num_heads"), arg("num_kv_heads"),
        arg("head_dim"));
  m.def("try_silu_mul", &try_silu_mul, kReleaseGil,
        "silu_mul, or None where it does not take the input.",
        arg("gate_up"));
  m.def("try_argmax_rows", &try_argmax_rows, kReleaseGil,
        "argmax_rows as a list, or None where it does not take the logits.", arg("logits"));
  m.def("argmax_rows", &argmax_rows, kReleaseGil,
        "First argmax of each bf16 row (int64); -1 where the row holds a NaN.", arg("logits"));
}

}  // namespace alignedserve
