// 16-lane fp32 vectors over bf16 rows, shared by the fused elementwise kernels (fused.cpp)
// and the AVX512-BF16 linear kernel's SwiGLU epilogue (linear_avx512.cpp), so both round and
// exponentiate exactly alike (fused.cpp's file comment states the rounding contract).
//
// AVX-512 (F + BW + VL) where the compiler targets it, two AVX2 ymm registers where it targets
// AVX2 + FMA, else plain arrays that the compiler auto-vectorises for whatever the target has.
// Everything sits in an unnamed namespace: each translation unit gets its own copy, as when it
// lived in fused.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Masked 16-bit loads/stores need AVX512BW+VL on top of AVX512F (every AVX-512 server CPU
// since Skylake-SP has them); anything else takes the portable path.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ALIGNEDSERVE_FUSED_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define ALIGNEDSERVE_FUSED_AVX2 1
#include <immintrin.h>
#endif

namespace alignedserve {
namespace {

constexpr int64_t kLanes = 16;

// SLEEF expf_u10 constants (ln 2 split in two for the exact argument reduction).
constexpr float kRLn2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
constexpr float kL2U = 0.693145751953125f;
constexpr float kL2L = 1.428606765330187045e-06f;

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// fp32 bits rounded to nearest even at bit 16 (valid for non-NaN; overflow gives inf).
inline uint32_t rne_bits(uint32_t bits) { return bits + 0x7FFFu + ((bits >> 16) & 1u); }

inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;  // c10::BFloat16's NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof f);
  return static_cast<uint16_t>(rne_bits(bits) >> 16);
}

// ----------------------------------------------------------------------------------------------
// 16-lane fp32 vector with masked bf16 loads/stores (n < 16 touches only the first n elements,
// so row tails need no scalar loop). The kernels below are written once against this.
// ----------------------------------------------------------------------------------------------
#if defined(ALIGNEDSERVE_FUSED_AVX512)

struct Vec {
  __m512 r;
};
inline __mmask16 lanes(int64_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
inline Vec vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const uint16_t* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
// fp32 bits whose high half is v rounded to bf16 (nearest even; overflow gives inf).
// NaN needs no special case here, unlike in float_to_bf16: every NaN these kernels can produce
// has a zero low half (x86 arithmetic passes an input NaN's payload through, inputs are bf16,
// and a new NaN is 0xFFC00000), so the bias never carries into its high half. Skipping the
// check saves two of the seven ops that every rounded value costs.
inline __m512i rounded_bits(Vec v) {
  const __m512i bits = _mm512_castps_si512(v.r);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
}
// r(v): v rounded to bf16 precision, kept as fp32 for the next op.
inline Vec vround(Vec v) {
  return {_mm512_castsi512_ps(_mm512_and_si512(rounded_bits(v), _mm512_set1_epi32(-65536)))};
}
inline void vstore(uint16_t* p, Vec v, int64_t n) {
  const __m512i bf16 = _mm512_srli_epi32(rounded_bits(v), 16);
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(bf16));
}
inline void vstore_f32(float* p, Vec v) { _mm512_storeu_ps(p, v.r); }
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.r, b.r)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.r, b.r)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.r, b.r)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.r, b.r)}; }
inline Vec vneg(Vec a) { return {_mm512_xor_ps(a.r, _mm512_set1_ps(-0.0f))}; }

// exp(x) as SLEEF's xexpf (sleefsimdsp.c, FMA variant) computes it: the same argument
// reduction and polynomial op for op, so it equals what ATen's Vectorized<float>::exp returns
// (Sleef_expf16_u10, or Sleef_expf8_u10 at AVX2 width; error <= 1 ulp). Two steps are cheaper
// than SLEEF's: x is clamped to [-104, 100] up front (SLEEF patches the result to 0 / inf
// outside that range instead; exp of the bounds gives the same), and u * 2^q is one scalef
// instead of two multiplies by built powers of two. Checked bit-identical to both SLEEF
// entry points over all 2^32 fp32 inputs.
inline Vec vexp(Vec x) {
  // max/min return their second operand when either is NaN, so NaN passes through.
  const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(100.0f);
  const __m512 d = _mm512_min_ps(hi, _mm512_max_ps(lo, x.r));
  const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(kRLn2)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-kL2U), d);
  s = _mm512_fmadd_ps(q, _mm512_set1_ps(-kL2L), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  return {_mm512_scalef_ps(u, q)};
}

#elif defined(ALIGNEDSERVE_FUSED_AVX2)
// Two ymm registers per vector (lanes 0..7 in lo, 8..15 in hi), op for op the AVX-512 version
// (the portable arrays below were left mostly scalar by GCC). AVX2 has no 16-bit masked
// loads/stores: a short tail goes through a zeroed 16-element buffer.

struct Vec {
  __m256 lo, hi;
};
inline Vec vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline __m256 widen8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Vec vload(const uint16_t* p, int64_t n) {
  if (n >= kLanes) return {widen8(p), widen8(p + 8)};
  uint16_t tail[kLanes] = {};
  std::memcpy(tail, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(uint16_t));
  return {widen8(tail), widen8(tail + 8)};
}
// The AVX-512 version's rounded_bits (same NaN argument).
inline __m256i rounded_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
}
inline __m256 round8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(rounded_bits8(v), _mm256_set1_epi32(-65536)));
}
inline Vec vround(Vec v) { return {round8(v.lo), round8(v.hi)}; }
inline void vstore(uint16_t* p, Vec v, int64_t n) {
  // The high halves as 16-bit lanes; packus interleaves 128-bit lanes, the permute restores
  // order. Every value fits 16 bits, so the unsigned saturation never bites.
  const __m256i packed = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_srli_epi32(rounded_bits8(v.lo), 16),
                          _mm256_srli_epi32(rounded_bits8(v.hi), 16)),
      0xD8);
  if (n >= kLanes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
    return;
  }
  uint16_t tail[kLanes];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tail), packed);
  std::memcpy(p, tail, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(uint16_t));
}
inline void vstore_f32(float* p, Vec v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Vec operator+(Vec a, Vec b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline Vec operator-(Vec a, Vec b) {
  return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
inline Vec operator*(Vec a, Vec b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline Vec operator/(Vec a, Vec b) {
  return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
inline Vec vneg(Vec a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}

// 2^e for integer e in [-126, 127], as fp32 bits.
inline __m256 pow2i8(__m256i e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}
// The AVX-512 vexp at 8 lanes; u * 2^q as SLEEF itself scales (vldexp2: two multiplies by
// 2^(q >> 1) and 2^(q - (q >> 1))), which is Sleef_expf8_u10's own final step.
inline __m256 exp8(__m256 x) {
  const __m256 d = _mm256_min_ps(_mm256_set1_ps(100.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 q = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(kRLn2)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 s = _mm256_fmadd_ps(q, _mm256_set1_ps(-kL2U), d);
  s = _mm256_fmadd_ps(q, _mm256_set1_ps(-kL2L), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  const __m256i qi = _mm256_cvtps_epi32(q);
  const __m256i half = _mm256_srai_epi32(qi, 1);
  return _mm256_mul_ps(_mm256_mul_ps(u, pow2i8(half)), pow2i8(_mm256_sub_epi32(qi, half)));
}
inline Vec vexp(Vec a) { return {exp8(a.lo), exp8(a.hi)}; }

#else  // portable: plain arrays, auto-vectorised for whatever the target has

struct Vec {
  float x[kLanes];
};
template <typename F>
inline Vec vmap(F f) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.x[i] = f(i);
  return r;
}
inline Vec vset1(float v) { return vmap([v](int64_t) { return v; }); }
inline Vec vload(const uint16_t* p, int64_t n) {
  return vmap([p, n](int64_t i) { return i < n ? bf16_to_float(p[i]) : 0.0f; });
}
inline Vec vround(Vec v) {
  return vmap([&v](int64_t i) { return bf16_to_float(float_to_bf16(v.x[i])); });
}
inline void vstore(uint16_t* p, Vec v, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kLanes); ++i) p[i] = float_to_bf16(v.x[i]);
}
inline void vstore_f32(float* p, Vec v) { std::memcpy(p, v.x, sizeof v.x); }
inline Vec operator+(Vec a, Vec b) { return vmap([&](int64_t i) { return a.x[i] + b.x[i]; }); }
inline Vec operator-(Vec a, Vec b) { return vmap([&](int64_t i) { return a.x[i] - b.x[i]; }); }
inline Vec operator*(Vec a, Vec b) { return vmap([&](int64_t i) { return a.x[i] * b.x[i]; }); }
inline Vec operator/(Vec a, Vec b) { return vmap([&](int64_t i) { return a.x[i] / b.x[i]; }); }
inline Vec vneg(Vec a) { return vmap([&](int64_t i) { return -a.x[i]; }); }
inline Vec vexp(Vec a) { return vmap([&](int64_t i) { return std::exp(a.x[i]); }); }

#endif

// SiLU(g) * u as silu_mul rounds it: r(r(g / (1 + exp(-g))) * u), the last rounding left to
// the store (vstore).
inline Vec silu_times(Vec g, Vec u) {
  return vround(g / (vset1(1.0f) + vexp(vneg(g)))) * u;
}

}  // namespace
}  // namespace alignedserve
