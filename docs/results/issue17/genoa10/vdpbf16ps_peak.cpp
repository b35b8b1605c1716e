// The vdpbf16ps peak of one core: 12 independent zmm accumulators in registers (the asm
// barrier keeps them apart). g++ -O2 -mavx512f -mavx512bf16 -o /tmp/peak vdpbf16ps_peak.cpp
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define D(x) x = _mm512_dpbf16_ps(x, a, b);
int main() {
  __m512 c0=_mm512_set1_ps(0),c1=_mm512_set1_ps(1),c2=_mm512_set1_ps(2),c3=_mm512_set1_ps(3),c4=_mm512_set1_ps(4),c5=_mm512_set1_ps(5),c6=_mm512_set1_ps(6),c7=_mm512_set1_ps(7),c8=_mm512_set1_ps(8),c9=_mm512_set1_ps(9),c10=_mm512_set1_ps(10),c11=_mm512_set1_ps(11);
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  const long iters = 200000000;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < iters; ++it) {
      D(c0) D(c1) D(c2) D(c3) D(c4) D(c5) D(c6) D(c7) D(c8) D(c9) D(c10) D(c11)
      __asm__ volatile("" : "+v"(a), "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%.1f GFLOP/s one thread (%.2f G vdpbf16ps/s)\n", iters * 12 * 64 / s / 1e9, iters * 12 / s / 1e9);
  }
  __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0,c1),_mm512_add_ps(c2,c3)),_mm512_add_ps(_mm512_add_ps(c4,c5),_mm512_add_ps(c6,c7)));
  t = _mm512_add_ps(t, _mm512_add_ps(_mm512_add_ps(c8,c9),_mm512_add_ps(c10,c11)));
  return _mm512_reduce_add_ps(t) == 0.123f;
}
