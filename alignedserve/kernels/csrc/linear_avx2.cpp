// bf16 linear layer for AVX2 + FMA CPUs (x86-64-v3: no AVX-512, no bf16 dot product):
// y = x . W^T (+ bias). The sibling of csrc/linear_avx512.cpp, in fp32 FMA on 8-lane ymm
// vectors, with the weights kept in bf16 in memory (decode streams them: half the bytes of
// fp32) and widened in registers.
//
// Contract (checked in linear_avx2 below):
//   x      : [M, K] bf16 CPU, rows dense (stride(1) == 1; stride(0) free, so x may be a row
//            view of a bigger tensor; a single row may have any strides). Any M >= 0.
//   packed : pack_weight_avx2(W) for W [N, K] bf16, any N >= 1, K >= 1 (below 2^31). A 1-d
//            bf16 tensor: W's columns (output features) in NP = ceil(N / 16) panels of 16
//            (the last one padded with zero columns), each panel the whole depth in
//            KP = ceil(K / 2) steps of pairs; then a 64-byte trailer:
//              panel g starts at element g * KP * 32, and inside it
//              [p * 16 + c] * 2 + e  holds  W[16 g + c, 2 p + e]
//            (zero where the column is >= N or the depth >= K); the trailer is 32 bf16 slots
//            holding the int32 words {kMagic, N, K, 0, ...}, so linear_avx2 knows N and checks
//            K. A panel step is one 64-byte line: two ymm of 8 columns x (W[n, 2p] in the low
//            half of a 32-bit word, W[n, 2p + 1] in the high half). Widening is one
//            instruction per fp32 vector: the words with their low halves cleared (vpand) are
//            W[., 2p + 1] as fp32, the words shifted left by 16 (vpslld) are W[., 2p].
//   bias   : [N] bf16 or fp32 (other float types are converted to fp32), or None.
//   out    : [M, N] bf16, new and contiguous.
//
// Arithmetic, and why a row's result does not depend on its batch: every output element
// y[m, n] is one fp32 accumulator that starts at +0 and takes, for k = 0, 1, ..., K - 1 in
// order, one fused multiply-add of x[m, k] and W[n, k] (both exact in fp32); then the bias
// is added in fp32 and the sum rounded once to bf16 (round to nearest even, NaN -> 0x7FC0 as
// c10::BFloat16 does). Every kernel variant below (however many rows its register tile
// holds, whatever part of the matrix a thread takes) issues exactly this sequence for each
// element, so y[m] depends only on x[m] and W: not on M, on the other rows, on the thread
// count or on the work split. The products-and-sums are written as FMA instructions, so
// GCC's contraction of separate multiplies and adds has nothing to change.
//
// Speed. A register tile is R rows (1 .. 6) x one panel (16 columns: 2 R accumulators);
// per depth it widens the panel step's two weight vectors and broadcasts each row's x
// value (from an fp32 copy of the tile's rows, depth-major, so the broadcasts are one
// forward stream) into 2 R FMAs. Six rows (12 accumulators, 2 weights and 1 broadcast in
// 16 ymm registers) is the tile for many rows: 12 independent chains cover the FMA latency,
// with 2 widenings and 6 broadcasts per 12 FMAs. Rows are cut into ceil(M / 6) tiles of
// as equal sizes as can be (8 rows: 4 + 4, not 6 + 2).
// Each tile streams one panel, front to back: at decode shapes a linear layer is a stream
// of its weight from DRAM, and one forward stream per thread is what the hardware
// prefetchers serve best (tiles spanning several panels, panels wider than a line per step
// read in several passes, and software prefetches, whether one panel ahead or a few lines
// ahead, all made the stream slower). Each thread takes a contiguous range of panels, i.e.
// one run of weight memory front to back, and for each panel in its range runs its row
// tiles over it, in blocks of kBlockTiles tiles (part()). Where there are too few panels for
// the threads, they split the rows instead (split_rows()).
//
// Compiled everywhere; the kernel itself only where the compiler targets AVX2 and FMA (the
// x86-64-v3 build, and the AVX-512 builds, which have their own kernel). Elsewhere
// linear_avx2_available() is false and linear_avx2 throws (pack_weight_avx2 still packs).

// Narrow includes on purpose: <torch/extension.h> is slow to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "checks.h"
#include "release_gil.h"

#if defined(__AVX2__) && defined(__FMA__)
#define ALIGNEDSERVE_LINEAR_AVX2 1
#include <immintrin.h>
#endif

namespace alignedserve {
namespace {

constexpr int64_t kBlock = 8;           // output columns per ymm (fp32 lanes)
constexpr int64_t kPanel = 16;          // columns per panel: two blocks, one line per step
constexpr int64_t kTrailer = checks::kTrailer;  // bf16 slots (64 bytes) after the panels
constexpr int32_t kMagic = 0x4c415832;  // "2XAL": marks a tensor from pack_weight_avx2

bool available() {
#ifdef ALIGNEDSERVE_LINEAR_AVX2
  return true;
#else
  return false;
#endif
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef ALIGNEDSERVE_LINEAR_AVX2

constexpr int64_t kRows = 6;         // most rows in a row tile
constexpr int64_t kBlockTiles = 16;  // row tiles per block (part())
// Largest widened x block (bytes) a thread keeps allocated between calls.
constexpr size_t kKeepBytes = size_t{1} << 20;

struct Problem {
  const uint16_t* x;  // [M, K], row stride x_stride (elements)
  int64_t x_stride;
  const uint16_t* w;  // packed panels
  const void* bias;   // [N] or null
  bool bias_bf16;     // bias is bf16 (else fp32)
  uint16_t* out;      // [M, N]
  int64_t M, N, K, KP;
  int64_t TT;         // row tiles
};

// Row tiles: M rows in TT = ceil(M / kRows) tiles of as equal sizes as can be (so from four
// rows on no tile has fewer than three rows); tile t starts at row M * t / TT.
int64_t row_of(int64_t M, int64_t TT, int64_t t) { return M * t / TT; }
int64_t rows_in(int64_t M, int64_t TT, int64_t t) {
  return row_of(M, TT, t + 1) - row_of(M, TT, t);
}

// fp32 -> bf16 bits (low half of each lane), rounding to nearest even with NaN -> 0x7FC0:
// c10::BFloat16's conversion.
inline __m256i to_bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}

// The bias of the n (<= 8) columns from cc on as fp32 (+0 without a bias, and past N).
inline __m256 load_bias(const Problem& P, int64_t cc, int64_t n) {
  if (!P.bias) return _mm256_setzero_ps();
  if (n < kBlock) {
    alignas(32) float tmp[kBlock] = {};
    for (int64_t i = 0; i < n; ++i) {
      if (P.bias_bf16) {
        const uint32_t bits = static_cast<uint32_t>(
                                  static_cast<const uint16_t*>(P.bias)[cc + i]) << 16;
        std::memcpy(&tmp[i], &bits, 4);
      } else {
        tmp[i] = static_cast<const float*>(P.bias)[cc + i];
      }
    }
    return _mm256_load_ps(tmp);
  }
  if (P.bias_bf16) {
    const __m128i raw = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(P.bias) + cc));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(P.bias) + cc);
}

// acc + bias rounded to bf16, stored to the n (<= 8) columns at dst.
inline void store_bf16(uint16_t* dst, __m256 v, int64_t n) {
  const __m256i r = to_bf16_bits(v);
  const __m128i y = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  if (n >= kBlock) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), y);
  } else {
    alignas(16) uint16_t tmp[kBlock];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), y);
    std::memcpy(dst, tmp, n * 2);
  }
}

// acc + a * b, one fused multiply-add, in acc's register. Spelled in assembly so the accumulator
// keeps its register: with the intrinsic, GCC lets the product land in an input's register and
// renames the accumulators around the loop, which with 16 ymm registers ends in spills.
inline __m256 fma_into(__m256 acc, __m256 a, __m256 b) {
  asm("vfmadd231ps %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
}

// One register tile: x rows [m, m + R) (their fp32 copy at xt, depth-major: x[m + r, k] at
// xt[k * R + r]) x panel g (two blocks of 8 columns) over the whole depth; then bias, rounding
// and store. The arithmetic is the same for every R (file comment).
template <int R>
__attribute__((noinline)) void tile(const Problem& P, const float* xt, int64_t m, int64_t g) {
  constexpr int C = kPanel / kBlock;
  const uint16_t* w = P.w + g * P.KP * kPanel * 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));

  // Every loop over the R x C accumulators is fully unrolled, so they stay in registers.
  __m256 acc[R][C];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();

  // Depth k (x at xk) against the panel step ws, widened by `widen`: the C weight vectors
  // first, then each row's broadcast and its C FMAs (C + 1 inputs live beside the R x C
  // accumulators: 15 registers at six rows).
  auto depth = [&](const uint16_t* ws, const float* xk, auto widen) {
    __m256 t[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) t[c] = widen(ws + c * kBlock * 2);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(xk + r);
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c] = fma_into(acc[r][c], b, t[c]);
    }
  };
  // W[., 2p] is the low half of each word, W[., 2p + 1] the high half.
  auto even = [](const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  };
  auto odd = [high](const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_castsi256_ps(_mm256_and_si256(v, high));
  };

  const int64_t full = P.K / 2;  // complete pairs
  const uint16_t* ws = w;
  const float* xk = xt;
  for (int64_t p = 0; p < full; ++p, ws += kPanel * 2, xk += 2 * R) {
    depth(ws, xk, even);
    depth(ws, xk + R, odd);
  }
  if (P.K & 1) depth(ws, xk, even);  // the last, half pair

  // Bias (or +0), one rounding, store (not the padding columns past N).
#pragma GCC unroll 2
  for (int c = 0; c < C; ++c) {
    const int64_t cc = g * kPanel + c * kBlock;
    const int64_t n = std::min<int64_t>(kBlock, P.N - cc);
    if (n <= 0) break;
    const __m256 bias = load_bias(P, cc, n);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
      store_bf16(P.out + (m + r) * P.N + cc, _mm256_add_ps(acc[r][c], bias), n);
  }
}

// Row tile t's R rows of x (from row m on) widened to fp32 at d, depth-major: x[m + r, k] at
// d[k * R + r], so the register tile's broadcasts are one forward stream (and rows 4 KiB
// apart in x cannot alias in L1). Eight depths at a time: the R rows' vectors are
// transposed as an 8 x 8 block (rows past R are zeros) and each depth's R values stored as
// a full vector, which the next depth's store overwrites past R (d has 8 floats of slack).
template <int R>
void widen_tile(const Problem& P, int64_t m, float* d) {
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) s[r] = P.x + (m + r) * P.x_stride;
  int64_t k = 0;
  for (; k + 8 <= P.K; k += 8) {
    __m256 v[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r)
      v[r] = r < R ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(s[r] + k))), 16))
                   : _mm256_setzero_ps();
    // 8 x 8 transpose: rows (r) of depths -> rows (k) of row values.
    const __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    const __m256 out[8] = {
        _mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b1, b5, 0x20),
        _mm256_permute2f128_ps(b2, b6, 0x20), _mm256_permute2f128_ps(b3, b7, 0x20),
        _mm256_permute2f128_ps(b0, b4, 0x31), _mm256_permute2f128_ps(b1, b5, 0x31),
        _mm256_permute2f128_ps(b2, b6, 0x31), _mm256_permute2f128_ps(b3, b7, 0x31)};
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(d + (k + j) * R, out[j]);
  }
  for (; k < P.K; ++k)
    for (int r = 0; r < R; ++r) {
      const uint32_t bits = static_cast<uint32_t>(s[r][k]) << 16;
      std::memcpy(d + k * R + r, &bits, 4);
    }
}

// Row tiles [t0, t1) widened at dst, one after the other (widen_tile()).
void widen_tiles(const Problem& P, int64_t t0, int64_t t1, float* dst) {
  const int64_t base = row_of(P.M, P.TT, t0);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t m = row_of(P.M, P.TT, t);
    float* d = dst + (m - base) * P.K;
    switch (rows_in(P.M, P.TT, t)) {
      case 1: widen_tile<1>(P, m, d); break;
      case 2: widen_tile<2>(P, m, d); break;
      case 3: widen_tile<3>(P, m, d); break;
      case 4: widen_tile<4>(P, m, d); break;
      case 5: widen_tile<5>(P, m, d); break;
      default: widen_tile<6>(P, m, d); break;
    }
  }
}

// Row tile t (its fp32 rows at xt) x panel g.
void run_tile(const Problem& P, int64_t t, const float* xt, int64_t g) {
  const int64_t m = row_of(P.M, P.TT, t);
  switch (rows_in(P.M, P.TT, t)) {
    case 1: return tile<1>(P, xt, m, g);
    case 2: return tile<2>(P, xt, m, g);
    case 3: return tile<3>(P, xt, m, g);
    case 4: return tile<4>(P, xt, m, g);
    case 5: return tile<5>(P, xt, m, g);
    default: return tile<6>(P, xt, m, g);
  }
}

// Row tiles [t0, t1) x panels [g0, g1). The tiles go in blocks of kBlockTiles, each widened
// into a buffer of the thread's own; for each block, panel after panel, every row tile of the
// block over the panel: the panel comes from memory once per block and stays in L1/L2 while
// the tiles reuse it; the block's rows stay in L2 (or L3, for long rows) while the panels
// pass.
void part(const Problem& P, int64_t t0, int64_t t1, int64_t g0, int64_t g1) {
  const size_t need =
      static_cast<size_t>(std::min(t1 - t0, kBlockTiles) * kRows * P.K + kBlock);
  static thread_local std::vector<float> kept;
  std::vector<float> own;
  std::vector<float>& buffer = need * sizeof(float) <= kKeepBytes ? kept : own;
  if (buffer.size() < need) buffer.resize(need);
  for (int64_t tb = t0; tb < t1; tb += kBlockTiles) {
    const int64_t te = std::min(t1, tb + kBlockTiles);
    widen_tiles(P, tb, te, buffer.data());
    const int64_t base = row_of(P.M, P.TT, tb);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t t = tb; t < te; ++t)
        run_tile(P, t, buffer.data() + (row_of(P.M, P.TT, t) - base) * P.K, g);
  }
}

// How T threads share TT row tiles x NP panels: a grid of tm tile ranges x tn panel ranges
// (tm * tn = T). A part costs its panels times (its rows plus what streaming a panel from
// memory costs, in rows of arithmetic): few rows favour splitting the columns (each weight
// read once), many rows over few panels favour splitting the rows.
int64_t split_rows(int64_t M, int64_t TT, int64_t NP, int64_t T) {
  constexpr int64_t kStreamRows = 4;
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t tm = 1; tm <= std::min(T, TT); ++tm) {
    if (T % tm) continue;
    const int64_t rows = std::min(M, ceil_div(TT, tm) * kRows);
    const int64_t cost = ceil_div(NP, T / tm) * (rows + kStreamRows);
    if (cost < best_cost) best = tm, best_cost = cost;
  }
  return best;
}

#endif  // ALIGNEDSERVE_LINEAR_AVX2

at::Tensor pack_weight_avx2(const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
                    "pack_weight_avx2: need a 2-d bf16 CPU weight [N, K], got ",
                    w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK_VALUE(N > 0 && K > 0 && N < INT32_MAX && K < INT32_MAX,
                    "pack_weight_avx2: bad weight shape ", w.sizes());
  const int64_t NP = ceil_div(N, kPanel), KP = ceil_div(K, 2);
  const at::Tensor src = w.contiguous();
  at::Tensor packed = at::empty({NP * KP * kPanel * 2 + kTrailer}, w.options());
  const auto* s = reinterpret_cast<const uint16_t*>(src.data_ptr());
  auto* d = reinterpret_cast<uint16_t*>(packed.data_ptr());
  for (int64_t g = 0; g < NP; ++g)
    for (int64_t p = 0; p < KP; ++p)
      for (int64_t c = 0; c < kPanel; ++c)
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t n = g * kPanel + c, k = 2 * p + e;
          *d++ = n < N && k < K ? s[n * K + k] : 0;
        }
  checks::write_trailer(d, kMagic, N, K);
  return packed;
}

at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias_opt) {
  TORCH_CHECK_VALUE(available(), "linear_avx2: this build has no AVX2 + FMA kernel");
  const auto [N, K] = checks::packed_shape(packed, kMagic, kPanel, "linear_avx2",
                                           "pack_weight_avx2");
  checks::linear_input(x, K, "linear_avx2");
  const at::Tensor bias = checks::linear_bias(bias_opt, N, "linear_avx2");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef ALIGNEDSERVE_LINEAR_AVX2
  if (M == 0) return out;
  // One row (or K == 1) may come with any strides; make it dense.
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t x_stride = M == 1 ? K : rows.stride(0);
  const int64_t TT = ceil_div(M, kRows);
  const Problem P{reinterpret_cast<const uint16_t*>(rows.data_ptr()), x_stride,
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  bias.defined() ? bias.data_ptr() : nullptr,
                  bias.defined() && bias.scalar_type() == at::kBFloat16,
                  reinterpret_cast<uint16_t*>(out.data_ptr()),
                  M, N, K, ceil_div(K, 2), TT};
  const int64_t NP = ceil_div(N, kPanel);
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NP * TT));
  const int64_t tm = split_rows(M, TT, NP, T), tn = T / tm;
  at::parallel_for(0, T, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {  // hi > lo + 1 only where the region runs serially
      const int64_t i = t / tn, jn = t % tn;
      part(P, TT * i / tm, TT * (i + 1) / tm, NP * jn / tn, NP * (jn + 1) / tn);
    }
  });
#endif
  return out;
}

}  // namespace

void register_linear_avx2(pybind11::module_& m) {
  using pybind11::arg;
  m.def("linear_avx2_available", &available,
        "True when this build has the AVX2 + FMA linear kernel.");
  m.def("pack_weight_avx2", &pack_weight_avx2, kReleaseGil,
        "W [N, K] bf16 -> the 1-d packed layout linear_avx2 takes (16-column panels of "
        "pair-interleaved depth steps, then a trailer holding N and K).",
        arg("weight"));
  m.def("linear_avx2", &linear_avx2, kReleaseGil,
        "y = x . W^T + bias in bf16 (fp32 FMA accumulation in depth order, one rounding); a "
        "row's result does not depend on the batch it is in.",
        arg("x"), arg("packed"), arg("bias") = pybind11::none());
}

}  // namespace alignedserve
