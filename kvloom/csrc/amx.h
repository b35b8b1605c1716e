// AMX plumbing shared by kvloom's kernels (gemm.cpp, paged_attention.cpp): Linux's
// permission for tile state, and the operand of ldtilecfg. No intrinsics here, so any
// build may include it; the tile instructions stay in each kernel.
#pragma once
#include <cstdint>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvloom_amx {

// Linux hands out AMX tile state only on request (asked once per library and process);
// without it the first tile instruction dies with SIGILL.
inline bool permitted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

// Palette 1: each tile's rows and bytes per row (unset tiles stay 0: unused).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int tile_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

}  // namespace kvloom_amx
