// silu_and_mul's bf16 arithmetic against a table of its own answers for all 65,536 bf16
// inputs, read with vpgatherdd (bit-identical by construction: the table is the kernel run on
// every input with up = 1). One thread; ROWS rows of 1,536.
//   g++ -O3 -march=native -ffast-math -fno-finite-math-only -std=c++17 -DROWS=64 -I kvloom/csrc silu_table.cpp
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
#include "simd.h"
using namespace kvloom_simd;
__attribute__((noinline)) void silu_arith(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * 2 * n; const uint16_t* u = g + n; uint16_t* o = out + r * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 gv = load16(g + i, n - i);
      const __m512 silu = round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)))), o);
      store16(o + i, _mm512_mul_ps(silu, load16(u + i, n - i)), n - i);
    }
  }
}
__attribute__((noinline)) void silu_lut(const uint16_t* table, const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * 2 * n; const uint16_t* u = g + n; uint16_t* o = out + r * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512i idx = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes(n - i), g + i));
      const __m512i s = _mm512_i32gather_epi32(idx, table, 2);
      const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
      store16(o + i, _mm512_mul_ps(silu, load16(u + i, n - i)), n - i);
    }
  }
}
int main() {
  std::vector<uint16_t> gate(65536 * 2), table(65536 + 2);
  for (int i = 0; i < 65536; ++i) { gate[i] = i; gate[65536 + i] = 0x3f80; }
  silu_arith(gate.data(), table.data(), 1, 65536);
  const int64_t rows = ROWS, n = 1536;
  std::vector<uint16_t> gu(rows * 2 * n), o1(rows * n), o2(rows * n);
  std::mt19937 rng(1); std::uniform_int_distribution<int> d(0, 65535); std::normal_distribution<float> nd(0, 2);
  for (auto& v : gu) { float f = nd(rng); uint32_t b; memcpy(&b, &f, 4); v = b >> 16; }
  for (int i = 0; i < 4096; ++i) gu[d(rng) % gu.size()] = d(rng);  // some arbitrary bit patterns
  for (int rep = 0; rep < 5; ++rep) { for (int w = 0; w < 2048 / ROWS - 1; ++w) { silu_arith(gu.data(), o1.data(), rows, n); silu_lut(table.data(), gu.data(), o2.data(), rows, n); }
    auto t0 = std::chrono::steady_clock::now();
    silu_arith(gu.data(), o1.data(), rows, n);
    auto t1 = std::chrono::steady_clock::now();
    silu_lut(table.data(), gu.data(), o2.data(), rows, n);
    auto t2 = std::chrono::steady_clock::now();
    double a = std::chrono::duration<double>(t1 - t0).count(), b = std::chrono::duration<double>(t2 - t1).count();
    printf("arith %.2f ms (%.2f ns/vec)  lut %.2f ms (%.2f ns/vec)  same=%d\n", a * 1e3, a * 1e9 / (rows * n / 16), b * 1e3, b * 1e9 / (rows * n / 16), o1 == o2);
  }
}
