// Shared Intel AMX set-up for the kernels that use tiles (attention.cpp's tiled decode path,
// prefill_attention.cpp, small_gemm.cpp), and the softmax exponential of the attention paths
// with bf16 probabilities (AMX and AVX512-BF16).
// Include it unconditionally: it defines ALIGNEDSERVE_AMX where the compiler targets AMX-BF16
// (the amx path's build), or where the build asks for emulated tiles (ALIGNEDSERVE_AMX_EMULATED,
// amx_emulated.h) on an AVX512-BF16 target; the tile helpers only there, and amx::available()
// everywhere.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(ALIGNEDSERVE_AMX_EMULATED))
#define ALIGNEDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef ALIGNEDSERVE_AMX_EMULATED
#include "amx_emulated.h"
#endif
#endif

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

namespace alignedserve::amx {

#ifdef ALIGNEDSERVE_AMX

// Linux grants the AMX tile state per process, on request (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once.
// (Emulated tiles are ordinary memory: nothing to ask.)
inline bool permitted() {
#ifdef ALIGNEDSERVE_AMX_EMULATED
  return true;
#else
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#endif
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures this thread's eight tiles as 16 rows x 64 bytes each (what most kernels use).
inline void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads only 8 bytes of the config, so without
  // this barrier the other stores may be sunk past ldtilecfg (which then faults).
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

#endif  // ALIGNEDSERVE_AMX

#if defined(__AVX512F__) && defined(__AVX512DQ__)

// Softmax numerators for the attention paths whose probabilities are rounded to bf16 for a bf16
// P.V product (AMX tiles or AVX512-BF16 dot products): tiled decode in attention.cpp, prefill in
// prefill_attention.cpp. Needs AVX-512F/DQ only, so it is defined on every AVX-512 build.
//
// 2^x for x <= 0 (scores minus their max): 2^floor(x) * q(x - floor(x)), with q a degree-4
// polynomial fitted to 2^f on [0, 1) for relative error (2.9e-6, far below the bf16 rounding
// of P, 2^-9; q(0) = 1 exactly). vreduceps gives x - floor(x) and vscalefps applies 2^floor(x)
// in one instruction each. Finite x only (-inf gives NaN): masked scores are kMaskedScore.
inline __m512 exp2_nonpos(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 q = _mm512_set1_ps(0.013426604680716991f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.05224260315299034f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.24128015339374542f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.6930448412895203f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(q, x);
}

// Raw score given to keys a query must not see (its future, or past a row's end): finite
// (exp2_nonpos needs finite input) yet far below any real score, so it never wins the max and
// its probability is exactly 0.
constexpr float kMaskedScore = -1e30f;

#endif  // __AVX512F__ && __AVX512DQ__

// Whether the AMX kernels can run: built for AMX-BF16 and tile state granted by the OS.
inline bool available() {
#ifdef ALIGNEDSERVE_AMX
  return permitted();
#else
  return false;
#endif
}

// Whether this build's tiles are the software emulation's (amx_emulated.h), not the CPU's.
inline bool tiles_emulated() {
#if defined(ALIGNEDSERVE_AMX) && defined(ALIGNEDSERVE_AMX_EMULATED)
  return true;
#else
  return false;
#endif
}

}  // namespace alignedserve::amx
