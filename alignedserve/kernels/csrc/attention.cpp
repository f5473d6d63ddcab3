// Decode attention (one new token per request) over per-request KV caches, on CPU.
//
// Contract (checked in decode_attention below):
//   cache[b] : [layers, 2, kv_heads, capacity, head_dim], bf16, fp32 or fp8 e5m2 (an 8-bit KV
//              cache: the high byte of an fp16), one dtype for all rows;
//              the last two dims densely packed (token stride == head_dim); dims 0..2 may be
//              strided, so a row view of a larger cohort slab works too.
//   q        : [B, heads, head_dim], any float dtype; k_new / v_new : [B, kv_heads, head_dim].
//              Rows may be any distance apart when each row's heads are dense (views of a
//              fused qkv projection are read in place); otherwise they are copied first.
//   returns  : [B, heads, head_dim] in q's dtype (bf16 written directly, no fp32 pass).
//   For every row b the new K/V land at cache[b][layer, 0/1, :, pos[b]], then query head h
//   attends over positions 0..pos[b] of kv head h / (heads / kv_heads), in fp32 arithmetic.
//   tiled = true: bf16 caches in the tile layout of alignedserve/kernels/kv_layout.py
//   (capacity % 16 == 0, head_dim 64), read with AMX tiles, AVX512-BF16 dot products or, on
//   AVX2, fp32 FMA (further down); q is rounded to bf16, and for the bf16 products so are the
//   probabilities. row_units = true: the dot-product kernel may take a call of many rows as
//   row units (below); read_ahead > 0: its per-head items request that many bytes ahead of
//   their reads ("Software prefetch"). The result is the same either way; only how the kernel
//   reads differs.
//
// Work decomposition: one work item is (row, kv head, token span). All query heads of a GQA
// group are handled by the same item so each K/V row is read from memory once. Items are
// sorted longest-first and pulled from an atomic counter (dynamic LPT scheduling), because row
// lengths in a batch can differ by 50x and a static split would leave a core idle. Rows longer
// than kSpan are cut into fixed spans whose partial softmax states are merged at the end, in
// span order (the split-K "flash decoding" combine). Where a row is cut depends on its own
// length only, so its result does not depend on the batch (batch invariance). Where the
// caller asks (`row_units`), the AVX512-BF16 dot-product kernel takes a call of many rows as
// row units instead: every kv head of one (row, span) in one item, its planes read side by
// side ("Row units" below); each result is the same sum in the same order either way.
//
// Inside an item: pass 1 computes the scores of all heads of the group (16 tokens per score
// vector), pass 2 takes the softmax over the span's score buffer (small: it stays in L1/L2),
// pass 3 accumulates P.V. Passes 1 and 3 each stream the span's rows once, widening every row
// into registers and using it for all heads; apart from the scores nothing is written per
// token. Scores live in the log2 domain (q is pre-scaled by scale*log2(e)), so pass 2 needs
// only 2^x. Each row's new token is written (append_if_last) by the item whose span ends at it,
// just before that item reads the span.
//
// Arithmetic is fp32 FMA throughout; bf16 and fp8 e5m2 are widened exactly (shift / mask, or
// byte shift + fp16 convert). AVX512-BF16 dot products were tried and dropped: on the Sapphire
// Rapids this was tuned on, vdpbf16ps issues every ~2 cycles, half the multiply rate of the two
// FMA ports. Prefetching a few lines ahead inside a stream measured no gain over the hardware
// prefetchers; requesting the next item's rows, and for bf16 this item's V during its score
// pass, does help the token-major, FMA and AMX kernels (see "Software prefetch" below). The
// AVX512-BF16 dot-product kernel reads each span's K and V in ascending order; where the caller
// asks, it keeps a fixed distance requested ahead of that read. An AMX version of both products
// (scores as K . Q^T tiles, P.V on bf16 P) was tried and was no faster cold: tile stores,
// gathers out of token-major score tiles and building V's pair layout per block cost what the
// FMAs did.

// Narrow includes on purpose: <torch/extension.h> alone takes ~30 s to compile; these ~8 s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include "amx.h"  // defines ALIGNEDSERVE_AMX where the build targets AMX-BF16
#include "release_gil.h"
#include "tiled_layout.h"
#include "work_queue.h"

namespace alignedserve {
namespace {

constexpr int kLanes = 16;          // fp32 lanes per vector == tokens per score block
constexpr int kMaxChunks = 16;      // head_dim <= 256 (vectors per head row)
// Rows longer than this are cut into spans of this many tokens (a multiple of 16), merged in
// span order: long enough that merging costs little, short enough that a span's score buffer
// stays L1/L2-resident and one long row still spreads over the threads.
constexpr int64_t kSpan = 2048;
constexpr double kLog2e = 1.4426950408889634;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Polynomial 2^f on f in [-0.5, 0.5] (the vector flavours' vexp2): Taylor coefficients of
// e^(f ln2), degree 7; truncation error ~5e-9 relative, below fp32 rounding.
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kC2 = kLn2 * kLn2 / 2;
constexpr float kC3 = kC2 * kLn2 / 3;
constexpr float kC4 = kC3 * kLn2 / 4;
constexpr float kC5 = kC4 * kLn2 / 5;
constexpr float kC6 = kC5 * kLn2 / 6;
constexpr float kC7 = kC6 * kLn2 / 7;

// bf16 -> fp32 (exact).
inline float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ----------------------------------------------------------------------------------------------
// 16-lane fp32 vector. AVX-512 when the compiler targets it, two ymm registers on AVX2 + FMA,
// otherwise plain arrays for the compiler to vectorise as it can; the kernel is written only
// against this small interface.
// ----------------------------------------------------------------------------------------------
#if defined(__AVX512F__)

struct Vec {
  __m512 r;
};
// Vector registers in Vec units (32 zmm), for the passes' register budgets.
constexpr int kVecRegisters = 32, kRegistersPerVec = 1;
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec vload(const uint16_t* p) {
  // A bf16 value is the high half of the fp32 with the same bits, so widening is exact.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
// 16 fp8 e5m2 values: each is the high byte of the fp16 with the same value, so widening to
// fp16 is a byte shift and the fp16 -> fp32 conversion is exact.
inline Vec vload(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8))};
}
// 32 bf16 at p as fp32 vectors of the even- and odd-indexed elements. Each 32-bit word holds
// an (even, odd) pair, so one shift / one mask per 16 values does the widening, half the
// work of vload(const uint16_t*).
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even.r = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd.r = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(~0xFFFF)));
}
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v.r); }
inline Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.r, b.r)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm512_sub_ps(a.r, b.r)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.r, b.r)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.r, b.r)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a.r); }
inline float vhmax(Vec a) { return _mm512_reduce_max_ps(a.r); }

inline Vec vexp2(Vec x) {
  // Clamp first: -inf (padding lanes) would give inf - inf = NaN below; 2^-150 scales to 0.
  const __m512 xc = _mm512_max_ps(x.r, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(kC7);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kLn2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return {_mm512_scalef_ps(p, n)};
}

// One level of the 16-way transpose-and-add. Lanes whose `Off` bit is set take input b, the
// others input a; each lane adds its partner `Off` lanes away. Folding 16 vectors with levels
// 1, 2, 4, 8 leaves lane i holding the horizontal sum of input i: 15 (blend, permute, add)
// triples per 16 dot products instead of 16 full horizontal reductions.
template <int Off>
inline Vec fold(Vec a, Vec b) {
  static_assert(Off == 1 || Off == 2 || Off == 4 || Off == 8, "fold levels are 1, 2, 4, 8");
  constexpr __mmask16 kFromB = Off == 1 ? 0xAAAA : Off == 2 ? 0xCCCC : Off == 4 ? 0xF0F0 : 0xFF00;
  alignas(64) static constexpr int32_t kPartner[16] = {
#define AS_PARTNER(j) (((j) & Off) ? 16 + (j) - Off : (j) + Off)
      AS_PARTNER(0),  AS_PARTNER(1),  AS_PARTNER(2),  AS_PARTNER(3),
      AS_PARTNER(4),  AS_PARTNER(5),  AS_PARTNER(6),  AS_PARTNER(7),
      AS_PARTNER(8),  AS_PARTNER(9),  AS_PARTNER(10), AS_PARTNER(11),
      AS_PARTNER(12), AS_PARTNER(13), AS_PARTNER(14), AS_PARTNER(15)};
#undef AS_PARTNER
  const __m512i idx = _mm512_load_si512(kPartner);
  const __m512 own = _mm512_mask_blend_ps(kFromB, a.r, b.r);
  const __m512 partner = _mm512_permutex2var_ps(a.r, idx, b.r);
  return {_mm512_add_ps(own, partner)};
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Two ymm registers per 16-lane vector (lanes 0..7 in lo, 8..15 in hi): the same interface and
// the same lane-wise arithmetic as the AVX-512 version, so the kernel below is unchanged. (The
// portable arrays that this replaces on AVX2 builds were left mostly scalar by GCC.)

struct Vec {
  __m256 lo, hi;
};
// Vector registers in Vec units (16 ymm, two per Vec), for the passes' register budgets.
constexpr int kVecRegisters = 8, kRegistersPerVec = 2;
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Vec vload(const uint16_t* p) { return {widen_bf16x8(p), widen_bf16x8(p + 8)}; }
// fp8 e5m2 is the high byte of an fp16 (see the AVX-512 version).
inline __m256 widen_e5m2x8(__m128i raw) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
}
inline Vec vload(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {widen_e5m2x8(raw), widen_e5m2x8(_mm_srli_si128(raw, 8))};
}
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i high = _mm256_set1_epi32(~0xFFFF);
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(w0, high)),
         _mm256_castsi256_ps(_mm256_and_si256(w1, high))};
}
inline void vstore(float* p, Vec v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#define ALIGNEDSERVE_LANEWISE(name, op) \
  inline Vec name(Vec a, Vec b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
ALIGNEDSERVE_LANEWISE(vadd, _mm256_add_ps)
ALIGNEDSERVE_LANEWISE(vsub, _mm256_sub_ps)
ALIGNEDSERVE_LANEWISE(vmul, _mm256_mul_ps)
ALIGNEDSERVE_LANEWISE(vmax, _mm256_max_ps)
#undef ALIGNEDSERVE_LANEWISE
inline Vec vfma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vsum(Vec a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vhmax(Vec a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The AVX-512 version's 2^x, with scalef's p * 2^n done as two multiplies by built powers of
// two (n in [-150, 128] splits into halves that are normal exponents; the first product is
// exact, so the result is rounded once, as scalef rounds it).
inline __m256 exp2_8(__m256 x) {
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-150.0f));
  const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(xc, n);
  __m256 p = _mm256_set1_ps(kC7);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC5));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kLn2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
inline Vec vexp2(Vec x) { return {exp2_8(x.lo), exp2_8(x.hi)}; }

// The AVX-512 fold: lane j becomes a[j] + a[j ^ Off] where bit Off of j is clear, else
// b[j] + b[j ^ Off]. Off 1, 2, 4 pair lanes inside a ymm (each as one add of two rearranged
// inputs: the same sums, so the same bits); Off 8 pairs lo with hi.
template <int Off>
inline __m256 fold8(__m256 a, __m256 b) {
  if constexpr (Off == 1) {  // hadd: a0+a1, a2+a3, b0+b1, b2+b3 per 128-bit half
    return _mm256_permute_ps(_mm256_hadd_ps(a, b), 0xD8);
  } else if constexpr (Off == 2) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
  } else {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
}
template <int Off>
inline Vec fold(Vec a, Vec b) {
  static_assert(Off == 1 || Off == 2 || Off == 4 || Off == 8, "fold levels are 1, 2, 4, 8");
  if constexpr (Off == 8) {
    return {_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.hi, b.lo)};
  } else {
    return {fold8<Off>(a.lo, b.lo), fold8<Off>(a.hi, b.hi)};
  }
}

#else  // portable path

struct Vec {
  float x[kLanes];
};
// The budgets as on AVX-512 (the compiler decides anyway).
constexpr int kVecRegisters = 32, kRegistersPerVec = 1;
inline Vec vset1(float v) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = v;
  return r;
}
inline Vec vzero() { return vset1(0.0f); }
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(r.x, p, sizeof r.x);
  return r;
}
inline Vec vload(const uint16_t* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = from_bf16(p[i]);
  return r;
}
// fp8 e5m2 -> fp32 through the fp16 it is the high byte of (exact; table built once).
inline float e5m2_to_float(uint8_t b) {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) {
      const int sign = v >> 7, exp = (v >> 2) & 0x1F, man = v & 3;
      float mag;
      if (exp == 0x1F) {
        mag = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      } else if (exp == 0) {
        mag = std::ldexp(static_cast<float>(man), -16);  // subnormal: man/4 * 2^-14
      } else {
        mag = std::ldexp(1.0f + man / 4.0f, exp - 15);
      }
      t[v] = sign ? -mag : mag;
    }
    return t;
  }();
  return table[b];
}
inline Vec vload(const uint8_t* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = e5m2_to_float(p[i]);
  return r;
}
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  for (int i = 0; i < kLanes; ++i) {
    even.x[i] = from_bf16(p[2 * i]);
    odd.x[i] = from_bf16(p[2 * i + 1]);
  }
}
inline void vstore(float* p, Vec v) { std::memcpy(p, v.x, sizeof v.x); }
#define ALIGNEDSERVE_LANEWISE(name, expr)           \
  inline Vec name(Vec a, Vec b) {                   \
    Vec r;                                          \
    for (int i = 0; i < kLanes; ++i) r.x[i] = expr; \
    return r;                                       \
  }
ALIGNEDSERVE_LANEWISE(vadd, a.x[i] + b.x[i])
ALIGNEDSERVE_LANEWISE(vsub, a.x[i] - b.x[i])
ALIGNEDSERVE_LANEWISE(vmul, a.x[i] * b.x[i])
ALIGNEDSERVE_LANEWISE(vmax, std::max(a.x[i], b.x[i]))
#undef ALIGNEDSERVE_LANEWISE
inline Vec vfma(Vec a, Vec b, Vec c) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return r;
}
inline float vsum(Vec a) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += a.x[i];
  return s;
}
inline float vhmax(Vec a) {
  float m = a.x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, a.x[i]);
  return m;
}
inline Vec vexp2(Vec a) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = std::exp2(a.x[i]);
  return r;
}
template <int Off>
inline Vec fold(Vec a, Vec b) {
  Vec r;
  for (int j = 0; j < kLanes; ++j) {
    r.x[j] = (j & Off) ? b.x[j] + b.x[j - Off] : a.x[j] + a.x[j + Off];
  }
  return r;
}

#endif

// ----------------------------------------------------------------------------------------------
// Problem description, work items, scratch memory
// ----------------------------------------------------------------------------------------------

// fp32 -> bf16, rounding to nearest even (NaN -> the canonical quiet NaN): c10::BFloat16's
// conversion, so a bf16 output is bit-identical to converting the fp32 one with torch.
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Everything the workers read. Immutable during the parallel region except through the
// disjoint per-item outputs (out rows, partial slots) and each (row, kv head)'s new token,
// which only the item ending at it writes (append_if_last) and reads.
struct Problem {
  int64_t heads, kv_heads, group, dim;
  float qscale;                  // scale * log2(e): scores come out in the log2 domain
  const float* q;                // [B, heads, dim], fp32 (token-major caches); rows q_row apart
  const uint16_t* q_bf16;        // [B, heads, dim], bf16 (tiled caches); rows q_row apart
  int64_t q_row;                 // elements between rows of q (a row view of a fused qkv)
  std::vector<char*> k_base;     // per row: &cache[layer, 0, 0, 0, 0]
  std::vector<char*> v_base;     // per row: &cache[layer, 1, 0, 0, 0]
  const int64_t* hstride = nullptr;  // per row: elements between kv heads (DecodeRows)
  const int64_t* pos;            // [B]
  const char* k_new;             // [B, kv_heads, dim], cache dtype: written by append_if_last
  const char* v_new;
  int64_t new_row;               // elements between rows of k_new and of v_new
  int64_t elem;                  // cache element size in bytes
  float* out;                    // [B, heads, dim], fp32, normalised; or, when null,
  uint16_t* out_bf16;            // the same in bf16 (rounded to nearest even, as torch does)
  float* part_acc;               // [slots, group, dim], unnormalised P.V of one span
  float* part_ml;                // [slots, 2, group]: max score (log2) and sum of 2^(s - max)
  int64_t read_ahead = 0;        // dot-product kernel: bytes requested ahead of its reads
};

// Element `index` of the normalised output, in whichever dtype the call returns.
inline void store_out(const Problem& P, int64_t index, float value) {
  if (P.out_bf16 != nullptr) {
    P.out_bf16[index] = to_bf16(value);
  } else {
    P.out[index] = value;
  }
}

// One unit of parallel work: kv head `kv_head` of row `row`, tokens [begin, end).
struct Item {
  int64_t row, kv_head, begin, end;
  int64_t slot;  // partial-result slot; -1 when the span is the whole row (write `out` directly)
};

// A (row, kv head) cut into `count` spans whose partial results sit in consecutive slots.
struct Split {
  int64_t row, kv_head, first_slot, count;
};

// Per-thread buffers, sized once per call for the longest span.
struct Scratch {
  std::vector<float> scores;   // [group, span rounded up to 16]
  std::vector<float> q;        // [group, dim], pre-scaled, in block layout
  std::vector<float> acc;      // [group, dim], block layout
  std::vector<float> acc_out;  // [group, dim], natural dim order
  std::vector<float> mx, sum;  // [group]: span max (log2 domain), sum of 2^(s - max)
  Scratch(int64_t group, int64_t dim, int64_t max_span)
      : scores(group * ((max_span + kLanes - 1) / kLanes * kLanes)),
        q(group * dim),
        acc(group * dim),
        acc_out(group * dim),
        mx(group),
        sum(group) {}
};

// Copies `rows` rows of `dim` floats, scaled, from natural dim order into block layout
// (inverse = false), or unscaled from block layout back to natural order (inverse = true).
// The layout is natural except for bf16 rows widened pairwise (vload_pairs): there each
// 32-dim chunk holds its 16 even dims, then its 16 odd ones. q is laid out like the rows it
// is dotted with (order doesn't matter to a dot product) and P.V's result is put back.
template <bool Pairs>
inline void to_block_layout(const float* src, int64_t rows, int64_t dim, float scale, float* dst,
                            bool inverse) {
  if constexpr (!Pairs) {
    for (int64_t i = 0; i < rows * dim; ++i) dst[i] = src[i] * scale;
    return;
  }
  for (int64_t c = 0; c < rows * dim; c += 32) {
    for (int j = 0; j < kLanes; ++j) {
      for (int odd = 0; odd < 2; ++odd) {
        const int64_t natural = c + 2 * j + odd, block = c + odd * kLanes + j;
        if (inverse) {
          dst[natural] = src[block] * scale;
        } else {
          dst[block] = src[natural] * scale;
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Software prefetch. A thread's work is compute-bound when its rows sit in cache (~2x the
// cold rate here) and stalls on DRAM when they do not: each item starts fresh streams that the
// hardware prefetchers pick up only after misses, and each pass streams one array at a time.
// So during an item's score pass a thread of the token-major, FMA or AMX kernel asks (into
// L2, a slice per score block) for
//   * the next item's K, so the next score pass starts on cached rows, and
//   * with 2- and 4-byte caches, this item's own V, so K and V stream from DRAM together and
//     the P.V pass reads V from L2 (faster, measured with benchmarks/attention_micro.py);
//   * with fp8 caches, the next item's V instead (fp8 is compute-bound, not bandwidth-bound:
//     there prefetching the current V measured slower, the next item's rows faster).
// The dot-product kernel takes no ranges. On Zen 4, with its K blocks read one after another,
// the hardware prefetchers alone fed it faster than any requested pattern when the memory had
// bandwidth to spare, and no slower when it had none; likely because a software request holds
// one of the core's few L1 miss buffers until its line arrives and the L2 prefetcher's requests
// do not (docs/results/2026-12-05-zen4-decode-attention-hardware-prefetch.md). On Zen 5 the
// opposite held for one pattern, a read-ahead: one line requested per line read, a fixed
// distance (8 KiB) ahead, through the item's K, its V and on into the next item's K, so no
// stream starts cold. It read faster than the hardware prefetchers alone
// (docs/results/2026-12-05-zen5-decode-read-ahead.md), so the caller asks for it per CPU
// (`read_ahead`, isa.decode_read_ahead).
// ----------------------------------------------------------------------------------------------

constexpr int64_t kLine = 64;

// Bytes [p, p + bytes) requested in equal slices, one slice per step().
struct PrefetchRange {
  const char* p = nullptr;
  int64_t bytes = 0;
  int64_t per_step = 0;

  inline void step() {
    const int64_t n = std::min(per_step, bytes);
    for (int64_t off = 0; off < n; off += kLine) __builtin_prefetch(p + off, 0, 2);
    p += n;
    bytes -= n;
  }
};

struct Prefetcher {
  std::array<PrefetchRange, 2> ranges{};
  int count = 0;

  // Adds a range spread over `steps` calls of step().
  void add(const void* p, int64_t bytes, int64_t steps) {
    const int64_t lines = (bytes + kLine - 1) / kLine;
    ranges[count++] = {static_cast<const char*>(p), bytes,
                       (lines + steps - 1) / std::max<int64_t>(steps, 1) * kLine};
  }
  inline void step() {
    for (int i = 0; i < count; ++i) ranges[i].step();
  }
};

// A cursor a fixed distance ahead of a thread's reads (the dot-product kernel's read-ahead):
// the regions it reads one after another (an item's K, its V, the next item's K) as one
// stream; step() requests the cursor's line into L1 and moves it one line on, so a kernel that
// steps once per line it reads keeps `distance` bytes requested ahead of itself, across the
// regions' ends too. Requests past the last region are dropped.
struct ReadAhead {
  std::array<const char*, 3> start{};
  std::array<int64_t, 3> bytes{};
  int count = 0, at = 0;  // regions added; the region the cursor is in
  // The cursor and the end of region `at`: step()'s common case is one compare, so a pass
  // that keeps its ReadAhead in a local (see dp_scores) holds both in registers. (Kept
  // behind the caller's pointer, each line's step was a chain of loads and stores, which
  // showed whenever the KV came from the caches.)
  const char* cur = nullptr;
  const char* end = nullptr;

  void add(const void* p, int64_t n) {
    if (n <= 0) return;
    start[count] = static_cast<const char*>(p);
    bytes[count++] = n;
  }
  // Puts the cursor `distance` bytes past the start of the first region (no requests: the
  // reads up to there are the hardware prefetchers', or an earlier item's requests).
  void begin(int64_t distance) {
    int64_t off = distance;
    while (at < count && off >= bytes[at]) off -= bytes[at++];
    if (at < count) {
      cur = start[at] + off;
      end = start[at] + bytes[at];
    }
  }
  inline void step() {
    if (__builtin_expect(cur >= end, 0)) {
      if (at >= count) return;  // past the last region (cur == end == null from here on)
      cur = ++at < count ? start[at] : nullptr;
      end = at < count ? start[at] + bytes[at] : nullptr;
      if (!cur) return;
    }
    __builtin_prefetch(cur, 0, 3);
    cur += kLine;
  }
};

// ----------------------------------------------------------------------------------------------
// Span kernels. Both passes stream a span's K (or V) rows once, widen each row into registers
// and use it for every query head of a chunk of the GQA group, so per token nothing is stored
// but the scores. Head counts per chunk are compile-time (NH) so all per-head state lives in
// the 32 vector registers.
// ----------------------------------------------------------------------------------------------

// Geometry of a head row: NC vectors of 16 floats. Known at compile time for the common head
// dims (strides become constant address offsets: a runtime stride costs register spills);
// NC = 0 reads it at run time for the uncommon ones.
template <int NC>
struct RowShape {
  static constexpr int kCap = NC ? NC : kMaxChunks;  // capacity of per-row vector arrays
  int nc_rt;
  int nc() const { return NC ? NC : nc_rt; }
  int64_t dim() const { return int64_t{nc()} * kLanes; }
};

// One row as fp32 vectors in block layout (see to_block_layout).
template <typename E, int NC, bool Pairs>
inline void load_row(RowShape<NC> rs, const E* row, Vec* out) {
  if constexpr (Pairs) {
    for (int c = 0; c < rs.nc(); c += 2) vload_pairs(row + c * kLanes, out[c], out[c + 1]);
  } else {
    for (int c = 0; c < rs.nc(); ++c) out[c] = vload(row + c * kLanes);
  }
}

// q[h] . row for NH heads (q in block layout); zeros when !valid, so a span's tail block
// never reads past the span (the next rows may lie beyond the tensor).
template <typename E, int NC, int NH, bool Pairs>
inline void dot_row(RowShape<NC> rs, const float* q, const E* row, bool valid, Vec* out) {
  if (!valid) {
    for (int h = 0; h < NH; ++h) out[h] = vzero();
    return;
  }
  Vec r[RowShape<NC>::kCap];
  load_row<E, NC, Pairs>(rs, row, r);
  for (int h = 0; h < NH; ++h) {
    const float* qh = q + h * rs.dim();
    Vec a = vmul(r[0], vload(qh));
    for (int c = 1; c < rs.nc(); ++c) a = vfma(r[c], vload(qh + c * kLanes), a);
    out[h] = a;
  }
}

// Scores of one 16-token block for NH heads, token by token. Each head's partial vectors are
// folded as soon as their partner exists (a binary counter over fold levels 1, 2, 4, 8), so at
// most five vectors per head are live. `cnt` < 16 only for a span's tail block (Full false).
template <typename E, int NC, int NH, bool Pairs, bool Full>
inline void score_block(RowShape<NC> rs, const float* q, const E* k, int cnt, float* scores,
                        int64_t score_stride) {
  Vec l1[NH], l2[NH], l3[NH];
  // Every level is written before it is read, but GCC 12 -O3 miscompiled the portable build
  // (wrong scores for NH >= 4) while these started uninitialised; zeroing costs nothing.
  for (int h = 0; h < NH; ++h) l1[h] = l2[h] = l3[h] = vzero();
#pragma GCC unroll 8
  for (int t = 0; t < kLanes; t += 2) {
    Vec x0[NH], x1[NH];
    dot_row<E, NC, NH, Pairs>(rs, q, k + t * rs.dim(), Full || t < cnt, x0);
    dot_row<E, NC, NH, Pairs>(rs, q, k + (t + 1) * rs.dim(), Full || t + 1 < cnt, x1);
    for (int h = 0; h < NH; ++h) {
      const Vec a = fold<1>(x0[h], x1[h]);
      if (t % 4 == 0) {
        l1[h] = a;
        continue;
      }
      const Vec b = fold<2>(l1[h], a);
      if (t % 8 == 2) {
        l2[h] = b;
        continue;
      }
      const Vec c = fold<4>(l2[h], b);
      if (t == 6) {
        l3[h] = c;
        continue;
      }
      vstore(scores + h * score_stride, fold<8>(l3[h], c));
    }
  }
}

// Pass 1 (scores) for NH heads over a span of n rows; the tail lanes of the last block are 0.
template <typename E, int NC, int NH, bool Pairs>
void score_span(RowShape<NC> rs, const float* q, const E* k, int64_t n, float* scores,
                int64_t score_stride, Prefetcher& pf) {
  int64_t t0 = 0;
  for (; t0 + kLanes <= n; t0 += kLanes) {
    pf.step();
    score_block<E, NC, NH, Pairs, true>(rs, q, k + t0 * rs.dim(), kLanes, scores + t0,
                                        score_stride);
  }
  if (t0 < n) {
    score_block<E, NC, NH, Pairs, false>(rs, q, k + t0 * rs.dim(), static_cast<int>(n - t0),
                                         scores + t0, score_stride);
  }
}

// Pass 3 (P.V) for NH heads over a span: acc[h] = sum_t p[h][t] * v[t], all NH * nc
// accumulators in registers. Short head chunks alternate two accumulator sets so enough
// independent FMA chains are in flight to hide the FMA latency.
template <typename E, int NC, int NH, bool Pairs>
void accumulate_span(RowShape<NC> rs, const float* p, int64_t p_stride, const E* v, int64_t n,
                     float* acc) {
  constexpr int kCap = RowShape<NC>::kCap;
  // Fewer than 8 independent FMA chains (vector registers) would leave the FMA latency
  // exposed: then two sets alternate.
  constexpr int kSets = NH * kCap * kRegistersPerVec < 8 ? 2 : 1;
  Vec a[kSets][NH][kCap];
  for (auto& set : a) {
    for (auto& head : set) {
      for (Vec& x : head) x = vzero();
    }
  }
  auto step = [&](int set, int64_t t) {
    Vec row[kCap];
    load_row<E, NC, Pairs>(rs, v + t * rs.dim(), row);
    for (int h = 0; h < NH; ++h) {
      const Vec w = vset1(p[h * p_stride + t]);
      for (int c = 0; c < rs.nc(); ++c) a[set][h][c] = vfma(w, row[c], a[set][h][c]);
    }
  };
  int64_t t = 0;
  for (; t + kSets <= n; t += kSets) {
    for (int set = 0; set < kSets; ++set) step(set, t + set);
  }
  for (; t < n; ++t) step(0, t);
  for (int h = 0; h < NH; ++h) {
    for (int c = 0; c < rs.nc(); ++c) {
      Vec total = a[0][h][c];
      for (int set = 1; set < kSets; ++set) total = vadd(total, a[set][h][c]);
      vstore(acc + h * rs.dim() + c * kLanes, total);
    }
  }
}

// Calls kernel(std::integral_constant<int, nh>{}) for 1 <= nh <= MaxNH, so the kernel gets
// its head count at compile time.
template <int MaxNH, typename Kernel>
void with_head_count(int nh, Kernel&& kernel) {
  if constexpr (MaxNH > 1) {
    if (nh < MaxNH) return with_head_count<MaxNH - 1>(nh, kernel);
  }
  kernel(std::integral_constant<int, MaxNH>{});
}

// Pass 1 for every head of the group, in chunks whose live vectors (five per head plus one
// row) fit the registers. K is re-read per chunk, from L1/L2 for all but the first.
template <typename E, int NC, bool Pairs>
void score_heads(RowShape<NC> rs, const float* q, const E* k, int64_t n, int64_t group,
                 float* scores, int64_t padded, Prefetcher& pf) {
  constexpr int kMaxHeads = std::max(1, (kVecRegisters - 6 - RowShape<NC>::kCap) / 5);
  for (int64_t h0 = 0; h0 < group; h0 += kMaxHeads) {
    const int nh = static_cast<int>(std::min<int64_t>(kMaxHeads, group - h0));
    with_head_count<kMaxHeads>(nh, [&](auto heads) {
      score_span<E, NC, decltype(heads)::value, Pairs>(rs, q + h0 * rs.dim(), k, n,
                                                       scores + h0 * padded, padded, pf);
    });
  }
}

// Pass 3 for every head of the group, in chunks whose accumulators (nc per head) fit the
// registers. V is re-read per chunk, from L1/L2 for all but the first.
template <typename E, int NC, bool Pairs>
void accumulate_heads(RowShape<NC> rs, const float* p, int64_t padded, const E* v, int64_t n,
                      int64_t group, float* acc) {
  constexpr int kMaxHeads = std::max(1, (kVecRegisters - 8) / RowShape<NC>::kCap);
  for (int64_t h0 = 0; h0 < group; h0 += kMaxHeads) {
    const int nh = static_cast<int>(std::min<int64_t>(kMaxHeads, group - h0));
    with_head_count<kMaxHeads>(nh, [&](auto heads) {
      accumulate_span<E, NC, decltype(heads)::value, Pairs>(rs, p + h0 * padded, padded, v, n,
                                                            acc + h0 * rs.dim());
    });
  }
}

// In-place softmax numerators over one head's padded score row; returns (max, sum).
inline std::pair<float, float> exponentiate(float* s, int64_t padded) {
  Vec m = vset1(kNegInf);
  for (int64_t t = 0; t < padded; t += kLanes) m = vmax(m, vload(s + t));
  const float mx = vhmax(m);
  const Vec mv = vset1(mx);
  Vec sum = vzero();
  for (int64_t t = 0; t < padded; t += kLanes) {
    const Vec e = vexp2(vsub(vload(s + t), mv));
    vstore(s + t, e);
    sum = vadd(sum, e);
  }
  return {mx, vsum(sum)};
}

// Pass 2 for a group: each head's score row (s.scores, `padded` apart) becomes its softmax
// numerators, the lanes from n on (padding, or tokens past the span) taking no weight; the
// row maxima and sums go to s.mx / s.sum.
inline void softmax_rows(Scratch& s, int64_t group, int64_t n, int64_t padded) {
  for (int64_t h = 0; h < group; ++h) {
    float* row = s.scores.data() + h * padded;
    std::fill(row + n, row + padded, kNegInf);
    std::tie(s.mx[h], s.sum[h]) = exponentiate(row, padded);
  }
}

// ----------------------------------------------------------------------------------------------
// One work item
// ----------------------------------------------------------------------------------------------

// Start of the item's K and V rows (the span's first token).
template <typename E>
inline std::pair<const E*, const E*> item_rows(const Problem& P, const Item& it) {
  const int64_t off = it.kv_head * P.hstride[it.row] + it.begin * P.dim;
  return {reinterpret_cast<const E*>(P.k_base[it.row]) + off,
          reinterpret_cast<const E*>(P.v_base[it.row]) + off};
}

// Tiled bf16 caches (tiled_layout.h): token t's K goes into column t % 16 of its 16-token block,
// its V into slot t % 2 of its token pair. `plane` is the kv head's [capacity, dim] plane.
inline void put_key_tiled(uint16_t* plane, int64_t t, const uint16_t* k, int64_t dim) {
  uint16_t* row = plane + tiled::key_row(t, dim);
  for (int64_t d = 0; d < dim; d += 2) std::memcpy(row + tiled::key_dim(d), k + d, 4);
}

inline void put_value_tiled(uint16_t* plane, int64_t t, const uint16_t* v, int64_t dim) {
  uint16_t* row = plane + tiled::value_row(t, dim);
  for (int64_t d = 0; d < dim; ++d) row[tiled::value_dim(d)] = v[d];
}

// Writes row `row`'s new K/V for kv head `g` at position pos[row]: k_new[row, g] / v_new[row, g]
// ([B, kv_heads, dim], cache dtype), in the tile layout when kTiled. Called by the one item
// whose span ends at pos[row] (no other span reads that position), just before it reads: so
// the writes run on all threads, and the lines they fetch are the ones that item reads next.
template <bool kTiled>
inline void append_if_last(const Problem& P, const Item& it) {
  const int64_t row = it.row;
  if (it.end != P.pos[row] + 1) return;
  const int64_t head = it.kv_head * P.hstride[row], src = row * P.new_row + it.kv_head * P.dim;
  if constexpr (kTiled) {
    const auto* k = reinterpret_cast<const uint16_t*>(P.k_new) + src;
    const auto* v = reinterpret_cast<const uint16_t*>(P.v_new) + src;
    put_key_tiled(reinterpret_cast<uint16_t*>(P.k_base[row]) + head, P.pos[row], k, P.dim);
    put_value_tiled(reinterpret_cast<uint16_t*>(P.v_base[row]) + head, P.pos[row], v, P.dim);
  } else {
    const int64_t bytes = P.dim * P.elem, dst = (head + P.pos[row] * P.dim) * P.elem;
    std::memcpy(P.k_base[row] + dst, P.k_new + src * P.elem, bytes);
    std::memcpy(P.v_base[row] + dst, P.v_new + src * P.elem, bytes);
  }
}

// Stores one finished span: normalised output, or the raw state for the later merge.
inline void finish_item(const Problem& P, const Item& it, const float* acc, const float* mx,
                        const float* sum) {
  const int64_t gd = P.group * P.dim;
  if (it.slot < 0) {
    const int64_t first = (it.row * P.heads + it.kv_head * P.group) * P.dim;
    for (int64_t h = 0; h < P.group; ++h) {
      const float inv = 1.0f / sum[h];
      for (int64_t d = 0; d < P.dim; ++d) {
        store_out(P, first + h * P.dim + d, acc[h * P.dim + d] * inv);
      }
    }
    return;
  }
  std::memcpy(P.part_acc + it.slot * gd, acc, gd * sizeof(float));
  float* ml = P.part_ml + it.slot * 2 * P.group;
  std::memcpy(ml, mx, P.group * sizeof(float));
  std::memcpy(ml + P.group, sum, P.group * sizeof(float));
}

template <typename E, int NC, bool Pairs>
void run_item(const Problem& P, const Item& it, Scratch& s, Prefetcher& pf) {
  const RowShape<NC> rs{static_cast<int>(P.dim / kLanes)};
  const int64_t dim = rs.dim(), group = P.group;
  append_if_last<false>(P, it);
  const auto [k, v] = item_rows<E>(P, it);
  const float* qsrc = P.q + it.row * P.q_row + it.kv_head * group * dim;
  to_block_layout<Pairs>(qsrc, group, dim, P.qscale, s.q.data(), false);

  const int64_t n = it.end - it.begin;
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  score_heads<E, NC, Pairs>(rs, s.q.data(), k, n, group, s.scores.data(), padded, pf);
  softmax_rows(s, group, n, padded);
  accumulate_heads<E, NC, Pairs>(rs, s.scores.data(), padded, v, n, group, s.acc.data());
  to_block_layout<Pairs>(s.acc.data(), group, dim, 1.0f, s.acc_out.data(), true);
  finish_item(P, it, s.acc_out.data(), s.mx.data(), s.sum.data());
}

// ----------------------------------------------------------------------------------------------
// Planning, scheduling, merging
// ----------------------------------------------------------------------------------------------

struct Plan {
  std::vector<Item> items;    // longest first
  std::vector<Split> splits;  // (row, kv head) pairs cut into several spans
  int64_t slots = 0;
  int64_t max_span = 0;
};

inline Plan plan_items(const int64_t* pos, int64_t rows, int64_t kv_heads, int64_t span) {
  Plan plan;
  plan.items.reserve(rows * kv_heads);
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t n = pos[b] + 1;
    const int64_t count = (n + span - 1) / span;
    for (int64_t g = 0; g < kv_heads; ++g) {
      if (count == 1) {
        plan.items.push_back({b, g, 0, n, -1});
        continue;
      }
      plan.splits.push_back({b, g, plan.slots, count});
      for (int64_t i = 0; i < count; ++i) {
        plan.items.push_back({b, g, i * span, std::min(n, (i + 1) * span), plan.slots++});
      }
    }
    plan.max_span = std::max(plan.max_span, std::min(n, span));
  }
  // Longest first; among equal lengths by row, span and kv head, so every kv head of one
  // (row, span) sits together: the row units below take them as consecutive runs.
  std::sort(plan.items.begin(), plan.items.end(), [](const Item& a, const Item& b) {
    const int64_t la = a.end - a.begin, lb = b.end - b.begin;
    if (la != lb) return la > lb;
    if (a.row != b.row) return a.row < b.row;
    if (a.begin != b.begin) return a.begin < b.begin;
    return a.kv_head < b.kv_head;
  });
  return plan;
}

// What to prefetch during item `cur`'s score blocks (see "Software prefetch"); `next` is the
// thread's next item or null; `slices` requests a block (the caller steps that often). Items
// are sorted longest first, so `next` is never longer and every block asks for at most a few
// lines per range.
template <typename E>
Prefetcher prefetch_for(const Problem& P, const Item& cur, const Item* next,
                        int64_t slices = 1) {
  const int64_t row_bytes = P.dim * static_cast<int64_t>(sizeof(E));
  const int64_t blocks = (cur.end - cur.begin + kLanes - 1) / kLanes * slices;
  Prefetcher pf;
  if (next != nullptr) {
    const auto [k, v] = item_rows<E>(P, *next);
    pf.add(k, (next->end - next->begin) * row_bytes, blocks);
    if constexpr (sizeof(E) == 1) pf.add(v, (next->end - next->begin) * row_bytes, blocks);
  }
  if constexpr (sizeof(E) > 1) {
    pf.add(item_rows<E>(P, cur).second, (cur.end - cur.begin) * row_bytes, blocks);
  }
  return pf;
}

// The threads pull items longest first (work_queue.h), each claiming its next item before
// computing the current one, so it can prefetch it.
template <typename E, int NC, bool Pairs>
void run_items(const Problem& P, const Plan& plan) {
  const auto n_items = static_cast<int64_t>(plan.items.size());
  each_thread_pulls([&](auto claim) {
    Scratch scratch(P.group, P.dim, plan.max_span);
    for_each_claimed_ahead(claim, n_items, [&](int64_t i, int64_t following) {
      Prefetcher pf = prefetch_for<E>(P, plan.items[i],
                                      following < n_items ? &plan.items[following] : nullptr);
      run_item<E, NC, Pairs>(P, plan.items[i], scratch, pf);
    });
  });
}

// ----------------------------------------------------------------------------------------------
// Tiled bf16 caches (layout: tiled_layout.h, kv_layout.py). Each kv head's [capacity, 64]
// plane keeps K in 16-token blocks stored [32 dim pairs][16 tokens][2] and V in token pairs
// stored [64 dims][2 tokens]: pairs of the summed dimension side by side, which is what both
// bf16 product instructions take, so K blocks and V pairs stream from the cache with no
// reshuffling per step. Three implementations of the same three passes:
//   * AMX tiles (AMX-BF16 CPUs):
//       scores  S = Q . K^T : A = the group's query rows (G x 32 dims, bf16), B = one K block
//               half (16 dim pairs x 16 tokens); one C tile row holds one head's 16 scores;
//       values  O = P . V   : A = P (G heads x 32 tokens, bf16), B = 16 token pairs x 16 dims;
//               four C tiles (64 dims) accumulate over the whole span.
//   * AVX512-BF16 dot products (vdpbf16ps, CPUs without AMX): one K block row is the 16 tokens'
//     values of one dim pair, so a head's 16 scores are 32 dot-product steps against its
//     broadcast q pair, with no horizontal sums (the token-major kernel above spends nearly as
//     many instructions on its transpose-and-add folds as on its products, plus the widening);
//     one V pair is four vectors of 16 (dim, token pair) lanes, multiplied by the broadcast
//     pair of probabilities. Used where AMX is not (built for AVX512-BF16, or not granted).
//   * fp32 FMA (AVX2 builds, which have no bf16 product): the same walk, each block row or V
//     chunk widened into the pair's two halves (a shift and a mask), each half multiplied by
//     one broadcast q value or probability; q and P stay fp32.
// The softmax between the products (fp32, log2 domain) is vector code over each head's score
// row; with AMX and AVX512-BF16, q and P are rounded to bf16 for the products, as the prefill
// kernels and torch's CPU flash attention do. Short rows gain less: each item then starts cold
// streams, and its fixed costs (three passes, the V tail) weigh more.
// ----------------------------------------------------------------------------------------------
constexpr int64_t kTiledDim = tiled::kDim;        // two 32-dim tiles
constexpr int64_t kKeyBlock = tiled::kKeyBlock;  // one score tile / vector of tokens
constexpr int64_t kPairBlock = 32;  // tokens per P.V round (a tile's pair depth)
// Query heads whose softmax state one item's scratch holds: a GQA group, or every head of a
// row unit.
constexpr int64_t kTiledMaxHeads = 16;

// One thread's share of a tiled call: it pulls items with `claim` (as run_items), and hands
// `run(item, next, scores_pf, values_pf)` its next item (or null) and two prefetchers, each
// measured faster on huge-page caches (alternating runs, docs/results/):
// the item's own V during its score blocks (as for token-major bf16), the next item's whole K
// during its value rounds of kPairBlock tokens; each paced in `slices` requests per score
// block or value round. (On 4 KiB pages, asking for the next K, or for the next round's lines
// into L1, had measured no gain.) slices == 0 hands two empty prefetchers (the dot-product
// kernel, which has its own read-ahead: see "Software prefetch").
template <typename Claim, typename RunItem>
void pull_tiled_items(const Problem& P, const Plan& plan, Claim&& claim, int64_t slices,
                      RunItem&& run) {
  const auto n_items = static_cast<int64_t>(plan.items.size());
  for_each_claimed_ahead(claim, n_items, [&](int64_t i, int64_t following) {
    const Item& it = plan.items[i];
    Prefetcher scores_pf, values_pf;
    if (slices > 0) scores_pf = prefetch_for<uint16_t>(P, it, nullptr, slices);
    if (slices > 0 && following < n_items) {  // never longer than `it`: sorted longest first
      const Item& nx = plan.items[following];
      values_pf.add(item_rows<uint16_t>(P, nx).first, (nx.end - nx.begin) * kTiledDim * 2,
                    (it.end - it.begin + kPairBlock - 1) / kPairBlock * slices);
    }
    run(it, following < n_items ? &plan.items[following] : nullptr, scores_pf, values_pf);
  });
}

// Prefetch requests per K block (score pass) and per P.V round of kPairBlock tokens (value
// pass) in the dot-product and FMA kernels of AVX-512 builds. Asked for at once, a block's
// share of the item's V (32 lines) or a round's share of the next item's K (64 lines) filled
// the line-fill buffers and the products stalled behind them; in four slices through the
// block or round the requests overlap the arithmetic (FMA kernel on the avx512 path:
// docs/results/2026-12-04-avx512-decode-values-one-pass.md; dot-product kernel on Zen 4:
// docs/results/2026-12-04-zen4-dp-prefetch-slices.md, since replaced by no requests at all).
// AVX2 builds and the AMX kernel keep one request a block or round, as they were measured.
#if defined(__AVX512F__)
constexpr int kPrefetchSlices = 4;
#else
constexpr int kPrefetchSlices = 1;
#endif
static_assert(kPairBlock / 2 % kPrefetchSlices == 0, "steps must divide a P.V round's pairs");

#if defined(__AVX512BF16__)

// Per-thread buffers, 64-byte aligned, sized for the longest span.
struct TiledScratch {
  std::vector<uint32_t> raw;
  int64_t padded_cap;  // score row length: longest span rounded up to kPairBlock
  float* scores;       // [group][padded_cap]
  uint16_t* probs;     // [group][padded_cap], bf16
  uint16_t* vtail;     // [kPairBlock * 64]: the last V pairs, zero past the span's end
  float* acc;          // [group][64]
  float mx[kTiledMaxHeads], sum[kTiledMaxHeads];

  TiledScratch(int64_t group, int64_t max_span)
      : padded_cap((max_span + kPairBlock - 1) / kPairBlock * kPairBlock) {
    const int64_t sizes[] = {group * padded_cap, group * padded_cap / 2, kPairBlock * 32,
                             group * kTiledDim};
    int64_t words = 16;
    for (int64_t n : sizes) words += (n + 15) / 16 * 16;
    raw.assign(words, 0u);
    auto* base = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63});
    uint32_t* parts[4];
    for (int i = 0; i < 4; ++i) {
      parts[i] = base;
      base += (sizes[i] + 15) / 16 * 16;
    }
    scores = reinterpret_cast<float*>(parts[0]);
    probs = reinterpret_cast<uint16_t*>(parts[1]);
    vtail = reinterpret_cast<uint16_t*>(parts[2]);
    acc = reinterpret_cast<float*>(parts[3]);
  }
};

// Pass 2: per head, softmax numerators 2^(scale * s - max) as bf16 into s.probs (0 past n);
// the max (log2 domain) and the fp32 sum go to s.mx / s.sum. Needs qscale > 0. The
// exponential is the prefill kernel's (amx::exp2_nonpos, relative error 2.9e-6 before P's
// bf16 rounding), cheaper than the exact one.
void tiled_softmax(int64_t group, int64_t n, int64_t padded, float qscale, TiledScratch& s) {
  const __m512 masked = _mm512_set1_ps(amx::kMaskedScore), scale = _mm512_set1_ps(qscale);
  for (int64_t h = 0; h < group; ++h) {
    float* row = s.scores + h * padded;
    const int64_t tail = n / kLanes * kLanes;
    if (tail < n) {
      const auto valid = static_cast<__mmask16>((1u << (n - tail)) - 1);
      const __m512 scores = _mm512_load_ps(row + tail);
      _mm512_store_ps(row + tail, _mm512_mask_blend_ps(valid, masked, scores));
    }
    for (int64_t t = (n + kLanes - 1) / kLanes * kLanes; t < padded; t += kLanes) {
      _mm512_store_ps(row + t, masked);
    }
    __m512 m = masked;
    for (int64_t t = 0; t < padded; t += kLanes) m = _mm512_max_ps(m, _mm512_load_ps(row + t));
    const float mx = _mm512_reduce_max_ps(m) * qscale;
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    uint16_t* p = s.probs + h * padded;
    for (int64_t t = 0; t < padded; t += 2 * kLanes) {
      const __m512 lo = amx::exp2_nonpos(_mm512_fmsub_ps(_mm512_load_ps(row + t), scale, mv));
      const __m512 hi =
          amx::exp2_nonpos(_mm512_fmsub_ps(_mm512_load_ps(row + t + kLanes), scale, mv));
      sum = _mm512_add_ps(sum, _mm512_add_ps(lo, hi));
      _mm512_store_si512(p + t, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
    s.mx[h] = mx;
    s.sum[h] = _mm512_reduce_add_ps(sum);
  }
}

#ifdef ALIGNEDSERVE_AMX

// Tiles 0-1: G rows (Q halves, then P); 2-3: 16 rows (K, then V); 4-7: G rows (scores, then
// the four O accumulators). One configuration for both products, loaded once per call.
void configure_tiled_tiles(int64_t group) {
  amx::TileConfig cfg;
  const uint8_t rows[8] = {uint8_t(group), uint8_t(group), 16, 16,
                           uint8_t(group), uint8_t(group), uint8_t(group), uint8_t(group)};
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = rows[i];
    cfg.colsb[i] = 64;
  }
  asm volatile("" ::: "memory");  // see amx::configure_tiles
  _tile_loadconfig(&cfg);
}

// Pass 1: raw scores q.k of the span's n tokens into s.scores[h * padded + t] (t < n rounded
// up to 16; the rest unwritten). Two K blocks per round into score tiles 4 and 5.
void tiled_scores(const uint16_t* q, const uint16_t* k, int64_t n, int64_t padded,
                  TiledScratch& s, Prefetcher& pf) {
  _tile_loadd(0, q, kTiledDim * 2);
  _tile_loadd(1, q + 32, kTiledDim * 2);
  const int64_t full = n / kKeyBlock, stride = padded * 4;
  int64_t b = 0;
  for (; b + 1 < full; b += 2) {
    const uint16_t* kb = k + b * kKeyBlock * kTiledDim;
    pf.step();
    pf.step();
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(2, kb, 64);
    _tile_loadd(3, kb + 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 3);
    _tile_loadd(2, kb + 1024, 64);
    _tile_loadd(3, kb + 1536, 64);
    _tile_dpbf16ps(5, 0, 2);
    _tile_dpbf16ps(5, 1, 3);
    _tile_stored(4, s.scores + b * kKeyBlock, stride);
    _tile_stored(5, s.scores + (b + 1) * kKeyBlock, stride);
  }
  // A partial last block is read in place: the tokens past the span (inside the capacity, which
  // is whole blocks) may hold anything, even NaN bits, but a score column depends only on its
  // own token and tiled_softmax masks those columns (amx::kMaskedScore).
  for (; b * kKeyBlock < n; ++b) {
    const uint16_t* kb = k + b * kKeyBlock * kTiledDim;
    _tile_zero(4);
    _tile_loadd(2, kb, 64);
    _tile_loadd(3, kb + 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 3);
    _tile_stored(4, s.scores + b * kKeyBlock, stride);
  }
}

// Pass 3: s.acc[h][d] = sum_t p[h][t] v[t][d] over the span, 32 tokens per round; `pf` asks
// for a slice of the thread's next item per round.
void tiled_values(const uint16_t* v, int64_t n, int64_t padded, TiledScratch& s,
                  Prefetcher& pf) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t t0 = 0; t0 < padded; t0 += kPairBlock) {
    const uint16_t* vb = v + t0 * kTiledDim;  // token pairs are 2 * 64 elements apart
    const int64_t have = n - t0;
    if (have < kPairBlock) {  // zero the tokens past the span (0 * NaN would poison P.V)
      const int64_t pairs = (have + 1) / 2, pair_elems = 2 * kTiledDim;
      std::memcpy(s.vtail, vb, pairs * pair_elems * 2);
      std::memset(s.vtail + pairs * pair_elems, 0, (kPairBlock / 2 - pairs) * pair_elems * 2);
      if (have % 2) {  // the last pair's second token
        for (int64_t d = 0; d < kTiledDim; ++d) s.vtail[(pairs - 1) * pair_elems + 2 * d + 1] = 0;
      }
      vb = s.vtail;
    }
    pf.step();
    _tile_loadd(0, s.probs + t0, padded * 2);
    _tile_loadd(2, vb, 4 * kTiledDim);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, vb + 32, 4 * kTiledDim);
    _tile_dpbf16ps(5, 0, 3);
    _tile_loadd(2, vb + 64, 4 * kTiledDim);
    _tile_dpbf16ps(6, 0, 2);
    _tile_loadd(3, vb + 96, 4 * kTiledDim);
    _tile_dpbf16ps(7, 0, 3);
  }
  _tile_stored(4, s.acc, kTiledDim * 4);  // dims 0-15 of every head, and so on
  _tile_stored(5, s.acc + 16, kTiledDim * 4);
  _tile_stored(6, s.acc + 32, kTiledDim * 4);
  _tile_stored(7, s.acc + 48, kTiledDim * 4);
}
#endif  // ALIGNEDSERVE_AMX

// A vector of 32 bf16 (16 pairs) as the dot-product instruction's operand type.
inline __m512bh as_pairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// Scores of NB consecutive 16-token K blocks for NH heads: lane t of a head's vector is
// sum over dim pairs j of q[h][pair j] . K[t][pair j]. `q` holds each head's 32 pairs as words.
// The blocks are read one after another, each row by row, so the span's K is one ascending
// stream for the hardware prefetchers: reading row j of all NB blocks in turn (NB streams
// 2 KiB apart) measured slower cold on Zen 4 (see "Software prefetch"). Each (block, head)
// sum is its own dependency chain either way, so consecutive blocks' products still overlap.
// `ahead` (if any) steps once per row read.
template <int NH, int NB>
inline void dp_score_blocks(const uint32_t* q, const uint16_t* kb, float* scores,
                            int64_t padded, ReadAhead* ahead = nullptr) {
  __m512 acc[NB][NH];
  for (auto& block : acc) {
    for (__m512& a : block) a = _mm512_setzero_ps();
  }
  for (int b = 0; b < NB; ++b) {
    for (int j = 0; j < kTiledDim / 2; ++j) {
      if (ahead) ahead->step();
      // Row j of block b: the block's 16 tokens' values of dim pair j (32 bf16).
      const __m512bh keys =
          as_pairs(_mm512_loadu_si512(kb + b * kKeyBlock * kTiledDim + j * 2 * kKeyBlock));
      for (int h = 0; h < NH; ++h) {
        acc[b][h] = _mm512_dpbf16_ps(acc[b][h], keys, as_pairs(_mm512_set1_epi32(
                                                              static_cast<int>(q[h * 32 + j]))));
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(scores + h * padded + b * kKeyBlock, acc[b][h]);
  }
}

// Pass 1 with dot products: raw scores as tiled_scores writes them. Heads go in chunks of up
// to 8; the K of later chunks comes from L1/L2. Up to four heads take four blocks at a time,
// more take two: each (block, head) product is its own dependency chain, and with a GQA group
// of 3 two blocks gave only six, too few to cover the product's latency (four blocks measured
// faster on Zen 4 with the same bits: docs/results/2026-12-04-zen4-score-chains.md). `ahead`
// (if any) steps once per line the first chunk reads; later chunks' K is cached.
void dp_scores(const uint16_t* q, const uint16_t* k, int64_t n, int64_t padded, int64_t group,
               TiledScratch& s, ReadAhead* ahead) {
  const auto* qw = reinterpret_cast<const uint32_t*>(q);
  const int64_t blocks = (n + kKeyBlock - 1) / kKeyBlock;
  constexpr int kMaxHeads = 8;
  for (int64_t h0 = 0; h0 < group; h0 += kMaxHeads) {
    const int nh = static_cast<int>(std::min<int64_t>(kMaxHeads, group - h0));
    with_head_count<kMaxHeads>(nh, [&](auto heads) {
      constexpr int NH = decltype(heads)::value;
      const uint32_t* qh = qw + h0 * kTiledDim / 2;
      float* out = s.scores + h0 * padded;
      ReadAhead local;  // the cursor in registers while the loops step it (see ReadAhead)
      ReadAhead* ra = h0 == 0 && ahead ? &(local = *ahead) : nullptr;
      int64_t b = 0;
      // A partial last block is read in place, as on the AMX path (see tiled_scores).
      constexpr int NB = NH <= 4 ? 4 : 2;  // at most 16 accumulators live
      for (; b + NB - 1 < blocks; b += NB) {
        dp_score_blocks<NH, NB>(qh, k + b * kKeyBlock * kTiledDim, out + b * kKeyBlock, padded,
                                 ra);
      }
      for (; b + 1 < blocks; b += 2) {
        dp_score_blocks<NH, 2>(qh, k + b * kKeyBlock * kTiledDim, out + b * kKeyBlock, padded,
                                 ra);
      }
      if (b < blocks) {
        dp_score_blocks<NH, 1>(qh, k + b * kKeyBlock * kTiledDim, out + b * kKeyBlock, padded,
                                 ra);
      }
      if (ra) *ahead = local;
    });
  }
}

// acc[h][16c + i] += P[h][pair] . V[pair][dim 16c + i] over one V pair (64 dims x 2 tokens,
// four vectors); `keep` masks out a pair's second token past the span (0 * NaN is NaN).
template <int NH>
inline void dp_value_pair(const uint32_t* p, int64_t p_stride, const uint16_t* vp,
                          __mmask32 keep, __m512 (&acc)[NH][4]) {
  __m512bh rows[4];
  for (int c = 0; c < 4; ++c) {
    rows[c] = as_pairs(_mm512_maskz_loadu_epi16(keep, vp + c * 2 * kLanes));
  }
  for (int h = 0; h < NH; ++h) {
    const __m512bh w = as_pairs(_mm512_set1_epi32(static_cast<int>(p[h * p_stride])));
    for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], rows[c], w);
  }
}

// acc += P.V over the V pairs [i0, i1) of one kv head's plane `v` (`p`: its heads' probability
// pairs, rows p_stride apart), then, with `odd_tail`, the span's last token alone: pair i1 (=
// n / 2), its first-token halves kept. `ahead` (if any) steps once per line read.
template <int NH>
inline void dp_value_pairs(const uint32_t* p, int64_t p_stride, const uint16_t* v, int64_t i0,
                           int64_t i1, bool odd_tail, __m512 (&acc)[NH][4], ReadAhead* ahead) {
  for (int64_t i = i0; i < i1; ++i) {
    if (ahead) {
      for (int line = 0; line < 4; ++line) ahead->step();  // a V pair is four lines
    }
    dp_value_pair<NH>(p + i, p_stride, v + i * 2 * kTiledDim, ~__mmask32{0}, acc);
  }
  if (odd_tail) dp_value_pair<NH>(p + i1, p_stride, v + i1 * 2 * kTiledDim, 0x55555555u, acc);
}

// Pass 3 with dot products: s.acc[h][d] = sum_t p[h][t] v[t][d] over the span's (n + 1) / 2
// token pairs, read in ascending order. Heads go in chunks of up to 6 (24 accumulators in
// registers). As in dp_scores, `ahead` steps once per line the first chunk reads.
void dp_values(const uint16_t* v, int64_t n, int64_t padded, int64_t group, TiledScratch& s,
               ReadAhead* ahead) {
  const auto* probs = reinterpret_cast<const uint32_t*>(s.probs);  // pairs of bf16
  const int64_t pairs = n / 2, p_stride = padded / 2;
  constexpr int kMaxHeads = 6;
  for (int64_t h0 = 0; h0 < group; h0 += kMaxHeads) {
    const int nh = static_cast<int>(std::min<int64_t>(kMaxHeads, group - h0));
    with_head_count<kMaxHeads>(nh, [&](auto heads) {
      constexpr int NH = decltype(heads)::value;
      const uint32_t* p = probs + h0 * p_stride;
      ReadAhead local;  // as in dp_scores
      ReadAhead* ra = h0 == 0 && ahead ? &(local = *ahead) : nullptr;
      __m512 acc[NH][4];
      for (auto& head : acc) {
        for (__m512& a : head) a = _mm512_setzero_ps();
      }
      dp_value_pairs<NH>(p, p_stride, v, 0, pairs, n % 2, acc, ra);
      for (int h = 0; h < NH; ++h) {
        for (int c = 0; c < 4; ++c) {
          _mm512_storeu_ps(s.acc + (h0 + h) * kTiledDim + c * kLanes, acc[h][c]);
        }
      }
      if (ra) *ahead = local;
    });
  }
}

// Row units (dot-product kernel, calls of many rows). A row's cache holds each kv head's K
// plane, then each one's V plane, every plane `capacity` tokens long of which the row uses its
// length; so per (row, kv head) item the kernel read two streams that each stopped short of
// the next plane, and the hardware prefetchers, having run on past each stream's end, had to
// pick up every new one. A unit is every kv head of one (row, span): its score pass reads K
// block b of kv head 0, 1, 2, then block b + 1 of each, and its value pass V tiles the same
// way, so a row's K planes (then its V planes) advance together as one region. On Zen 4 that
// read faster when memory had bandwidth to spare and no slower when it had none; turns of 2 or
// 4 blocks per head read slower (docs/results/2026-12-05-zen4-decode-row-units.md). On Zen 5
// per-head items read faster, so the caller chooses per CPU (isa.decode_row_units).
// Every score and every accumulator sums the same terms in the same order as dp_scores and
// dp_values, so the outputs are bit-identical to the per-head items'. Calls of few rows keep
// per-head items: a unit per row would leave threads idle.
constexpr int64_t kUnitPairs = kKeyBlock / 2;  // V pairs per head's turn: one 2 KiB tile
constexpr int64_t kUnitMinRowsPerThread = 4;   // fewer rows keep per-head items
constexpr int kUnitMaxGroup = 6;  // a head's 4 value accumulators: 24 registers for 6 heads

// Scores of every kv head of a unit into s.scores rows g * NH + h, block by block.
template <int NH>
void dp_unit_scores(const uint16_t* q, const uint16_t* const* k, int64_t kv, int64_t n,
                    int64_t padded, TiledScratch& s) {
  const auto* qw = reinterpret_cast<const uint32_t*>(q);
  const int64_t blocks = (n + kKeyBlock - 1) / kKeyBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t g = 0; g < kv; ++g) {
      dp_score_blocks<NH, 1>(qw + g * NH * kTiledDim / 2, k[g] + b * kKeyBlock * kTiledDim,
                             s.scores + g * NH * padded + b * kKeyBlock, padded);
    }
  }
}

// P.V of every kv head of a unit into s.acc rows g * NH + h; a head's accumulators wait in
// s.acc (L1) while the other heads take their turn.
template <int NH>
void dp_unit_values(const uint16_t* const* v, int64_t kv, int64_t n, int64_t padded,
                    TiledScratch& s) {
  const auto* probs = reinterpret_cast<const uint32_t*>(s.probs);
  const int64_t pairs = n / 2, p_stride = padded / 2;
  std::fill(s.acc, s.acc + kv * NH * kTiledDim, 0.0f);
  auto turn = [&](int64_t g, int64_t i0, int64_t i1, bool odd_tail) {
    float* a = s.acc + g * NH * kTiledDim;
    __m512 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_loadu_ps(a + h * kTiledDim + c * kLanes);
    }
    dp_value_pairs<NH>(probs + g * NH * p_stride, p_stride, v[g], i0, i1, odd_tail, acc,
                       nullptr);
    for (int h = 0; h < NH; ++h) {
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(a + h * kTiledDim + c * kLanes, acc[h][c]);
    }
  };
  for (int64_t i0 = 0; i0 < pairs; i0 += kUnitPairs) {
    for (int64_t g = 0; g < kv; ++g) turn(g, i0, std::min(pairs, i0 + kUnitPairs), false);
  }
  if (n % 2) {
    for (int64_t g = 0; g < kv; ++g) turn(g, pairs, pairs, true);
  }
}

// Whether a call runs as row units: asked for, the dot-product kernel, a GQA group whose
// accumulators fit the value pass's registers, every head's softmax state in the scratch, and
// enough rows that units (one per row) still spread over the threads.
inline bool units_apply(const Problem& P, int64_t rows, bool row_units) {
  return row_units && P.group <= kUnitMaxGroup && P.group * P.kv_heads <= kTiledMaxHeads &&
         rows >= kUnitMinRowsPerThread * at::get_num_threads();
}

void run_unit(const Problem& P, const Item* items, TiledScratch& s) {
  const int64_t kv = P.kv_heads, n = items[0].end - items[0].begin;
  const int64_t padded = (n + kPairBlock - 1) / kPairBlock * kPairBlock;
  const uint16_t* k[kTiledMaxHeads];  // kv_heads <= group * kv_heads (units_apply)
  const uint16_t* v[kTiledMaxHeads];
  for (int64_t g = 0; g < kv; ++g) {
    append_if_last<true>(P, items[g]);
    std::tie(k[g], v[g]) = item_rows<uint16_t>(P, items[g]);
  }
  const uint16_t* q = P.q_bf16 + items[0].row * P.q_row;
  with_head_count<kUnitMaxGroup>(static_cast<int>(P.group), [&](auto heads) {
    constexpr int NH = decltype(heads)::value;
    dp_unit_scores<NH>(q, k, kv, n, padded, s);
    tiled_softmax(NH * kv, n, padded, P.qscale, s);
    dp_unit_values<NH>(v, kv, n, padded, s);
  });
  for (int64_t g = 0; g < kv; ++g) {
    finish_item(P, items[g], s.acc + g * P.group * kTiledDim, s.mx + g * P.group,
                s.sum + g * P.group);
  }
}

// Unit u is plan.items[u * kv_heads, (u + 1) * kv_heads): plan_items orders them so.
void run_units(const Problem& P, const Plan& plan) {
  const Item* items = plan.items.data();
  const auto n_units = static_cast<int64_t>(plan.items.size()) / P.kv_heads;
  each_thread_pulls([&](auto claim) {
    TiledScratch scratch(P.group * P.kv_heads, plan.max_span);
    for_each_claimed(claim, n_units,
                     [&](int64_t u) { run_unit(P, items + u * P.kv_heads, scratch); });
  });
}

// The dot-product passes' read-ahead for item `it`, P.read_ahead bytes in: over the bytes they
// read (its K blocks, then its V pairs), then the K blocks of the thread's next item, if any.
ReadAhead read_ahead_over(const Problem& P, const Item& it, const Item* next) {
  const auto key_bytes = [](const Item& item) {
    return (item.end - item.begin + kKeyBlock - 1) / kKeyBlock * kKeyBlock * kTiledDim * 2;
  };
  const auto [k, v] = item_rows<uint16_t>(P, it);
  ReadAhead ahead;
  ahead.add(k, key_bytes(it));
  ahead.add(v, (it.end - it.begin + 1) / 2 * 2 * kTiledDim * 2);
  if (next) ahead.add(item_rows<uint16_t>(P, *next).first, key_bytes(*next));
  ahead.begin(P.read_ahead);
  return ahead;
}

// One item; `next` is the thread's next item, or null. With AMX the score pass asks for the
// item's own V (`scores_pf`), the value pass for the next item's K (`values_pf`), so a pass
// rarely starts on a cold stream; the dot-product passes get empty prefetchers and keep
// P.read_ahead bytes requested ahead of their reads, if any (see "Software prefetch").
template <bool kAmx>
void run_item_tiled(const Problem& P, const Item& it, const Item* next, TiledScratch& s,
                    Prefetcher& scores_pf, Prefetcher& values_pf) {
  const int64_t n = it.end - it.begin;
  const int64_t padded = (n + kPairBlock - 1) / kPairBlock * kPairBlock;
  append_if_last<true>(P, it);
  // Spans start at multiples of 16 (kSpan), so the token-major offset of the first token
  // is also where its K block and its V pair start.
  const auto [k, v] = item_rows<uint16_t>(P, it);
  const uint16_t* q = P.q_bf16 + it.row * P.q_row + it.kv_head * P.group * kTiledDim;
#ifdef ALIGNEDSERVE_AMX
  if constexpr (kAmx) {
    tiled_scores(q, k, n, padded, s, scores_pf);
    tiled_softmax(P.group, n, padded, P.qscale, s);
    tiled_values(v, n, padded, s, values_pf);
    finish_item(P, it, s.acc, s.mx, s.sum);
    return;
  }
#endif
  std::optional<ReadAhead> ahead;
  if (P.read_ahead > 0) ahead = read_ahead_over(P, it, next);
  ReadAhead* pf = ahead ? &*ahead : nullptr;
  dp_scores(q, k, n, padded, P.group, s, pf);
  tiled_softmax(P.group, n, padded, P.qscale, s);
  dp_values(v, n, padded, P.group, s, pf);
  finish_item(P, it, s.acc, s.mx, s.sum);
}

// kAmx: tile products (needs amx::available()).
template <bool kAmx>
void run_items_tiled(const Problem& P, const Plan& plan) {
  each_thread_pulls([&](auto claim) {
#ifdef ALIGNEDSERVE_AMX
    if constexpr (kAmx) configure_tiled_tiles(P.group);
#endif
    TiledScratch scratch(P.group, plan.max_span);
    pull_tiled_items(P, plan, claim, kAmx ? 1 : 0,
                     [&](const Item& it, const Item* nx, Prefetcher& scores_pf,
                         Prefetcher& values_pf) {
      run_item_tiled<kAmx>(P, it, nx, scratch, scores_pf, values_pf);
    });
#ifdef ALIGNEDSERVE_AMX
    if constexpr (kAmx) _tile_release();
#endif
  });
}

#else  // no bf16 product instruction (AVX2 builds): fp32 FMA over the same blocks

// Per-head accumulators a pass keeps in registers once its two widened rows and a broadcast
// are live (AVX2: five of the eight two-register vectors).
constexpr int kFmaHeads = std::min(8, kVecRegisters - 3);
// Accumulator sets per head: with 32 registers, the two halves of a pair (dims 2j and 2j+1 of
// a K block row, or a V pair's two tokens) go to separate accumulators, so each head's sum is
// two dependency chains and the FMA ports, not the FMA latency, set the pace (with three heads
// one chain per head left them idle half the time). AVX2's two-register vectors already give
// two chains per head, and a second set would not fit its sixteen registers.
constexpr int kFmaSets = kVecRegisters >= 32 ? 2 : 1;

// A head's finished sum from its first and last accumulator set (the same one with one set).
inline Vec sum_sets(Vec first, Vec last) { return kFmaSets == 2 ? vadd(first, last) : first; }

// Scores of NH heads over one 16-token K block: lane t of head h is the sum over dim pairs j
// of q[h][2j] K[t][2j] + q[h][2j+1] K[t][2j+1]. Row j of the block widens into dim 2j of the
// 16 tokens and dim 2j+1 (vload_pairs), each multiplied by one broadcast q value: a head's 16
// scores with no horizontal sums. q: NH rows of 64, pre-scaled (log2 domain). With two sets,
// the even dims' and the odd dims' sums are added at the end. `pf` (or null) is stepped
// kPrefetchSlices times through the block.
template <int NH>
inline void fma_score_block(const float* q, const uint16_t* kb, float* scores, int64_t padded,
                            Prefetcher* pf) {
  Vec acc[kFmaSets][NH];
  for (auto& set : acc) {
    for (Vec& a : set) a = vzero();
  }
  for (int j = 0; j < kTiledDim / 2; ++j) {
    if (pf != nullptr && j % (kTiledDim / 2 / kPrefetchSlices) == 0) pf->step();
    Vec even, odd;
    vload_pairs(kb + j * 2 * kKeyBlock, even, odd);
    for (int h = 0; h < NH; ++h) {
      acc[0][h] = vfma(even, vset1(q[h * kTiledDim + 2 * j]), acc[0][h]);
      acc[kFmaSets - 1][h] = vfma(odd, vset1(q[h * kTiledDim + 2 * j + 1]),
                                  acc[kFmaSets - 1][h]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    vstore(scores + h * padded, sum_sets(acc[0][h], acc[kFmaSets - 1][h]));
  }
}

// Pass 1: scores of the span's `padded` / 16 K blocks into scores[h * padded + t]. A partial
// last block is read in place (as on the AMX path, see tiled_scores); the caller masks the
// columns past the span.
void fma_scores(const float* q, const uint16_t* k, int64_t padded, int64_t group,
                float* scores, Prefetcher& pf) {
  for (int64_t h0 = 0; h0 < group; h0 += kFmaHeads) {
    const int nh = static_cast<int>(std::min<int64_t>(kFmaHeads, group - h0));
    with_head_count<kFmaHeads>(nh, [&](auto heads) {
      for (int64_t t = 0; t < padded; t += kKeyBlock) {
        fma_score_block<decltype(heads)::value>(q + h0 * kTiledDim, k + t * kTiledDim,
                                                scores + h0 * padded + t, padded,
                                                h0 == 0 ? &pf : nullptr);
      }
    });
  }
}

// Adds p . V over the span's n tokens to NH heads' dims [16 c0, 16 (c0 + NC)) of acc
// ([NH][64]). A V pair widens, per 16-dim chunk, into its first and its second token's values
// (vload_pairs), each multiplied by that token's broadcast probability. When n is odd the last
// pair's second slot is left out: it may hold anything, even NaN bits (0 * NaN is NaN).
template <int NH, int NC>
void fma_value_chunks(const float* p, int64_t p_stride, const uint16_t* v, int64_t n, int c0,
                      float* acc, Prefetcher* pf) {
  Vec sums[kFmaSets][NH][NC];  // with two sets: a pair's first token, its second token
  for (auto& set : sums) {
    for (auto& head : set) {
      for (Vec& a : head) a = vzero();
    }
  }
  const auto add_pair = [&](int64_t i, bool both) {
    const uint16_t* vp = v + i * 2 * kTiledDim + c0 * 2 * kLanes;
    for (int c = 0; c < NC; ++c) {
      Vec first, second;
      vload_pairs(vp + c * 2 * kLanes, first, second);
      for (int h = 0; h < NH; ++h) {
        sums[0][h][c] = vfma(first, vset1(p[h * p_stride + 2 * i]), sums[0][h][c]);
        if (both) {
          Vec& to = sums[kFmaSets - 1][h][c];
          to = vfma(second, vset1(p[h * p_stride + 2 * i + 1]), to);
        }
      }
    }
  };
  for (int64_t i = 0; i < n / 2; ++i) {
    if (pf != nullptr && i % (kPairBlock / 2 / kPrefetchSlices) == 0) pf->step();
    add_pair(i, true);
  }
  if (n % 2) add_pair(n / 2, false);
  for (int h = 0; h < NH; ++h) {
    for (int c = 0; c < NC; ++c) {
      vstore(acc + h * kTiledDim + (c0 + c) * kLanes,
             sum_sets(sums[0][h][c], sums[kFmaSets - 1][h][c]));
    }
  }
}

// Accumulators (sets x heads x 16-dim chunks) a value pass keeps in registers beside its two
// widened halves and a broadcast.
constexpr int kValueAccumulators = kVecRegisters - 3;

// Pass 3: acc[h][d] = sum_t p[h][t] v[t][d]. Heads go in chunks of up to kFmaHeads, each chunk
// in as many passes over the span as its accumulators need: with three heads one pass on
// AVX-512 (2 sets x 3 heads x 4 chunks = 24 accumulators: the same sums in the same order as
// two passes of 32 dims, but each pair's four lines read together, which the cold stream
// prefers to two passes over half of every pair's lines), four on AVX2 (16 dims each, a
// quarter of every pair, so no byte is read twice).
void fma_values(const float* p, int64_t padded, const uint16_t* v, int64_t n, int64_t group,
                float* acc, Prefetcher& pf) {
  constexpr int kChunks = kTiledDim / kLanes;
  for (int64_t h0 = 0; h0 < group; h0 += kFmaHeads) {
    const int nh = static_cast<int>(std::min<int64_t>(kFmaHeads, group - h0));
    with_head_count<kFmaHeads>(nh, [&](auto heads) {
      constexpr int NH = decltype(heads)::value;
      constexpr int per_head = kValueAccumulators / (kFmaSets * NH);
      constexpr int NC = per_head >= kChunks ? kChunks : per_head >= 2 ? 2 : 1;
      for (int c0 = 0; c0 < kChunks; c0 += NC) {
        fma_value_chunks<NH, NC>(p + h0 * padded, padded, v, n, c0, acc + h0 * kTiledDim,
                                 h0 == 0 && c0 == 0 ? &pf : nullptr);
      }
    });
  }
}

// One item: q widened and pre-scaled into the log2 domain, then the token-major kernel's
// softmax (exponentiate) between the two products; P stays fp32.
void run_item_tiled_fma(const Problem& P, const Item& it, Scratch& s, Prefetcher& scores_pf,
                        Prefetcher& values_pf) {
  const int64_t n = it.end - it.begin, group = P.group;
  const int64_t padded = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  append_if_last<true>(P, it);
  const auto [k, v] = item_rows<uint16_t>(P, it);  // spans start at whole K blocks (kSpan)
  const uint16_t* qb = P.q_bf16 + it.row * P.q_row + it.kv_head * group * kTiledDim;
  for (int64_t i = 0; i < group * kTiledDim; ++i) s.q[i] = from_bf16(qb[i]) * P.qscale;
  fma_scores(s.q.data(), k, padded, group, s.scores.data(), scores_pf);
  softmax_rows(s, group, n, padded);
  fma_values(s.scores.data(), padded, v, n, group, s.acc.data(), values_pf);
  finish_item(P, it, s.acc.data(), s.mx.data(), s.sum.data());
}

void run_items_tiled_fma(const Problem& P, const Plan& plan) {
  each_thread_pulls([&](auto claim) {
    Scratch scratch(P.group, kTiledDim, plan.max_span);
    pull_tiled_items(P, plan, claim, kPrefetchSlices, [&](const Item& it, const Item*,
                                                         Prefetcher& scores_pf,
                                                         Prefetcher& values_pf) {
      run_item_tiled_fma(P, it, scratch, scores_pf, values_pf);
    });
  });
}

#endif  // __AVX512BF16__ (else: FMA)


// Compile-time vector counts for the common head dims let the compiler keep q and the
// accumulators in registers; bf16 rows use the cheaper pairwise widening when dim % 32 == 0.
template <typename E>
void run_for_dim(const Problem& P, const Plan& plan) {
  constexpr bool kBf16 = std::is_same_v<E, uint16_t>;  // pairwise widening is bf16-only
  switch (P.dim / kLanes) {
    case 4: return run_items<E, 4, kBf16>(P, plan);
    case 8: return run_items<E, 8, kBf16>(P, plan);
    default:
      if (kBf16 && P.dim % 32 == 0) return run_items<E, 0, kBf16>(P, plan);
      return run_items<E, 0, false>(P, plan);
  }
}

// Softmax-merge of the spans of one (row, kv head): rescale each span by 2^(max_i - max).
inline void merge_split(const Problem& P, const Split& sp) {
  const int64_t gd = P.group * P.dim, first = (sp.row * P.heads + sp.kv_head * P.group) * P.dim;
  float oh[kLanes * kMaxChunks];  // one head's merged row
  for (int64_t h = 0; h < P.group; ++h) {
    float mx = kNegInf;
    for (int64_t i = 0; i < sp.count; ++i) {
      mx = std::max(mx, P.part_ml[(sp.first_slot + i) * 2 * P.group + h]);
    }
    float total = 0.0f;
    std::fill_n(oh, P.dim, 0.0f);
    for (int64_t i = 0; i < sp.count; ++i) {
      const int64_t slot = sp.first_slot + i;
      const float* ml = P.part_ml + slot * 2 * P.group;
      const float w = std::exp2(ml[h] - mx);
      total += w * ml[P.group + h];
      const float* acc = P.part_acc + slot * gd + h * P.dim;
      for (int64_t d = 0; d < P.dim; ++d) oh[d] += w * acc[d];
    }
    for (int64_t d = 0; d < P.dim; ++d) store_out(P, first + h * P.dim + d, oh[d] / total);
  }
}

// ----------------------------------------------------------------------------------------------
// Entry point
// ----------------------------------------------------------------------------------------------

// t itself when each row's [heads, dim] block is dense (rows may be any distance apart, as in
// a view of a fused qkv), else a contiguous copy.
at::Tensor dense_rows(const at::Tensor& t) {
  const bool dense = t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2));
  return dense ? t : t.contiguous();
}

// Prefill's writer for tiled caches: k, v [T, kv_heads, dim] (bf16; rows any distance apart,
// as views of a fused qkv are) into positions [start, start + T) of layer `layer` of `cache`.
// Work is split by (kv head, 16-token block), K and V together. Whole K blocks and whole V
// pairs are written in output order; a chunk's partial first and last ones token by token.
void write_tiled(const at::Tensor& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                 int64_t start) {
  TORCH_CHECK_VALUE(cache.dim() == 5 && cache.scalar_type() == at::kBFloat16 &&
                        cache.stride(4) == 1 && cache.stride(3) == cache.size(4) &&
                        cache.size(3) % 16 == 0 && cache.device().is_cpu(),
                    "write_tiled: a dense bf16 CPU cache with capacity % 16 == 0");
  const int64_t kv_heads = cache.size(2), dim = cache.size(4), T = k.size(0);
  TORCH_CHECK_VALUE(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv_heads &&
                        k.size(2) == dim && dim % 2 == 0,
                    "write_tiled: k, v must be [T, kv_heads, head_dim]");
  TORCH_CHECK_VALUE(layer >= 0 && layer < cache.size(0) && start >= 0 &&
                        start + T <= cache.size(3), "write_tiled: layer or positions out of range");
  if (T == 0) return;
  const at::Tensor kc = dense_rows(k.to(at::kBFloat16)), vc = dense_rows(v.to(at::kBFloat16));
  const auto* ks = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  const int64_t k_row = kc.stride(0), v_row = vc.stride(0), stop = start + T;
  auto* base = reinterpret_cast<uint16_t*>(cache.data_ptr()) + layer * cache.stride(0);
  const int64_t first_block = start / 16, blocks = (stop + 15) / 16 - first_block;
  at::parallel_for(0, kv_heads * blocks, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t g = task / blocks, t0 = (first_block + task % blocks) * 16;
      const int64_t a = std::max(start, t0), b = std::min(stop, t0 + 16);
      uint16_t* k_plane = base + g * cache.stride(2);
      uint16_t* v_plane = k_plane + cache.stride(1);
      auto k_src = [&](int64_t t) { return ks + (t - start) * k_row + g * dim; };
      auto v_src = [&](int64_t t) { return vs + (t - start) * v_row + g * dim; };
      if (a == t0 && b == t0 + 16) {  // a whole K block: [dim/2][16 tokens][2 dims]
        uint16_t* block = k_plane + t0 * dim;
        for (int64_t j = 0; j < dim / 2; ++j) {
          for (int64_t i = 0; i < 16; ++i) {
            std::memcpy(block + (j * 16 + i) * 2, k_src(t0 + i) + 2 * j, 4);
          }
        }
      } else {
        for (int64_t t = a; t < b; ++t) put_key_tiled(k_plane, t, k_src(t), dim);
      }
      for (int64_t t = a; t < b;) {  // V pairs: [dim][2 tokens]
        if (t % 2 == 0 && t + 1 < b) {
          uint16_t* pair = v_plane + t * dim;
          const uint16_t* v0 = v_src(t);
          const uint16_t* v1 = v_src(t + 1);
          for (int64_t d = 0; d < dim; ++d) pair[2 * d] = v0[d], pair[2 * d + 1] = v1[d];
          t += 2;
        } else {
          put_value_tiled(v_plane, t, v_src(t), dim);
          t += 1;
        }
      }
    }
  });
}

// Input checks raise ValueError in Python (TORCH_CHECK_VALUE), like the PyTorch reference.
#define ALIGNEDSERVE_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, "decode_attention: ", __VA_ARGS__)


void check_shapes(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                  size_t n_caches, const at::Tensor& positions) {
  ALIGNEDSERVE_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3,
                     "q, k_new, v_new must be 3-d [B, heads, head_dim]");
  const int64_t rows = q.size(0), dim = q.size(2);
  ALIGNEDSERVE_CHECK(k_new.sizes() == v_new.sizes(), "k_new and v_new shapes differ");
  ALIGNEDSERVE_CHECK(k_new.size(0) == rows && k_new.size(2) == dim, "k_new shape ",
                     k_new.sizes(), " does not match q ", q.sizes());
  ALIGNEDSERVE_CHECK(k_new.size(1) > 0 && q.size(1) % k_new.size(1) == 0,
                     "heads must be a multiple of kv heads");
  ALIGNEDSERVE_CHECK(dim % kLanes == 0 && dim > 0 && dim <= kLanes * kMaxChunks,
                     "head_dim must be a multiple of 16 in [16, 256], got ", dim);
  ALIGNEDSERVE_CHECK(static_cast<int64_t>(n_caches) == rows && positions.numel() == rows,
                     "need one cache and one position per row");
  ALIGNEDSERVE_CHECK(q.device().is_cpu() && k_new.device().is_cpu() &&
                         v_new.device().is_cpu() && positions.device().is_cpu(),
                     "all inputs must be on CPU");
}

void check_cache(const at::Tensor& c, at::ScalarType dtype, int64_t kv_heads, int64_t dim,
                 int64_t layer, int64_t pos) {
  ALIGNEDSERVE_CHECK(c.device().is_cpu(), "caches must be on CPU");
  ALIGNEDSERVE_CHECK(c.dim() == 5, "a cache must be [layers, 2, kv_heads, capacity, dim]");
  ALIGNEDSERVE_CHECK(c.scalar_type() == dtype, "all caches must share one dtype");
  ALIGNEDSERVE_CHECK(c.size(1) == 2 && c.size(2) == kv_heads && c.size(4) == dim,
                     "cache shape ", c.sizes(), " does not match kv_heads=", kv_heads,
                     " head_dim=", dim);
  ALIGNEDSERVE_CHECK(c.stride(4) == 1 && (c.size(3) == 1 || c.stride(3) == dim),
                     "cache tokens must be densely packed (strides ", c.strides(), ")");
  ALIGNEDSERVE_CHECK(layer >= 0 && layer < c.size(0), "layer ", layer, " out of range for ",
                     c.size(0), " layers");
  ALIGNEDSERVE_CHECK(pos >= 0 && pos < c.size(3), "position ", pos, " outside capacity ",
                     c.size(3));
}

// A step's decode rows, checked once for all its layers: each row's cache (held, so the
// addresses stay valid), where its layer 0 starts, how far apart its layers and kv heads are,
// its position, and the plan of work items, which depends on the positions only. A call per
// layer then reads these few arrays instead of every row's tensor and storage objects, which
// the previous layer's KV stream has pushed out of the caches by then.
struct DecodeRows {
  std::vector<at::Tensor> caches;
  at::Tensor positions;  // int64, contiguous, a copy
  at::ScalarType dtype = at::kBFloat16;
  bool tiled = false;
  int64_t kv_heads = 0, dim = 0, elem = 0;
  int64_t layers = 0;                   // the fewest layers of any row's cache
  std::vector<char*> base;              // per row: &cache[0, 0, 0, 0, 0]
  std::vector<int64_t> layer_bytes;     // per row: bytes between layers
  std::vector<int64_t> v_bytes;         // per row: bytes from a layer's K to its V
  std::vector<int64_t> hstride;         // per row: elements between kv heads
  Plan plan;

  DecodeRows(std::vector<at::Tensor> caches_in, const at::Tensor& positions_in, bool tiled_in)
      : caches(std::move(caches_in)), tiled(tiled_in) {
    const auto rows = static_cast<int64_t>(caches.size());
    ALIGNEDSERVE_CHECK(positions_in.numel() == rows && positions_in.device().is_cpu(),
                       "need one cache and one position per row, on CPU");
    positions = positions_in.to(at::kLong).clone();  // a copy: the caller may reuse its tensor
    if (rows == 0) return;
    const at::Tensor& first = caches[0];
    dtype = first.scalar_type();
    ALIGNEDSERVE_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat ||
                           dtype == at::kFloat8_e5m2,
                       "caches must be bfloat16, float32 or float8_e5m2");
    ALIGNEDSERVE_CHECK(first.dim() == 5, "a cache must be [layers, 2, kv_heads, capacity, dim]");
    kv_heads = first.size(2);
    dim = first.size(4);
    elem = static_cast<int64_t>(first.element_size());
    layers = first.size(0);
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      const at::Tensor& c = caches[b];
      check_cache(c, dtype, kv_heads, dim, 0, pos[b]);
      ALIGNEDSERVE_CHECK(!tiled || c.size(3) % 16 == 0, "a tiled cache's capacity must be a "
                         "multiple of 16, got ", c.size(3));
      layers = std::min(layers, c.size(0));
      base.push_back(static_cast<char*>(c.data_ptr()));
      layer_bytes.push_back(c.stride(0) * elem);
      v_bytes.push_back(c.stride(1) * elem);
      hstride.push_back(c.stride(2));
    }
    plan = plan_items(pos, rows, kv_heads, kSpan);
  }
};

at::Tensor decode_attention_rows(const at::Tensor& q, const at::Tensor& k_new,
                                 const at::Tensor& v_new, const DecodeRows& R, int64_t layer,
                                 double scale, bool row_units, int64_t read_ahead) {
  check_shapes(q, k_new, v_new, R.caches.size(), R.positions);
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = k_new.size(1), dim = q.size(2);
  if (rows == 0) return at::empty_like(q);
  const at::ScalarType dtype = R.dtype;
  const bool tiled = R.tiled;
  ALIGNEDSERVE_CHECK(R.kv_heads == kv_heads && R.dim == dim, "cache shape ",
                     R.caches[0].sizes(), " does not match kv_heads=", kv_heads,
                     " head_dim=", dim);
  ALIGNEDSERVE_CHECK(layer >= 0 && layer < R.layers, "layer ", layer, " out of range for ",
                     R.layers, " layers");
  if (tiled) {
    ALIGNEDSERVE_CHECK(dtype == at::kBFloat16 && dim == 64 && scale > 0 &&
                           heads / kv_heads <= kTiledMaxHeads,
                       "tiled caches are bf16 with head_dim 64, at most 16 heads per kv head");
  }
  ALIGNEDSERVE_CHECK(read_ahead >= 0, "read_ahead must be >= 0, got ", read_ahead);

  // Tiled: the tile products take q in bf16 (exact when the model runs in bf16). Row views of
  // a fused qkv projection are read in place (no copies), each row's heads being dense.
  const at::Tensor qf = dense_rows(q.to(tiled ? at::kBFloat16 : at::kFloat));
  at::Tensor kn = dense_rows(k_new.to(dtype)), vn = dense_rows(v_new.to(dtype));
  if (kn.stride(0) != vn.stride(0)) {  // one row stride serves both
    kn = kn.contiguous();
    vn = vn.contiguous();
  }

  Problem P;
  P.heads = heads;
  P.kv_heads = kv_heads;
  P.group = heads / kv_heads;
  P.dim = dim;
  P.qscale = static_cast<float>(scale * kLog2e);
  P.q = tiled ? nullptr : qf.data_ptr<float>();
  P.q_bf16 = tiled ? reinterpret_cast<const uint16_t*>(qf.data_ptr()) : nullptr;
  P.q_row = qf.stride(0);
  P.pos = R.positions.data_ptr<int64_t>();
  // The new tokens are written inside the parallel region (append_if_last), after every check
  // here has passed: an error leaves the caches untouched.
  P.k_new = static_cast<const char*>(kn.data_ptr());
  P.v_new = static_cast<const char*>(vn.data_ptr());
  P.new_row = kn.stride(0);
  P.elem = R.elem;
  P.k_base.resize(rows);
  P.v_base.resize(rows);
  for (int64_t b = 0; b < rows; ++b) {
    P.k_base[b] = R.base[b] + layer * R.layer_bytes[b];
    P.v_base[b] = P.k_base[b] + R.v_bytes[b];
  }
  P.hstride = R.hstride.data();
  // A row's spans depend on its own length only, and every item's arithmetic on its span only,
  // so a row's output is the same whatever other rows share the call and however many threads
  // run it (batch invariance); the longest-first order only decides which thread runs what.
  const Plan& plan = R.plan;
  const auto f32 = qf.options().dtype(at::kFloat);
  // bf16 (the model's dtype) is written directly; other dtypes are converted from fp32.
  const bool bf16_out = q.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({rows, heads, dim}, bf16_out ? q.options().dtype(at::kBFloat16)
                                                          : f32);
  at::Tensor part_acc = at::empty({plan.slots, P.group, dim}, f32);
  at::Tensor part_ml = at::empty({plan.slots, 2, P.group}, f32);
  P.out = bf16_out ? nullptr : out.data_ptr<float>();
  P.out_bf16 = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  P.part_acc = part_acc.data_ptr<float>();
  P.part_ml = part_ml.data_ptr<float>();
  P.read_ahead = read_ahead;
  if (tiled) {
#if defined(__AVX512BF16__)
    if (amx::available()) {
      run_items_tiled<true>(P, plan);
    } else if (units_apply(P, rows, row_units)) {
      run_units(P, plan);
    } else {
      run_items_tiled<false>(P, plan);
    }
#else
    run_items_tiled_fma(P, plan);
#endif
  } else if (dtype == at::kFloat) {
    run_for_dim<float>(P, plan);
  } else if (dtype == at::kBFloat16) {
    run_for_dim<uint16_t>(P, plan);
  } else {
    run_for_dim<uint8_t>(P, plan);
  }
  at::parallel_for(0, static_cast<int64_t>(plan.splits.size()), 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) merge_split(P, plan.splits[i]);
  });
  return bf16_out || q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// One layer's call with the rows checked and planned for it alone.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new,
                            const at::Tensor& v_new, const std::vector<at::Tensor>& caches,
                            const at::Tensor& positions, int64_t layer, double scale,
                            bool tiled, bool row_units, int64_t read_ahead) {
  return decode_attention_rows(q, k_new, v_new, DecodeRows(caches, positions, tiled), layer,
                               scale, row_units, read_ahead);
}

}  // namespace

void register_attention(pybind11::module_& m) {
  m.def("decode_attention", &decode_attention, kReleaseGil,
        "Write the new K/V of every row into its cache, then attend q over positions 0..pos.",
        pybind11::arg("q"), pybind11::arg("k_new"), pybind11::arg("v_new"),
        pybind11::arg("caches"), pybind11::arg("positions"), pybind11::arg("layer"),
        pybind11::arg("scale"), pybind11::arg("tiled") = false,
        pybind11::arg("row_units") = false, pybind11::arg("read_ahead") = 0);
  pybind11::class_<DecodeRows>(m, "DecodeRows",
                               "A step's decode rows (caches and positions), checked once for "
                               "every layer's decode_attention_rows call.")
      .def(pybind11::init<std::vector<at::Tensor>, const at::Tensor&, bool>(),
           pybind11::arg("caches"), pybind11::arg("positions"), pybind11::arg("tiled") = false);
  m.def("decode_attention_rows", &decode_attention_rows, kReleaseGil,
        "decode_attention over rows prepared once per step (DecodeRows).",
        pybind11::arg("q"), pybind11::arg("k_new"), pybind11::arg("v_new"),
        pybind11::arg("rows"), pybind11::arg("layer"), pybind11::arg("scale"),
        pybind11::arg("row_units") = false, pybind11::arg("read_ahead") = 0);
  m.def("write_tiled", &write_tiled, kReleaseGil,
        "Store k, v [T, kv_heads, head_dim] at positions start.. of a tiled bf16 cache's layer.",
        pybind11::arg("cache"), pybind11::arg("layer"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("start"));
}

}  // namespace alignedserve
