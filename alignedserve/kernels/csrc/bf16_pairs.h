// Dot products over bf16 pairs and rounding to bf16 for the AVX-512 kernels
// (linear_avx512.cpp, prefill_attention_avx512.cpp), with or without AVX512-BF16.
//
// Where the target has AVX512-BF16, `dot_word` is one vdpbf16ps and the rounding is
// vcvtne(2)ps2bf16. Where it has only AVX-512 F/BW/VL (Skylake-SP, Cascade Lake, Ice Lake, and
// VMs that hide the bf16 flag: the `avx512` path), the same arithmetic is built from AVX-512F:
// a bf16 widens to fp32 exactly (a 16-bit shift) and a product of two bf16 is exact in fp32, so
// two FMAs, the odd element first as the SDM defines vdpbf16ps, give the instruction's result.
// The one difference is denormals: vdpbf16ps and vcvtneps2bf16 flush them, FMA and the integer
// rounding here keep them. A `Pairs` holds the vector operand as the dot product wants it: the
// bf16 vector itself, or (without AVX512-BF16) its odd and even elements widened once, so a
// vector used against many broadcast words is split once.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ALIGNEDSERVE_AVX512 1
#include <immintrin.h>

#include <cstdint>

namespace alignedserve::bf16 {

#if defined(__AVX512BF16__)

constexpr bool kNativeDot = true;

struct Pairs {
  __m512bh v;
};

// 32 bf16 (16 pairs) as a dot-product operand.
inline Pairs to_pairs(__m512i x) { return {reinterpret_cast<__m512bh>(x)}; }

// acc[i] += a.pair[i] . word (both elements of the broadcast pair `word`), per lane i.
inline __m512 dot_word(__m512 acc, const Pairs& a, uint32_t word) {
  return _mm512_dpbf16_ps(acc, a.v, reinterpret_cast<__m512bh>(
                                        _mm512_set1_epi32(static_cast<int>(word))));
}

// 16 fp32 rounded to bf16 (nearest even).
inline __m256i round16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

// 32 fp32 rounded to bf16: lo's lanes first, then hi's (vcvtne2ps2bf16's order).
inline __m512i round32(__m512 hi, __m512 lo) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

#else  // AVX-512 F/BW/VL only: the same results from FMAs and integer rounding

constexpr bool kNativeDot = false;

struct Pairs {
  __m512 odd, even;  // elements 2i + 1 and 2i of each pair, widened to fp32
};

inline Pairs to_pairs(__m512i x) {
  return {_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536))),
          _mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
}

inline __m512 dot_word(__m512 acc, const Pairs& a, uint32_t word) {
  const __m512 odd = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(word & 0xFFFF0000u)));
  const __m512 even = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(word << 16)));
  return _mm512_fmadd_ps(a.even, even, _mm512_fmadd_ps(a.odd, odd, acc));
}

// Each lane's fp32 rounded to bf16 in its low 16 bits (nearest even; NaN stays a quiet NaN,
// as vcvtneps2bf16 keeps it).
inline __m512i rounded_words(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(_mm512_srli_epi32(up, 16), nan, _mm512_srli_epi32(bits, 16),
                              _mm512_set1_epi32(0x40));
}

inline __m256i round16(__m512 x) { return _mm512_cvtepi32_epi16(rounded_words(x)); }

inline __m512i round32(__m512 hi, __m512 lo) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(round16(lo)), round16(hi), 1);
}

#endif  // __AVX512BF16__

}  // namespace alignedserve::bf16

#endif  // AVX-512 F/BW/VL
