// This CPU's float32 fma peak on AVX2: each of 2 threads runs 12 independent chains of
// 8-lane fmas (more than the 2 pipes x 4 cycles of latency need), best of 5, GFLOP/s.
//   gcc -O2 -mavx2 -mfma -fopenmp docs/results/issue17/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

int main(void) {
  const long steps = 200000000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(2)
    {
      __m256 acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(i * 0.001f);
      const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
      for (long n = 0; n < steps; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], b, c);
      }
      float sum = 0;
      for (int i = 0; i < 12; ++i) sum += acc[i][0];
      if (sum == 1234.0f) printf("unlikely\n");  // keeps the chains live
    }
    const double gflops = 2.0 * steps * 12 * 8 * 2 / (omp_get_wtime() - start) / 1e9;
    if (gflops > best) best = gflops;
  }
  printf("fma peak: %.1f GFLOP/s (2 threads)\n", best);
  return 0;
}
