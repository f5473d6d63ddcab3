// AMX-BF16 tiles done in software, so the amx path's kernels run (slowly) on a CPU without AMX
// that has AVX512-BF16: the tests can check their logic (tile shapes, strides, tails, the
// layouts they read) on every machine that can run the rest of the amx build. Built only where
// the build asks for it (-DALIGNEDSERVE_AMX_EMULATED: alignedserve/kernels/build.py, with
// ALIGNEDSERVE_AMX_EMULATE=1 on a CPU without AMX); included by amx.h, never directly.
//
// Each thread has its own eight tiles, as on the hardware. The instructions follow the Intel
// SDM's descriptions (palette 1: eight tiles of at most 16 rows x 64 bytes):
//   ldtilecfg  takes rows and bytes per row for each tile; palette 0 releases them;
//   tileloadd  fills the configured rows, each from base + row * stride, and zeroes the rest;
//   tilestored writes the configured rows; tilezero zeroes a tile;
//   tdpbf16ps  C[m][n] += A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] over k, fp32 lanes.
// Where the hardware raises #UD (a tile used unconfigured, shapes that do not fit together) the
// emulation stops the process with a message, so a wrong shape cannot pass a test unseen.
// tdpbf16ps is done with vdpbf16ps, one row of C at a time: the same sums in the same order of
// k; the hardware's rounding inside a pair of products may differ in the last bit, so tests
// compare the amx path against the reference with tolerances, as they do on the hardware.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace alignedserve::amx::emulated {

constexpr int kTiles = 8, kMaxRows = 16, kMaxBytes = 64;

struct TileFile {
  uint8_t rows[kTiles] = {};      // 0: not configured
  uint16_t colsb[kTiles] = {};
  alignas(64) uint8_t data[kTiles][kMaxRows][kMaxBytes] = {};
};

inline TileFile& tiles() {
  static thread_local TileFile file;
  return file;
}

[[noreturn]] inline void fault(const char* what, int tile) {
  std::fprintf(stderr, "emulated AMX: %s (tile %d)\n", what, tile);
  std::abort();
}

inline void check_tile(int t) {
  if (t < 0 || t >= kTiles) fault("no such tile", t);
  if (tiles().rows[t] == 0) fault("tile used before ldtilecfg configured it", t);
}

// The 64-byte ldtilecfg block: palette, start row, 14 reserved bytes, then 16 colsb (uint16)
// and 16 rows (uint8); tiles 8-15 must be unused in palette 1.
inline void load_config(const void* config) {
  const auto* bytes = static_cast<const uint8_t*>(config);
  TileFile& file = tiles();
  if (bytes[0] == 0) {
    file = TileFile{};
    return;
  }
  if (bytes[0] != 1) fault("palette other than 0 or 1", -1);
  for (int t = kTiles; t < 16; ++t) {
    if (bytes[48 + t] != 0 || bytes[16 + 2 * t] != 0 || bytes[17 + 2 * t] != 0) {
      fault("palette 1 has eight tiles", t);
    }
  }
  for (int t = 0; t < kTiles; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, bytes + 16 + 2 * t, 2);
    const uint8_t rows = bytes[48 + t];
    if (rows > kMaxRows || colsb > kMaxBytes || (rows == 0) != (colsb == 0)) {
      fault("tile shape outside palette 1", t);
    }
    file.rows[t] = rows;
    file.colsb[t] = colsb;
  }
  std::memset(file.data, 0, sizeof file.data);
}

inline void release() { tiles() = TileFile{}; }

inline void zero(int t) {
  check_tile(t);
  std::memset(tiles().data[t], 0, sizeof tiles().data[t]);
}

inline void load(int t, const void* base, int64_t stride) {
  check_tile(t);
  TileFile& file = tiles();
  std::memset(file.data[t], 0, sizeof file.data[t]);
  for (int r = 0; r < file.rows[t]; ++r) {
    std::memcpy(file.data[t][r], static_cast<const uint8_t*>(base) + r * stride, file.colsb[t]);
  }
}

inline void store(int t, void* base, int64_t stride) {
  check_tile(t);
  const TileFile& file = tiles();
  for (int r = 0; r < file.rows[t]; ++r) {
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, file.data[t][r], file.colsb[t]);
  }
}

inline void dpbf16ps(int c, int a, int b) {
  check_tile(c);
  check_tile(a);
  check_tile(b);
  TileFile& file = tiles();
  const int m_rows = file.rows[c], n_lanes = file.colsb[c] / 4, k_pairs = file.colsb[a] / 4;
  if (c == a || c == b || a == b) fault("tdpbf16ps with a tile named twice", c);
  if (file.rows[a] != m_rows || file.rows[b] != k_pairs || file.colsb[b] != file.colsb[c] ||
      file.colsb[c] % 4 != 0 || file.colsb[a] % 4 != 0) {
    fault("tdpbf16ps tile shapes do not fit together", c);
  }
  const __mmask16 lanes = static_cast<__mmask16>((1u << n_lanes) - 1);
  for (int m = 0; m < m_rows; ++m) {
    float* out = reinterpret_cast<float*>(file.data[c][m]);
    __m512 acc = _mm512_maskz_loadu_ps(lanes, out);
    for (int k = 0; k < k_pairs; ++k) {
      int32_t pair;
      std::memcpy(&pair, file.data[a][m] + 4 * k, 4);
      const __m512i row = _mm512_maskz_loadu_epi32(lanes, file.data[b][k]);
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(row),
                             reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)));
    }
    _mm512_mask_storeu_ps(out, lanes, acc);
  }
}

}  // namespace alignedserve::amx::emulated

// The compiler's AMX intrinsics (macros over inline asm, and two inline functions) are replaced
// by the emulation for the rest of the translation unit.
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) ::alignedserve::amx::emulated::load_config(config)
#define _tile_release() ::alignedserve::amx::emulated::release()
#define _tile_zero(t) ::alignedserve::amx::emulated::zero(t)
#define _tile_loadd(t, base, stride) ::alignedserve::amx::emulated::load(t, base, stride)
#define _tile_stream_loadd(t, base, stride) ::alignedserve::amx::emulated::load(t, base, stride)
#define _tile_stored(t, base, stride) ::alignedserve::amx::emulated::store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) ::alignedserve::amx::emulated::dpbf16ps(c, a, b)
