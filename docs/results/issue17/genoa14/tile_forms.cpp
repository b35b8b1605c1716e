// The GEMM's 6 x 4 tile alone (notes.txt section 5): K = 576, weights [Q][4][16] words from L2, x
// broadcast explicitly or as a {1to16} operand.  g++ -O3 -march=native tile_forms.cpp && ./a.out
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
// 6x4 tile over K pairs: weights from a [Q][4][16] word buffer (L1), x from [6][Q] words.
constexpr int Q = 288;
alignas(64) static uint32_t W[Q * 64];
alignas(64) static uint32_t X[6 * Q];
__attribute__((noinline)) void tile_bcast(__m512* out) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
  for (int q = 0; q < Q; ++q) {
    __m512bh w0 = (__m512bh)_mm512_load_si512(W + q * 64), w1 = (__m512bh)_mm512_load_si512(W + q * 64 + 16),
             w2 = (__m512bh)_mm512_load_si512(W + q * 64 + 32), w3 = (__m512bh)_mm512_load_si512(W + q * 64 + 48);
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      __m512bh x = (__m512bh)_mm512_set1_epi32(X[r * Q + q]);
      acc[r * 4 + 0] = _mm512_dpbf16_ps(acc[r * 4 + 0], x, w0);
      acc[r * 4 + 1] = _mm512_dpbf16_ps(acc[r * 4 + 1], x, w1);
      acc[r * 4 + 2] = _mm512_dpbf16_ps(acc[r * 4 + 2], x, w2);
      acc[r * 4 + 3] = _mm512_dpbf16_ps(acc[r * 4 + 3], x, w3);
    }
  }
  for (int i = 0; i < 24; ++i) out[i] = acc[i];
}
#define DP(A, W_, ADDR) __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(A) : "v"(W_), "m"(ADDR));
__attribute__((noinline)) void tile_fold(__m512* out) {
  __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0,a12=a0,a13=a0,a14=a0,a15=a0,a16=a0,a17=a0,a18=a0,a19=a0,a20=a0,a21=a0,a22=a0,a23=a0;
  for (int q = 0; q < Q; ++q) {
    __m512 w0 = _mm512_load_ps((float*)W + q * 64), w1 = _mm512_load_ps((float*)W + q * 64 + 16),
           w2 = _mm512_load_ps((float*)W + q * 64 + 32), w3 = _mm512_load_ps((float*)W + q * 64 + 48);
#define ROW(r, A0, A1, A2, A3) DP(A0, w0, X[r * Q + q]) DP(A1, w1, X[r * Q + q]) DP(A2, w2, X[r * Q + q]) DP(A3, w3, X[r * Q + q])
    ROW(0, a0, a1, a2, a3) ROW(1, a4, a5, a6, a7) ROW(2, a8, a9, a10, a11) ROW(3, a12, a13, a14, a15) ROW(4, a16, a17, a18, a19) ROW(5, a20, a21, a22, a23)
  }
  __m512 t[24] = {a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11,a12,a13,a14,a15,a16,a17,a18,a19,a20,a21,a22,a23};
  for (int i = 0; i < 24; ++i) out[i] = t[i];
}
int main() {
  for (int i = 0; i < Q * 64; ++i) W[i] = 0x3f803f80u;
  for (int i = 0; i < 6 * Q; ++i) X[i] = 0x00010001u;
  __m512 out[24];
  for (int rep = 0; rep < 3; ++rep) {
    for (int f = 0; f < 2; ++f) {
      auto t0 = std::chrono::steady_clock::now();
      const int calls = 200000;
      for (int c = 0; c < calls; ++c) { f ? tile_fold(out) : tile_bcast(out); __asm__ volatile("" ::: "memory"); }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      printf("%s %.3f G dpbf16/s (%.1f%% of 3.65)\n", f ? "fold  " : "bcast ", calls * 24.0 * Q / s / 1e9, calls * 24.0 * Q / s / 1e9 / 3.65 * 100);
    }
  }
}
