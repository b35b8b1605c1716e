#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
alignas(64) static uint32_t q[512];
#define C12(M) M(c0) M(c1) M(c2) M(c3) M(c4) M(c5) M(c6) M(c7) M(c8) M(c9) M(c10) M(c11)
#define DECL __m512 c0=_mm512_set1_ps(0),c1=_mm512_set1_ps(1),c2=_mm512_set1_ps(2),c3=_mm512_set1_ps(3),c4=_mm512_set1_ps(4),c5=_mm512_set1_ps(5),c6=_mm512_set1_ps(6),c7=_mm512_set1_ps(7),c8=_mm512_set1_ps(8),c9=_mm512_set1_ps(9),c10=_mm512_set1_ps(10),c11=_mm512_set1_ps(11);
#define BAR __asm__ volatile("" : "+v"(a), "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
#define SUM (_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0,c1),_mm512_add_ps(c2,c3)),_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c4,c5),_mm512_add_ps(c6,c7)),_mm512_add_ps(_mm512_add_ps(c8,c9),_mm512_add_ps(c10,c11))))))
const long iters = 100000000;
double run(int form) {
  DECL
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  auto t0 = std::chrono::steady_clock::now();
  const uint32_t* p = q;
  if (form == 0) {
#define R(x) x = _mm512_dpbf16_ps(x, a, b);
    for (long it = 0; it < iters; ++it) { C12(R) BAR }
  } else if (form == 1) {
#define M(x) __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(x) : "v"(a), "m"(p[__LINE__ % 64]));
    for (long it = 0; it < iters; ++it) { C12(M) BAR __asm__ volatile("" : "+r"(p)); }
  } else {
#define Z(x) __asm__("vdpbf16ps %2, %1, %0" : "+v"(x) : "v"(a), "m"(*(const __m512i*)(p + 16 * (__COUNTER__ % 12))));
    for (long it = 0; it < iters; ++it) { C12(Z) BAR __asm__ volatile("" : "+r"(p)); }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float sink = SUM; (void)sink;
  return iters * 12 / s / 1e9;
}
int main() {
  const char* names[] = {"reg-reg", "{1to16} mem", "zmm mem"};
  for (int rep = 0; rep < 2; ++rep) for (int f = 0; f < 3; ++f) printf("%-12s %.2f G vdpbf16ps/s\n", names[f], run(f));
}
