// Shared Intel AMX set-up for the kernels that use tiles (prefill_attention.cpp,
// small_gemm.cpp). Include only where ALIGNEDSERVE_AMX is defined, i.e. the compiler targets
// AMX-BF16 (-march=native on Sapphire Rapids and later).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace alignedserve::amx {

// Linux grants the AMX tile state per process, on request (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once.
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures this thread's eight tiles as 16 rows x 64 bytes each (what both kernels use).
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

}  // namespace alignedserve::amx
