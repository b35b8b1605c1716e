// AMX tiles in plain C++, for scripts/amx_emulated/check.py: included first by gemm.cpp and
// paged_attention.cpp, it stands in for the tile intrinsics those kernels use, so that their
// AMX paths build and run (slowly) on a CPU without AMX. Each thread holds the eight tiles
// and their configuration; the dot product follows Intel's pseudocode for TDPBF16PS (per
// output, for each k pair, the even product and then the odd one added in float32), without
// its denormal flushing. What this checks is the kernels' tile plumbing (configurations,
// strides, tails, stores), not the hardware's exact rounding or speed.
#pragma once
#include <immintrin.h>  // first: the real intrinsics' header, whose names are taken over below

#include <cstdint>
#include <cstring>

#define __AMX_TILE__ 1  // the kernels' #if: their AMX paths exist in this build
#define __AMX_BF16__ 1

namespace kvloom_emu_amx {

constexpr int TILES = 8, MAX_ROWS = 16, MAX_BYTES = 64;

struct State {
  int rows[TILES] = {};
  int bytes[TILES] = {};  // bytes per row
  alignas(64) unsigned char data[TILES][MAX_ROWS][MAX_BYTES] = {};
};
inline State& state() {
  static thread_local State tiles;
  return tiles;
}

// ldtilecfg's 64-byte operand: palette, start row, 14 reserved, 16 x colsb (uint16), 16 x rows.
inline void loadconfig(const void* config) {
  const unsigned char* bytes = static_cast<const unsigned char*>(config);
  State& s = state();
  for (int t = 0; t < TILES; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, bytes + 16 + 2 * t, sizeof(colsb));
    s.bytes[t] = colsb;
    s.rows[t] = bytes[48 + t];
  }
}
inline void release() { state() = State(); }
inline void zero(int t) { std::memset(state().data[t], 0, sizeof(state().data[t])); }
inline void loadd(int t, const void* base, long stride) {
  State& s = state();
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.data[t][r], static_cast<const unsigned char*>(base) + r * stride, s.bytes[t]);
}
inline void stored(int t, void* base, long stride) {
  const State& s = state();
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(static_cast<unsigned char*>(base) + r * stride, s.data[t][r], s.bytes[t]);
}
inline float bf16(const unsigned char* at) {
  uint16_t half;
  std::memcpy(&half, at, sizeof(half));
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
// c (float32 rows x columns) += a (rows x k pairs of bf16) . b (k rows x column pairs of bf16).
inline void dpbf16ps(int c, int a, int b) {
  State& s = state();
  for (int m = 0; m < s.rows[c]; ++m)
    for (int n = 0; n < s.bytes[c] / 4; ++n) {
      float sum;
      std::memcpy(&sum, s.data[c][m] + 4 * n, sizeof(sum));
      for (int k = 0; k < s.bytes[a] / 4; ++k) {
        sum += bf16(s.data[a][m] + 4 * k) * bf16(s.data[b][k] + 4 * n);
        sum += bf16(s.data[a][m] + 4 * k + 2) * bf16(s.data[b][k] + 4 * n + 2);
      }
      std::memcpy(s.data[c][m] + 4 * n, &sum, sizeof(sum));
    }
}

}  // namespace kvloom_emu_amx

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) kvloom_emu_amx::loadconfig(config)
#define _tile_release() kvloom_emu_amx::release()
#define _tile_zero(t) kvloom_emu_amx::zero(t)
#define _tile_loadd(t, base, stride) kvloom_emu_amx::loadd(t, base, stride)
#define _tile_stored(t, base, stride) kvloom_emu_amx::stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) kvloom_emu_amx::dpbf16ps(c, a, b)
