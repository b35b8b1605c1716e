// rms_norm (with the residual) as cpu_ops.cpp has it, against a version that packs the residual once,
// keeps the row's float32 values for the second pass and widens the weight once a call (bit-identical).
// One thread, 576 wide.  g++ -O3 -march=native -ffast-math -fno-finite-math-only -std=c++17 -I kvloom/csrc rms_staged.cpp
#include <chrono>
#include <cstdio>
#include <cmath>
#include <vector>
#include <random>
#include <cstring>
#include "simd.h"
using namespace kvloom_simd;
using T = uint16_t;
__attribute__((noinline)) void rms_a(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n; T* res = residual + r * n; T* o = out + r * n;
    __m512 sum_v = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      __m512 v = load16(xr + i, n - i);
      v = round16(_mm512_add_ps(v, load16(res + i, n - i)), res);
      store16(res + i, v, n - i);
      sum_v = _mm512_fmadd_ps(v, v, sum_v);
    }
    const __m512 inv_v = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sum_v) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 normed = round16(_mm512_mul_ps(load16(res + i, n - i), inv_v), o);
      store16(o + i, _mm512_mul_ps(load16(weight + i, n - i), normed), n - i);
    }
  }
}
__attribute__((noinline)) void rms_b(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  static thread_local std::vector<float> wf, vf;
  wf.resize(n + 16); vf.resize(n + 16);
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(wf.data() + i, load16(weight + i, n - i));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n; T* res = residual + r * n; T* o = out + r * n;
    __m512 sum_v = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m256i packed = bf16_pack(_mm512_add_ps(load16(xr + i, n - i), load16(res + i, n - i)));
      _mm256_mask_storeu_epi16(res + i, lanes(n - i), packed);
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16));
      _mm512_storeu_ps(vf.data() + i, v);
      sum_v = _mm512_fmadd_ps(v, v, sum_v);
    }
    const __m512 inv_v = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sum_v) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 normed = round16(_mm512_mul_ps(_mm512_loadu_ps(vf.data() + i), inv_v), o);
      store16(o + i, _mm512_mul_ps(_mm512_loadu_ps(wf.data() + i), normed), n - i);
    }
  }
}
int main() {
  for (int64_t rows : {16, 256, 2048}) {
    const int64_t n = 576;
    std::vector<T> x(rows * n), res(rows * n), res2, w(n), o1(rows * n), o2(rows * n);
    std::mt19937 rng(1); std::normal_distribution<float> nd(0, 1);
    auto bf = [&](float f) { uint32_t b; memcpy(&b, &f, 4); return (uint16_t)(b >> 16); };
    for (auto& v : x) v = bf(nd(rng)); for (auto& v : res) v = bf(nd(rng)); for (auto& v : w) v = bf(nd(rng));
    std::vector<T> r1 = res, r2 = res;
    rms_a(x.data(), r1.data(), w.data(), o1.data(), rows, n, 1e-5f);
    rms_b(x.data(), r2.data(), w.data(), o2.data(), rows, n, 1e-5f);
    bool same = o1 == o2 && r1 == r2;
    int reps = 20000 / rows;
    double ta = 1e9, tb = 1e9;
    for (int k = 0; k < 7; ++k) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) { r1 = res; rms_a(x.data(), r1.data(), w.data(), o1.data(), rows, n, 1e-5f); }
      auto t1 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) { r2 = res; rms_b(x.data(), r2.data(), w.data(), o2.data(), rows, n, 1e-5f); }
      auto t2 = std::chrono::steady_clock::now();
      ta = std::min(ta, std::chrono::duration<double>(t1 - t0).count() / reps / rows * 1e9);
      tb = std::min(tb, std::chrono::duration<double>(t2 - t1).count() / reps / rows * 1e9);
    }
    printf("rows %ld: now %.1f ns/row, staged %.1f ns/row (%.2fx) same=%d\n", rows, ta, tb, ta / tb, same);
  }
}
