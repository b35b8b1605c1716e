// Feasibility: a Q4_1-dequant-on-the-fly GEMV/GEMM (M rows) vs the same loop over packed bf16.
// Weights: the 30 layers' shapes and the head, both 2 threads (notes.txt section 1); the data is
// arbitrary (timing only).  g++ -O3 -fopenmp q4bench.cpp && OMP_NUM_THREADS=2 ./a.out
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
struct Mat { int n, k; uint32_t* bf; uint8_t* q4; };
// bf16 packed: block j: [k/2][16] words. q4 packed: block j: for each kblock t (32 k): 16 pairs x 16 bytes nibbles, then d[16] f32, m[16] f32 = 384 bytes
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma"))) void gemm_bf(const Mat& a, const uint16_t* x, float* y) {
  int blocks = a.n / 16;
#pragma omp parallel for schedule(static)
  for (int j = 0; j < blocks; j += 4) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int q = 0; q < a.k / 2; ++q) {
      __m512bh w[4];
      for (int b = 0; b < 4; ++b) w[b] = (__m512bh)_mm512_loadu_si512(a.bf + (size_t)(j + b) * a.k / 2 * 16 + q * 16);
      for (int r = 0; r < R; ++r) {
        uint32_t p; memcpy(&p, x + r * a.k + 2 * q, 4);
        __m512bh in = (__m512bh)_mm512_set1_epi32(p);
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], in, w[b]);
      }
    }
    for (int r = 0; r < R; ++r) for (int b = 0; b < 4; ++b) _mm512_storeu_ps(y + r * a.n + (j + b) * 16, acc[r][b]);
  }
}
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma"))) void gemm_q4(const Mat& a, const uint16_t* x, float* y) {
  int blocks = a.n / 16;
  const __m512i idx = _mm512_set_epi16(31,15,30,14,29,13,28,12,27,11,26,10,25,9,24,8,23,7,22,6,21,5,20,4,19,3,18,2,17,1,16,0);
  const __m512i lo = _mm512_set1_epi32(15);
  size_t block_bytes = (size_t)a.k / 32 * 384;
#pragma omp parallel for schedule(static)
  for (int j = 0; j < blocks; j += 4) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int t = 0; t < a.k / 32; ++t) {
      for (int q = 0; q < 16; ++q) {
        __m512bh w[4];
        for (int b = 0; b < 4; ++b) {
          const uint8_t* base = a.q4 + (size_t)(j + b) * block_bytes + t * 384;
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(base + q * 16)));
          __m512 ev = _mm512_cvtepi32_ps(_mm512_and_si512(v, lo));
          __m512 od = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
          __m512 d = _mm512_loadu_ps((const float*)(base + 256));
          __m512 m = _mm512_loadu_ps((const float*)(base + 320));
          ev = _mm512_fmadd_ps(ev, d, m);
          od = _mm512_fmadd_ps(od, d, m);
          w[b] = (__m512bh)_mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(od, ev));
        }
        for (int r = 0; r < R; ++r) {
          uint32_t p; memcpy(&p, x + r * a.k + 2 * (t * 16 + q), 4);
          __m512bh in = (__m512bh)_mm512_set1_epi32(p);
          for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], in, w[b]);
        }
      }
    }
    for (int r = 0; r < R; ++r) for (int b = 0; b < 4; ++b) _mm512_storeu_ps(y + r * a.n + (j + b) * 16, acc[r][b]);
  }
}
template <int R> double run(std::vector<Mat>& mats, bool q4, const uint16_t* x, float* y) {
  auto t0 = std::chrono::steady_clock::now();
  for (auto& m : mats) q4 ? gemm_q4<R>(m, x, y) : gemm_bf<R>(m, x, y);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  std::vector<Mat> mats;
  int shapes[5][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {0, 0}};
  for (int l = 0; l < 30; ++l) for (int s = 0; s < 4; ++s) {
    Mat m{shapes[s][0], shapes[s][1]};
    m.bf = (uint32_t*)aligned_alloc(64, (size_t)m.n * m.k * 2);
    m.q4 = (uint8_t*)aligned_alloc(64, (size_t)m.n / 16 * m.k / 32 * 384);
    for (size_t i = 0; i < (size_t)m.n * m.k / 2; ++i) m.bf[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);
    for (size_t i = 0; i < (size_t)m.n / 16 * m.k / 32 * 384; ++i) m.q4[i] = (uint8_t)(i * 37);
    for (size_t b = 0; b < (size_t)m.n / 16 * m.k / 32; ++b) { float* f = (float*)(m.q4 + b * 384 + 256); for (int i = 0; i < 32; ++i) f[i] = 0.01f; }
    mats.push_back(m);
  }
  // lm head too
  { Mat m{49152, 576}; m.bf = (uint32_t*)aligned_alloc(64, (size_t)m.n * m.k * 2); m.q4 = (uint8_t*)aligned_alloc(64, (size_t)m.n / 16 * m.k / 32 * 384);
    memset(m.bf, 0x3c, (size_t)m.n*m.k*2); memset(m.q4, 0x11, (size_t)m.n / 16 * m.k / 32 * 384); mats.push_back(m); }
  std::vector<uint16_t> x(16 * 3072, 0x3c00); std::vector<float> y(16 * 49152);
  for (int rep = 0; rep < 3; ++rep) {
    double a1 = 1e9, b1 = 1e9, a4 = 1e9, b4 = 1e9, a8 = 1e9, b8 = 1e9;
    for (int i = 0; i < 15; ++i) {
      a1 = std::min(a1, run<1>(mats, false, x.data(), y.data())); b1 = std::min(b1, run<1>(mats, true, x.data(), y.data()));
      a4 = std::min(a4, run<4>(mats, false, x.data(), y.data())); b4 = std::min(b4, run<4>(mats, true, x.data(), y.data()));
      a8 = std::min(a8, run<6>(mats, false, x.data(), y.data())); b8 = std::min(b8, run<6>(mats, true, x.data(), y.data()));
    }
    printf("rows 1: bf16 %.2f q4 %.2f | rows 4: bf16 %.2f q4 %.2f | rows 6: bf16 %.2f q4 %.2f ms\n", a1, b1, a4, b4, a8, b8);
  }
}
