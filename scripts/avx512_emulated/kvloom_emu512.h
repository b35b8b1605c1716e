// AVX-512 (F, BW, VL, DQ and, unless KVLOOM_EMU_NO_BF16, BF16) emulated on an AVX2 CPU
// through SIMDe, to check the AVX-512 paths' results on a machine that cannot run them
// (check.py beside this file). Included first in every source; the kernels then see
// __AVX512*__ defined, and each _mm512_* name they use maps to a simde_ function or
// to one of the kv_ functions below. Not for production: correctness only.
#pragma once
#include <immintrin.h>
#include <simde/x86/avx512.h>
#define __m512 simde__m512
#define __m512i simde__m512i
#define __m512d simde__m512d
#define __m512bh simde__m512bh
#define __m256bh simde__m256bh
#define _mm512_add_epi32 simde_mm512_add_epi32
#define _mm512_add_ps simde_mm512_add_ps
#define _mm512_and_si512 simde_mm512_and_si512
#define _mm512_castps_si512 simde_mm512_castps_si512
#define _mm512_castsi512_ps simde_mm512_castsi512_ps
#define _mm512_cmp_ps_mask simde_mm512_cmp_ps_mask
#define _mm512_div_ps simde_mm512_div_ps
#define _mm512_dpbf16_ps simde_mm512_dpbf16_ps
#define _mm512_fmadd_ps simde_mm512_fmadd_ps
#define _mm512_load_ps simde_mm512_load_ps
#define _mm512_loadu_ps simde_mm512_loadu_ps
#define _mm512_loadu_si512 simde_mm512_loadu_si512
#define _mm512_mask_mov_epi32 simde_mm512_mask_mov_epi32
#define _mm512_mask_mov_ps simde_mm512_mask_mov_ps
#define _mm512_maskz_mov_ps simde_mm512_maskz_mov_ps
#define _mm512_max_ps simde_mm512_max_ps
#define _mm512_min_ps simde_mm512_min_ps
#define _mm512_mul_ps simde_mm512_mul_ps
#define _mm512_roundscale_ps simde_mm512_roundscale_ps
#define _mm512_scalef_ps simde_mm512_scalef_ps
#define _mm512_set1_epi32 simde_mm512_set1_epi32
#define _mm512_set1_ps simde_mm512_set1_ps
#define _mm512_setr_epi32 simde_mm512_setr_epi32
#define _mm512_setzero_ps simde_mm512_setzero_ps
#define _mm512_setzero_si512 simde_mm512_setzero_si512
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4
#define _mm512_shuffle_ps simde_mm512_shuffle_ps
#define _mm512_slli_epi32 simde_mm512_slli_epi32
#define _mm512_srli_epi32 simde_mm512_srli_epi32
#define _mm512_store_ps simde_mm512_store_ps
#define _mm512_storeu_ps simde_mm512_storeu_ps
#define _mm512_sub_ps simde_mm512_sub_ps
#define _mm512_unpackhi_ps simde_mm512_unpackhi_ps
#define _mm512_unpacklo_ps simde_mm512_unpacklo_ps
// What SIMDe 0.7.4 lacks, written lane by lane after Intel's pseudocode (reductions in
// GCC's avx512fintrin.h order: the halves, the quarters, then {2,3,0,1} and {1,0,1,0}).
// Sources build with -ffast-math (kvloom/native.py), which would let GCC reorder the
// reductions' sums; the pragma around them keeps each in its written order.
#include <cmath>
#include <cstdint>
#include <cstring>
namespace kv_emu {
struct F16 { float v[16]; };
struct I16 { int32_t v[16]; };
inline F16 f(simde__m512 a) { F16 r; std::memcpy(&r, &a, 64); return r; }
inline I16 i(simde__m512i a) { I16 r; std::memcpy(&r, &a, 64); return r; }
inline simde__m512 pf(const F16& r) { simde__m512 a; std::memcpy(&a, &r, 64); return a; }
inline simde__m512i pi(const I16& r) { simde__m512i a; std::memcpy(&a, &r, 64); return a; }
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
inline float reduce_add(F16 x) {
  float t3[8], t6[4];
  for (int j = 0; j < 8; ++j) t3[j] = x.v[8 + j] + x.v[j];
  for (int j = 0; j < 4; ++j) t6[j] = t3[4 + j] + t3[j];
  const float t8[2] = {t6[0] + t6[2], t6[1] + t6[3]};
  return t8[0] + t8[1];
}
inline float maxps(float a, float b) { return a > b ? a : b; }  // _mm_max_ps: the second if unordered
inline float reduce_max(F16 x) {
  float t3[8], t6[4];
  for (int j = 0; j < 8; ++j) t3[j] = maxps(x.v[8 + j], x.v[j]);
  for (int j = 0; j < 4; ++j) t6[j] = maxps(t3[4 + j], t3[j]);
  const float t8[4] = {maxps(t6[0], t6[2]), maxps(t6[1], t6[3]), maxps(t6[2], t6[0]), maxps(t6[3], t6[1])};
  return maxps(t8[0], t8[1]);
}
#pragma GCC pop_options
inline uint16_t to_bf16_rne(float x) {  // vcvtneps2bf16: RNE, NaN -> quiet
  uint32_t b; std::memcpy(&b, &x, 4);
  if (std::isnan(x)) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
}  // namespace kv_emu
inline float kv_mm512_reduce_add_ps(simde__m512 a) { return kv_emu::reduce_add(kv_emu::f(a)); }
inline float kv_mm512_reduce_max_ps(simde__m512 a) { return kv_emu::reduce_max(kv_emu::f(a)); }
inline float kv_mm512_mask_reduce_max_ps(uint16_t m, simde__m512 a) {
  kv_emu::F16 x = kv_emu::f(a);
  for (int j = 0; j < 16; ++j) if (!((m >> j) & 1)) x.v[j] = -INFINITY;
  return kv_emu::reduce_max(x);
}
inline int kv_mm512_mask_reduce_min_epi32(uint16_t m, simde__m512i a) {
  kv_emu::I16 x = kv_emu::i(a);
  int r = INT32_MAX;
  for (int j = 0; j < 16; ++j) if ((m >> j) & 1) r = x.v[j] < r ? x.v[j] : r;
  return r;
}
inline uint16_t kv_mm512_mask_cmp_ps_mask(uint16_t k, simde__m512 a, simde__m512 b, int imm) {
  return static_cast<uint16_t>(k & simde_mm512_cmp_ps_mask(a, b, imm));
}
inline simde__m512 kv_mm512_maskz_loadu_ps(uint16_t m, const void* p) {
  kv_emu::F16 r{};
  for (int j = 0; j < 16; ++j) if ((m >> j) & 1) std::memcpy(&r.v[j], static_cast<const char*>(p) + 4 * j, 4);
  return kv_emu::pf(r);
}
inline void kv_mm512_mask_storeu_ps(void* p, uint16_t m, simde__m512 a) {
  const kv_emu::F16 x = kv_emu::f(a);
  for (int j = 0; j < 16; ++j) if ((m >> j) & 1) std::memcpy(static_cast<char*>(p) + 4 * j, &x.v[j], 4);
}
inline __m256i kv_mm256_maskz_loadu_epi16(uint16_t m, const void* p) {
  uint16_t r[16] = {};
  for (int j = 0; j < 16; ++j) if ((m >> j) & 1) std::memcpy(&r[j], static_cast<const char*>(p) + 2 * j, 2);
  __m256i a; std::memcpy(&a, r, 32); return a;
}
inline void kv_mm256_mask_storeu_epi16(void* p, uint16_t m, __m256i a) {
  uint16_t x[16]; std::memcpy(x, &a, 32);
  for (int j = 0; j < 16; ++j) if ((m >> j) & 1) std::memcpy(static_cast<char*>(p) + 2 * j, &x[j], 2);
}
inline __m256i kv_mm512_cvtepi32_epi16(simde__m512i a) {  // truncation
  const kv_emu::I16 x = kv_emu::i(a);
  uint16_t r[16];
  for (int j = 0; j < 16; ++j) r[j] = static_cast<uint16_t>(x.v[j]);
  __m256i o; std::memcpy(&o, r, 32); return o;
}
inline simde__m512i kv_mm512_cvtepu16_epi32(__m256i a) {
  uint16_t x[16]; std::memcpy(x, &a, 32);
  kv_emu::I16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = x[j];
  return kv_emu::pi(r);
}
inline simde__m256bh kv_mm512_cvtneps_pbh(simde__m512 a) {
  const kv_emu::F16 x = kv_emu::f(a);
  uint16_t r[16];
  for (int j = 0; j < 16; ++j) r[j] = kv_emu::to_bf16_rne(x.v[j]);
  simde__m256bh o; std::memcpy(&o, r, 32); return o;
}
// vfpclassps: lane j's bit set where its class is one that imm names (Intel's imm8 bits:
// 0 QNaN, 1 +0, 2 -0, 3 +inf, 4 -inf, 5 denormal, 6 negative finite but not -0, 7 SNaN;
// checked against the instruction on an AVX-512 CPU over all 256 imm values).
inline uint16_t kv_mm512_fpclass_ps_mask(simde__m512 a, int imm) {
  const kv_emu::F16 x = kv_emu::f(a);
  uint16_t mask = 0;
  for (int j = 0; j < 16; ++j) {
    uint32_t bits;
    std::memcpy(&bits, &x.v[j], 4);
    const uint32_t exponent = (bits >> 23) & 0xff, fraction = bits & 0x7fffff;
    const bool negative = bits >> 31, nan = exponent == 0xff && fraction != 0;
    const bool classes[8] = {nan && (fraction & 0x400000) != 0, bits == 0, bits == 0x80000000u,
                             bits == 0x7f800000u, bits == 0xff800000u, exponent == 0 && fraction != 0,
                             negative && exponent != 0xff && bits != 0x80000000u,  // not -0
                             nan && (fraction & 0x400000) == 0};
    for (int c = 0; c < 8; ++c)
      if (((imm >> c) & 1) && classes[c]) mask |= static_cast<uint16_t>(1u << j);
  }
  return mask;
}
// vdpbf16ps: acc + hi * hi (rounded), then + lo * lo (rounded); products exact in float32.
inline simde__m512 kv_mm512_dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
  kv_emu::F16 s = kv_emu::f(src);
  uint16_t x[32], y[32]; std::memcpy(x, &a, 64); std::memcpy(y, &b, 64);
  const auto wide = [](uint16_t h) { uint32_t w = static_cast<uint32_t>(h) << 16; float v; std::memcpy(&v, &w, 4); return v; };
  for (int j = 0; j < 16; ++j) {
    s.v[j] = std::fma(wide(x[2 * j + 1]), wide(y[2 * j + 1]), s.v[j]);
    s.v[j] = std::fma(wide(x[2 * j]), wide(y[2 * j]), s.v[j]);
  }
  return kv_emu::pf(s);
}
#define _mm256_mask_storeu_epi16 kv_mm256_mask_storeu_epi16
#define _mm256_maskz_loadu_epi16 kv_mm256_maskz_loadu_epi16
#define _mm512_cvtepi32_epi16 kv_mm512_cvtepi32_epi16
#define _mm512_cvtepu16_epi32 kv_mm512_cvtepu16_epi32
#define _mm512_cvtneps_pbh kv_mm512_cvtneps_pbh
#define _mm512_fpclass_ps_mask kv_mm512_fpclass_ps_mask
#define _mm512_mask_cmp_ps_mask kv_mm512_mask_cmp_ps_mask
#define _mm512_mask_reduce_max_ps kv_mm512_mask_reduce_max_ps
#define _mm512_mask_reduce_min_epi32 kv_mm512_mask_reduce_min_epi32
#define _mm512_mask_storeu_ps kv_mm512_mask_storeu_ps
#define _mm512_maskz_loadu_ps kv_mm512_maskz_loadu_ps
#define _mm512_reduce_add_ps kv_mm512_reduce_add_ps
#define _mm512_reduce_max_ps kv_mm512_reduce_max_ps
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps kv_mm512_dpbf16_ps
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#ifndef KVLOOM_EMU_NO_BF16
#define __AVX512BF16__ 1
#endif
