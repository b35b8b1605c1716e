// MXFP4 linear layers for CPUs: y[m, n] = x[m, k] @ W[n, k]^T (+ bias), with W held as an
// MXFP4 checkpoint stores it (GPT-OSS's experts) and never materialised: 4.25 bits a weight
// are read once per call, where a dequantized bf16 copy would be 16.
//
// Weight: blocks [n, k / 32, 16] uint8 (byte b of group g of row r: W[r][32g + 2b] in its
// low nibble, W[r][32g + 2b + 1] in its high one, each an e2m1 code) and scales [n, k / 32]
// uint8 (e8m0: group g of row r is multiplied by 2^(scale - 127)).
//
// Invariant (what makes a row's result independent of the batch, kvloom's exactness
// promise): every output y[i][r] is 16 float32 lane accumulators, lane l taking group g's
// pair (32g + 2l + 1, 32g + 2l) for g = 0, 1, ... in order, as one vdpbf16ps lane does:
//   acc[l] = RNE(acc[l] + w[32g + 2l + 1] * x[i][32g + 2l + 1])   (the high half first)
//   acc[l] = RNE(acc[l] + w[32g + 2l] * x[i][32g + 2l])
// with w the weight as the scale's table gives it; then the 16 lanes summed in one fixed
// tree (l + 8, l + 4, l + 2, l + 1), the bias added, one rounding to y's dtype. Threads
// split n only, and the tiles (which rows and columns share registers) change no operation
// of any output. So a row gives the same bits alone as in any batch, on any thread count.
//
// The scale is folded into the weights, not applied to each group's dot product: a table
// per scale holds E2M1[c] * 2^(scale - 127) (exact: an e2m1 value has two significant bits),
// so a group costs one vdpbf16ps per row of x instead of a vdpbf16ps and an fma; decoding
// (one table lookup of the 32 codes) is shared by every row of x in the tile.
//
// Paths (chosen by the caller among those this CPU runs, never by the compiler's flags):
//   ISA_AVX512_BF16  bf16 x: the codes looked up as bf16 (vpermw), vdpbf16ps
//   ISA_AVX512       float32 fmas on 16 lanes, x widened and split into (odd, even) halves
//   ISA_AVX2         the same on two 8-lane halves
//   ISA_SCALAR       the same on an array of 16 lanes
// For float32 x every path computes the same operations: bit-identical results. For bf16 x
// the fma paths compute vdpbf16ps's operations (a bf16 product is exact in float32, so each
// step is one fma) with its tables (bf16 subnormals flushed to zero): the same bits, except
// where x or a running sum is below 2^-126 (vdpbf16ps flushes those; the fmas keep them).
//
// The library builds with -ffast-math (kvloom/native.py). The arithmetic above stays fixed
// under it: each step is an fma (builtins that GCC never reassociates) and every add of the
// final sum passes through pinned(), an empty asm that ends any chain GCC could reorder.
//
// Plain C ABI, called through ctypes (kvloom/kernels/mxfp4.py registers it as the PyTorch
// op kvloom::mxfp4_linear with a schema).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <omp.h>

#include "simd.h"
#include "work_shares.h"

namespace {

using kvloom_simd::unrolled;  // accumulators indexed by constants: they stay in registers

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };
enum Dtype : int { DTYPE_FLOAT32 = 0, DTYPE_BF16 = 1 };

constexpr int64_t GROUP = 32;        // weights per scale
constexpr int64_t GROUP_BYTES = 16;  // two codes a byte
constexpr float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The value of code c under scale s, per s: what the paths look the codes up in.
struct Tables {
  alignas(64) float exact[256][16];    // E2M1[c] * 2^(s - 127) in float32, as dequantize_mxfp4 (torch.ldexp)
  alignas(64) float flushed[256][16];  // those as vdpbf16ps reads them: bf16, subnormals as zero
  alignas(32) uint16_t bf16[256][16];  // the same as bf16 bits
  Tables() {
    for (int s = 0; s < 256; ++s) {
      const float power = std::ldexp(1.0f, s - 127);  // inf at s = 255, so 0 * it is NaN, as torch gives
      for (int c = 0; c < 16; ++c) {
        exact[s][c] = E2M1[c] * power;
        uint16_t bits;
        kvloom_simd::from_float(exact[s][c], &bits);  // exact: two significant bits (or inf, NaN)
        if ((bits & 0x7f80u) == 0) bits &= 0x8000u;   // a subnormal: vdpbf16ps reads it as zero
        bf16[s][c] = bits;
        flushed[s][c] = kvloom_simd::to_float(bits);
      }
    }
  }
};
const Tables& tables() {
  static const Tables built;  // thread-safe static initialisation, once per process
  return built;
}

struct Problem {
  const uint8_t* blocks;  // [n, groups, 16]
  const uint8_t* scales;  // [n, groups]
  const uint16_t* x16;    // bf16 x [m, k] as given (the vdpbf16ps path)
  const float* xf;        // x as float32, each group's 32 as (odd 16, even 16) (the fma paths)
  const float (*table)[16];  // the fma paths' values of the codes per scale (Tables::exact or ::flushed)
  const float* bias;      // [n] float32 or nullptr
  void* y;                // [m, n] of `dtype`
  int dtype;
  int64_t m, n, k, groups;
};

// v, with no operation moved across this point: ends an expression GCC could reassociate.
template <class T>
inline T pinned(T v) {
#if defined(__x86_64__)
  __asm__("" : "+v"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#endif
  return v;
}

// The one epilogue: the lanes' sum (from reduce16 or its vector twins), + bias, one rounding.
inline void store_output(const Problem& p, int64_t i, int64_t r, float sum) {
  if (p.bias) sum = pinned(sum + p.bias[r]);  // no bias: no add (+0 would turn -0 into +0)
  if (p.dtype == DTYPE_BF16) kvloom_simd::from_float(sum, static_cast<uint16_t*>(p.y) + i * p.n + r);
  else static_cast<float*>(p.y)[i * p.n + r] = sum;
}

// The sum of 16 lanes: l + (l + 8), then + 4, + 2, + 1 (the vector paths' shuffles, lane for lane).
inline float reduce16(const float* lanes) {
  float half[8], quarter[4];
  for (int l = 0; l < 8; ++l) half[l] = pinned(lanes[l] + lanes[l + 8]);
  for (int l = 0; l < 4; ++l) quarter[l] = pinned(half[l] + half[l + 4]);
  return pinned(pinned(quarter[0] + quarter[2]) + pinned(quarter[1] + quarter[3]));
}

// One tile's work: weight rows [r0, r0 + live) against rows [i0, i0 + rows) of x, and the
// lines to fetch meanwhile (the thread's next tile's codes and scales; none: 0 lines).
struct Tile {
  int64_t r0;
  int live;
  int64_t i0;
  int rows;
  const char* ahead_blocks;
  int64_t ahead_block_lines;
  const char* ahead_scales;
  int64_t ahead_scale_lines;
  // Group g's share of the fetching: a line of codes (a tile of NT <= 4 rows has at most
  // one line of them a group) and, over the first groups, the scales. Out of cache the
  // hardware prefetcher lost the stream at every tile (NT short runs of 16 bytes a group):
  // fetched here a tile ahead, the weight streams at memory speed. A fetch changes no bit.
  __attribute__((always_inline)) inline void fetch(int64_t g) const {
#if defined(__x86_64__)
    if (g < ahead_block_lines) _mm_prefetch(ahead_blocks + 64 * g, _MM_HINT_T0);
    if (g < ahead_scale_lines) _mm_prefetch(ahead_scales + 64 * g, _MM_HINT_T0);
#else
    (void)g;
#endif
  }
};

// The weight rows a tile of NT reads: row r0 + t, the last live one repeated past n (computed, never stored).
template <int NT>
struct TileRows {
  const uint8_t* blocks[NT];
  const uint8_t* scales[NT];
  TileRows(const Problem& p, const Tile& at) {
    for (int t = 0; t < NT; ++t) {
      const int64_t r = at.r0 + std::min(t, at.live - 1);
      blocks[t] = p.blocks + r * p.groups * GROUP_BYTES;
      scales[t] = p.scales + r * p.groups;
    }
  }
};

// ---- scalar ---------------------------------------------------------------------
// One output at a time: the reference for the vector paths' arithmetic, and the path of
// CPUs without AVX2. std::fma is a fused multiply-add wherever it runs.
void tile_scalar(const Problem& p, const Tile& at) {
  for (int t = 0; t < at.live; ++t) {
    const uint8_t* blocks = p.blocks + (at.r0 + t) * p.groups * GROUP_BYTES;
    const uint8_t* scales = p.scales + (at.r0 + t) * p.groups;
    for (int64_t i = at.i0; i < at.i0 + at.rows; ++i) {
      const float* x = p.xf + i * p.k;
      float acc[16] = {};
      for (int64_t g = 0; g < p.groups; ++g) {
        const float* value = p.table[scales[g]];
        const uint8_t* codes = blocks + g * GROUP_BYTES;
        const float* odd = x + g * GROUP;
        const float* even = odd + 16;
        for (int l = 0; l < 16; ++l) {
          acc[l] = std::fma(value[codes[l] >> 4], odd[l], acc[l]);
          acc[l] = std::fma(value[codes[l] & 15], even[l], acc[l]);
        }
      }
      store_output(p, i, at.r0 + t, reduce16(acc));
    }
  }
}

#if defined(__x86_64__)
#define KVLOOM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define KVLOOM_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define KVLOOM_TARGET_AVX2 __attribute__((target("avx2,fma")))

// reduce16 on 16 lanes in a register: the same adds, lane for lane.
KVLOOM_TARGET_AVX512 inline float reduce16_512(__m512 lanes) {
  const __m256 half = pinned(_mm256_add_ps(_mm512_castps512_ps256(lanes),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1))));
  const __m128 quarter = pinned(_mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
  const __m128 eighth = pinned(_mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter)));  // q0 + q2, q1 + q3
  return _mm_cvtss_f32(pinned(_mm_add_ss(eighth, _mm_shuffle_ps(eighth, eighth, 1))));
}
// reduce16 on lanes 0-7 (lo) and 8-15 (hi).
KVLOOM_TARGET_AVX2 inline float reduce16_256(__m256 lo, __m256 hi) {
  const __m256 half = pinned(_mm256_add_ps(lo, hi));
  const __m128 quarter = pinned(_mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
  const __m128 eighth = pinned(_mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter)));
  return _mm_cvtss_f32(pinned(_mm_add_ss(eighth, _mm_shuffle_ps(eighth, eighth, 1))));
}

// ---- AVX512-BF16 ------------------------------------------------------------------
// A tile: NT weight rows x M rows of x, NT * M accumulators. Per group, each weight row's
// 16 bytes become 32 bf16 in one vpermw: dword l holds byte l in its low word (the index
// reads bits 0-4; the table is the 16 values twice, so bit 4 is free) and byte l >> 4 in
// its high word, which is (x[2l], x[2l + 1])'s pair of weights.
template <int NT, int M>
KVLOOM_TARGET_AVX512_BF16 void tile_bf16(const Problem& p, const Tile& at) {
  const TileRows<NT> w(p, at);
  const uint16_t(*table)[16] = tables().bf16;
  __m512 acc[M * NT];
  unrolled<M * NT>([&](auto a) KVLOOM_TARGET_AVX512_BF16 { acc[a] = _mm512_setzero_ps(); });
  const uint16_t* x = p.x16 + at.i0 * p.k;
  for (int64_t g = 0; g < p.groups; ++g) {
    at.fetch(g);
    __m512bh weights[NT];
    unrolled<NT>([&](auto t) KVLOOM_TARGET_AVX512_BF16 {
      const __m512i bytes = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.blocks[t] + g * GROUP_BYTES)));
      const __m512i index = _mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12));
      const __m512i values = _mm512_broadcast_i64x4(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(table[w.scales[t][g]])));
      weights[t] = (__m512bh)_mm512_permutexvar_epi16(index, values);
    });
    unrolled<M>([&](auto i) KVLOOM_TARGET_AVX512_BF16 {
      const __m512bh inputs = (__m512bh)_mm512_loadu_si512(x + i * p.k + g * GROUP);
      unrolled<NT>([&](auto t) KVLOOM_TARGET_AVX512_BF16 {
        acc[i * NT + t] = _mm512_dpbf16_ps(acc[i * NT + t], inputs, weights[t]);
      });
    });
  }
  for (int i = 0; i < M; ++i)
    for (int t = 0; t < at.live; ++t) store_output(p, at.i0 + i, at.r0 + t, reduce16_512(acc[i * NT + t]));
}

// ---- AVX-512 (float32 fmas) -----------------------------------------------------------
// Per group, each weight row's codes as two vectors of float32 (vpermps on the scale's
// table): its odd elements (high nibbles) and its even ones (low nibbles).
template <int NT, int M>
KVLOOM_TARGET_AVX512 void tile_avx512(const Problem& p, const Tile& at) {
  const TileRows<NT> w(p, at);
  __m512 acc[M * NT];
  unrolled<M * NT>([&](auto a) KVLOOM_TARGET_AVX512 { acc[a] = _mm512_setzero_ps(); });
  const float* x = p.xf + at.i0 * p.k;
  for (int64_t g = 0; g < p.groups; ++g) {
    at.fetch(g);
    __m512 odd[NT], even[NT];
    unrolled<NT>([&](auto t) KVLOOM_TARGET_AVX512 {
      const __m512i bytes = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.blocks[t] + g * GROUP_BYTES)));
      const __m512 values = _mm512_load_ps(p.table[w.scales[t][g]]);
      odd[t] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
      even[t] = _mm512_permutexvar_ps(bytes, values);  // vpermps reads the index's low 4 bits
    });
    unrolled<M>([&](auto i) KVLOOM_TARGET_AVX512 {
      const __m512 x_odd = _mm512_loadu_ps(x + i * p.k + g * GROUP);
      const __m512 x_even = _mm512_loadu_ps(x + i * p.k + g * GROUP + 16);
      unrolled<NT>([&](auto t) KVLOOM_TARGET_AVX512 {
        acc[i * NT + t] = _mm512_fmadd_ps(odd[t], x_odd, acc[i * NT + t]);
        acc[i * NT + t] = _mm512_fmadd_ps(even[t], x_even, acc[i * NT + t]);
      });
    });
  }
  for (int i = 0; i < M; ++i)
    for (int t = 0; t < at.live; ++t) store_output(p, at.i0 + i, at.r0 + t, reduce16_512(acc[i * NT + t]));
}

// ---- AVX2 -------------------------------------------------------------------------
// The AVX-512 path's lanes as two halves. vpermps on 8 lanes reads 3 index bits: the
// table's first 8 values (codes 0-7, sign clear) and the code's bit 3 as the sign (a
// table's codes 8-15 are 0-7 negated, -0 included).
template <int NT, int M>
KVLOOM_TARGET_AVX2 void tile_avx2(const Problem& p, const Tile& at) {
  const TileRows<NT> w(p, at);
  __m256 acc[2 * M * NT];
  unrolled<2 * M * NT>([&](auto a) KVLOOM_TARGET_AVX2 { acc[a] = _mm256_setzero_ps(); });
  const float* x = p.xf + at.i0 * p.k;
  const __m256i sign_bit = _mm256_set1_epi32(8);
  const auto lookup = [&](__m256i codes, __m256 magnitudes) KVLOOM_TARGET_AVX2 {
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, sign_bit), 28);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, codes), _mm256_castsi256_ps(sign));
  };
  for (int64_t g = 0; g < p.groups; ++g) {
    at.fetch(g);
    __m256 odd[2 * NT], even[2 * NT];  // [2t]: lanes 0-7, [2t + 1]: lanes 8-15
    unrolled<NT>([&](auto t) KVLOOM_TARGET_AVX2 {
      const __m256 magnitudes = _mm256_load_ps(p.table[w.scales[t][g]]);
      const uint8_t* codes = w.blocks[t] + g * GROUP_BYTES;
      unrolled<2>([&](auto h) KVLOOM_TARGET_AVX2 {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * h)));
        odd[2 * t + h] = lookup(_mm256_srli_epi32(bytes, 4), magnitudes);
        even[2 * t + h] = lookup(bytes, magnitudes);
      });
    });
    unrolled<M>([&](auto i) KVLOOM_TARGET_AVX2 {
      unrolled<2>([&](auto h) KVLOOM_TARGET_AVX2 {
        const __m256 x_odd = _mm256_loadu_ps(x + i * p.k + g * GROUP + 8 * h);
        const __m256 x_even = _mm256_loadu_ps(x + i * p.k + g * GROUP + 16 + 8 * h);
        unrolled<NT>([&](auto t) KVLOOM_TARGET_AVX2 {
          __m256& a = acc[2 * (i * NT + t) + h];
          a = _mm256_fmadd_ps(odd[2 * t + h], x_odd, a);
          a = _mm256_fmadd_ps(even[2 * t + h], x_even, a);
        });
      });
    });
  }
  for (int i = 0; i < M; ++i)
    for (int t = 0; t < at.live; ++t)
      store_output(p, at.i0 + i, at.r0 + t, reduce16_256(acc[2 * (i * NT + t)], acc[2 * (i * NT + t) + 1]));
}

// ---- CPU features ---------------------------------------------------------------
int detect_isa() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE) || !(c & bit_FMA)) return ISA_SCALAR;
  uint32_t xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 0x6) != 0x6) return ISA_SCALAR;  // the OS saves SSE and AVX state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & bit_AVX2)) return ISA_SCALAR;
  const bool avx512 = (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL) && (b & bit_AVX512DQ)
                      && (xcr0_lo & 0xe0) == 0xe0;  // opmask and upper ZMM state
  if (!avx512) return ISA_AVX2;
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  return (a & (1u << 5)) ? ISA_AVX512_BF16 : ISA_AVX512;  // AVX512_BF16
}
#else
int detect_isa() { return ISA_SCALAR; }
#endif

// ---- the driver -------------------------------------------------------------------
using TileFn = void (*)(const Problem&, const Tile&);

#if defined(__x86_64__)
// Each path's tiles as one template of (NT, M), for shape_of.
template <int NT, int M>
struct Bf16 { static void run(const Problem& p, const Tile& at) { tile_bf16<NT, M>(p, at); } };
template <int NT, int M>
struct Avx512 { static void run(const Problem& p, const Tile& at) { tile_avx512<NT, M>(p, at); } };
template <int NT, int M>
struct Avx2 { static void run(const Problem& p, const Tile& at) { tile_avx2<NT, M>(p, at); } };
#endif

// How a call is cut: NT weight rows a tile, up to ROWS rows of x, by[rows - 1] the tile of that many.
struct Shape {
  int nt = 1, rows = 1;
  TileFn by[8] = {};  // by[rows - 1]: the tile of that many rows of x
};

template <template <int, int> class Kernel, int NT, int... M>
Shape shape_of(std::integer_sequence<int, M...>) {
  Shape s;
  s.nt = NT;
  s.rows = sizeof...(M);
  ((s.by[M] = &Kernel<NT, M + 1>::run), ...);
  return s;
}

// The tiles by path and by the call's rows (which changes no output's operations): a
// decode-sized call gets more weight rows a tile, so that at one row several accumulators
// are in flight (each step waits on the one before); more rows reuse each decoded group
// across more of x. Registers: AVX-512 32, AVX2 16 (each AVX2 vector here is two). On AMD
// EPYC model 17 (n = 5760, k = 2880, bf16) 3 x 8 took 1.44-1.49 ms at 16 rows where 2 x 8
// took 1.83-1.90 and 4 x 6 1.80-1.86; at 1-4 rows 4 x 4 was as fast as any.
Shape choose_shape(int isa, int64_t m) {
  switch (isa) {
#if defined(__x86_64__)
    case ISA_AVX512_BF16:
      return m <= 4 ? shape_of<Bf16, 4>(std::make_integer_sequence<int, 4>())
                    : shape_of<Bf16, 3>(std::make_integer_sequence<int, 8>());
    case ISA_AVX512:
      return m <= 4 ? shape_of<Avx512, 4>(std::make_integer_sequence<int, 4>())
                    : shape_of<Avx512, 2>(std::make_integer_sequence<int, 8>());
    case ISA_AVX2:
      return m == 1 ? shape_of<Avx2, 2>(std::make_integer_sequence<int, 1>())
                    : shape_of<Avx2, 1>(std::make_integer_sequence<int, 3>());
#endif
    default: {
      Shape s;
      s.by[0] = &tile_scalar;
      return s;
    }
  }
}

// Rows of x per pass over the weight: as many as keep their part of x in L2 (~256 KiB),
// so each tile's weights (in L1) serve every row of the pass; decode-sized calls are one
// pass, and the weight streams from memory once.
constexpr int64_t X_BYTES_PER_PASS = 256 * 1024;

// x as the fma paths read it: float32, each group's 32 as (its odd elements, its even ones).
template <class T>
void split_pairs(const T* x, int64_t m, int64_t k, float* out) {
  for (int64_t i = 0; i < m * k; i += GROUP)
    for (int l = 0; l < 16; ++l) {
      out[i + l] = kvloom_simd::to_float(x[i + 2 * l + 1]);
      out[i + 16 + l] = kvloom_simd::to_float(x[i + 2 * l]);
    }
}

void run(const Problem& p, const Shape& shape, int num_threads) {
  const int64_t tiles = (p.n + shape.nt - 1) / shape.nt;
  const int64_t elem = p.x16 ? 2 : 4;
  const int64_t pass_rows =
      std::max<int64_t>(1, X_BYTES_PER_PASS / std::max<int64_t>(1, p.k * elem) / shape.rows) * shape.rows;
  const int64_t passes = (p.m + pass_rows - 1) / pass_rows;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, tiles)));
  // Thread s's share: tiles [first(s), first(s + 1)) of every pass, pass by pass; the
  // first done takes units from the back of the others' (work_shares.h). Which thread
  // computes a tile changes no bit.
  const auto first = [&](int s) { return tiles * s / threads; };
  kvloom_work::WorkShares shares(threads, [&](int s) { return passes * (first(s + 1) - first(s)); });
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    kvloom_work::Unit unit;
    while (shares.next(omp_get_thread_num(), unit)) {
      const int64_t begin = first(unit.share), end = first(unit.share + 1);
      const int64_t tile = begin + unit.index % (end - begin);
      const int64_t pass = unit.index / (end - begin) * pass_rows, pass_end = std::min(p.m, pass + pass_rows);
      Tile at{tile * shape.nt, static_cast<int>(std::min<int64_t>(shape.nt, p.n - tile * shape.nt)), pass, 0,
              nullptr, 0, nullptr, 0};
      // What this thread takes next: the tile after (the owner), or before (a thief).
      const int64_t next = unit.stolen ? tile - 1 : tile + 1;
      if (next >= begin && next < end) {
        const int64_t r = next * shape.nt, rows = std::min<int64_t>(shape.nt, p.n - r);
        const auto lines = [](const uint8_t* from, int64_t bytes, const char*& start) {
          start = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63});
          return (reinterpret_cast<const char*>(from) + bytes - start + 63) / 64;
        };
        at.ahead_block_lines = lines(p.blocks + r * p.groups * GROUP_BYTES, rows * p.groups * GROUP_BYTES,
                                     at.ahead_blocks);
        at.ahead_scale_lines = lines(p.scales + r * p.groups, rows * p.groups, at.ahead_scales);
      }
      for (; at.i0 < pass_end; at.i0 += shape.rows) {
        at.rows = static_cast<int>(std::min<int64_t>(shape.rows, pass_end - at.i0));
        shape.by[at.rows - 1](p, at);
        at.ahead_block_lines = at.ahead_scale_lines = 0;  // fetched by the first rows
      }
    }
  }
}

}  // namespace

extern "C" {

// The best path this CPU (and OS) runs: 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX512-BF16.
int kvloom_mxfp4_best_isa() {
  static const int best = detect_isa();
  return best;
}

// y[m, n] = x[m, k] @ W^T (+ bias), W the MXFP4 pair (blocks [n, k / 32, 16], scales
// [n, k / 32]); x, bias and y of `dtype` (0 float32, 1 bf16), y written whole. `isa`: a path
// up to kvloom_mxfp4_best_isa(); AVX512-BF16 takes bf16 x only. Returns 0; -1 for a path
// this CPU (or x's dtype) does not run, -2 for a k that is not a multiple of 32 or an
// unknown dtype (nothing written).
int kvloom_mxfp4_linear(const void* x, const uint8_t* blocks, const uint8_t* scales, const void* bias, void* y,
                        int64_t m, int64_t n, int64_t k, int dtype, int isa, int num_threads) {
  if (k % GROUP != 0 || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BF16)) return -2;
  if (isa < ISA_SCALAR || isa > kvloom_mxfp4_best_isa() || (isa == ISA_AVX512_BF16 && dtype != DTYPE_BF16))
    return -1;
  if (m == 0 || n == 0) return 0;
  std::vector<float> bias_f, xf;
  if (bias != nullptr) {
    bias_f.resize(n);
    for (int64_t r = 0; r < n; ++r)
      bias_f[r] = dtype == DTYPE_BF16 ? kvloom_simd::to_float(static_cast<const uint16_t*>(bias)[r])
                                      : static_cast<const float*>(bias)[r];
  }
  Problem p{blocks, scales, nullptr, nullptr, nullptr, bias ? bias_f.data() : nullptr, y, dtype, m, n, k, k / GROUP};
  if (isa == ISA_AVX512_BF16) {
    p.x16 = static_cast<const uint16_t*>(x);
  } else {
    xf.resize(m * k);
    if (dtype == DTYPE_BF16) split_pairs(static_cast<const uint16_t*>(x), m, k, xf.data());
    else split_pairs(static_cast<const float*>(x), m, k, xf.data());
    p.xf = xf.data();
    p.table = dtype == DTYPE_BF16 ? tables().flushed : tables().exact;
  }
  run(p, choose_shape(isa, m), num_threads);
  return 0;
}

}  // extern "C"
