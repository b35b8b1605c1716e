// Helpers shared by kvloom's CPU kernels. Scalar: bfloat16 <-> float32 (round to
// nearest even, NaN kept NaN). AVX-512: 16 lanes of float32 loaded from and stored to
// float32 or bfloat16, and exp; every vector function takes a lane count (<= 16) so
// tails need no scalar loop.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace kvloom_simd {

// 2^f for |f| <= 1/2: a degree-7 Taylor polynomial (relative error ~1e-8), highest
// coefficient first, evaluated by Horner's rule in fmas; exp16 and exp8 share it.
constexpr float EXP2_POLY[8] = {1.52527338040598e-05f, 0.000154035303933816f, 0.00133335581464284f,
                                0.00961812910762848f,  0.0555041086648216f,   0.240226506959101f,
                                0.693147180559945f,    1.0f};

// f(std::integral_constant<int, I>()) for I = 0 .. N - 1, in order. Kernels index
// their accumulator arrays this way: GCC 12 keeps an array of more than a few vectors
// in memory when a loop indexes it, storing every accumulator on every step of the
// reduction (measured: half the speed of the AVX2 GEMM), but keeps it in registers
// when every index is a constant.
template <class F, std::size_t... I>
inline void unrolled_impl(F& f, std::index_sequence<I...>) { (f(std::integral_constant<int, I>()), ...); }
template <int N, class F>
inline void unrolled(F&& f) { unrolled_impl(f, std::make_index_sequence<N>()); }

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16 -> float: the high half of a float
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
// x rounded to the precision of the storage type, still as float (identity for float).
inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const uint16_t*) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return x;  // NaN stays NaN
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, uint16_t* dst) {  // round to nearest even, NaN -> quiet NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) { *dst = 0x7fc0; return; }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
}

}  // namespace kvloom_simd

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVLOOM_AVX512 1
#include <immintrin.h>

namespace kvloom_simd {

inline __mmask16 lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1);
}
inline __m512 load16(const float* src, int64_t count) { return _mm512_maskz_loadu_ps(lanes(count), src); }
inline __m512 load16(const uint16_t* src, int64_t count) {  // bf16 is a float's high half
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes(count), src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// The bf16 bits (in the high half of each 32-bit lane) nearest to x, ties to even.
inline __m512i bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}
// x as 16 bf16, rounded as bf16_bits rounds it. Where the CPU has AVX512-BF16,
// vcvtneps2bf16 rounds the same way (to nearest even) in one instruction, except that
// it flushes a denormal to zero and keeps a NaN's payload; a vector holding either
// (vfpclassps: QNaN, denormal, SNaN) takes bf16_bits, so the bits never depend on
// which. The fused ops spend much of their time rounding: on AMD EPYC model 17 rms_norm
// over 16 x 576 and silu_and_mul take 22.2 -> 18.2 and 24.5 -> 20.5 cycles a vector, and
// a prompt step of 8 x 256 ~1% less (docs/benchmarks.md, the twelfth session).
inline __m256i bf16_pack(__m512 x) {
#ifdef __AVX512BF16__
  constexpr int quiet_nan = 0x01, denormal = 0x20, signalling_nan = 0x80;  // vfpclassps classes
  if (__builtin_expect(_mm512_fpclass_ps_mask(x, quiet_nan | denormal | signalling_nan) == 0, 1))
    return (__m256i)_mm512_cvtneps_pbh(x);
#endif
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(x), 16));
}
// x rounded to the storage type's precision, still as float (identity for float).
inline __m512 round16(__m512 x, const float*) { return x; }
inline __m512 round16(__m512 x, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(x)), 16));
}
inline void store16(float* dst, __m512 x, int64_t count) { _mm512_mask_storeu_ps(dst, lanes(count), x); }
inline void store16(uint16_t* dst, __m512 x, int64_t count) { _mm256_mask_storeu_epi16(dst, lanes(count), bf16_pack(x)); }

// Lane i of the result is the sum of v[i]'s 16 lanes: 16 horizontal sums for the price
// of about three (a transpose-and-add tree instead of 16 separate reductions).
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: the lane's sums of v[4i .. 4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x): 2^t with t = n + f, |f| <= 1/2, a degree-7 Taylor polynomial for 2^f
// (relative error ~1e-8) and scalef for the 2^n (overflow gives inf, underflow 0).
inline __m512 exp16(__m512 x) {
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));  // exp underflows to ~0 there anyway
  t = _mm512_min_ps(t, _mm512_set1_ps(128.0f));   // and overflows to inf here
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
  return _mm512_scalef_ps(p, whole);
}

}  // namespace kvloom_simd
#endif

// AVX2 (and FMA): 8 lanes of float32. Kernels that have an AVX-512 path keep its
// 16-lane arithmetic here as two 8-lane halves, lane for lane, so both paths compute
// the same operations in the same order.
#if defined(__AVX2__) && defined(__FMA__)
#define KVLOOM_AVX2 1
#include <immintrin.h>

namespace kvloom_simd {

// Of a 16-lane group's lanes [first, first + 8) (first: 0 or 8), those below `count`
// (any integer) all ones, the rest zero.
inline __m256 live8(int64_t count, int first = 0) {
  const __m256i index = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  const int clamped = static_cast<int>(count < 0 ? 0 : (count > 16 ? 16 : count));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), index));
}
// 8 elements as float32, from float32 or bf16.
inline __m256 to_float8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 to_float8(const uint16_t* src) {  // 8 bf16 -> float32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16));
}
// The bf16 bits (in the high half of each 32-bit lane) nearest to x, ties to even, NaN
// a quiet NaN: bf16_bits on 8 lanes.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
  return _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
}
// x rounded to the storage type's precision, still as float (identity for float).
inline __m256 round8(__m256 x, const float*) { return x; }
inline __m256 round8(__m256 x, const uint16_t*) { return _mm256_castsi256_ps(bf16_bits8(x)); }
inline void store8(float* dst, __m256 x) { _mm256_storeu_ps(dst, x); }
inline void store8(uint16_t* dst, __m256 x) {  // 8 float32 -> bf16, rounded as bf16_bits8
  const __m256i halves = _mm256_srli_epi32(bf16_bits8(x), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1)));
}

// exp16's arithmetic on 8 lanes: the same clamps, rounding and polynomial. scalef's
// p * 2^n (one rounding) is two multiplications by powers of two built as floats,
// 2^(n/2) then 2^(n - n/2): the first is exact and both are normal for every n in
// [-126, 128], so the second rounds once, as scalef does (subnormal and infinite
// results included).
inline __m256 exp8(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.0f));
  t = _mm256_min_ps(t, _mm256_set1_ps(128.0f));
  const __m256 whole = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, whole);
  __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
  const __m256i n = _mm256_cvtps_epi32(whole);
  const __m256i first = _mm256_srai_epi32(n, 1);
  const __m256i second = _mm256_sub_epi32(n, first);
  const auto power = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, power(first)), power(second));
}

// The sum of 8 lanes: halves, then quarters, then pairs.
inline float reduce_add8(__m256 x) {
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ps(two, _mm_shuffle_ps(two, two, _MM_SHUFFLE(0, 1, 0, 1))));
}

// The sum of 16 lanes held as two halves, in _mm512_reduce_add_ps's order (halves,
// then quarters, then pairs), so that it equals the AVX-512 reduction bit for bit.
inline float reduce_add16(__m256 lo, __m256 hi) { return reduce_add8(_mm256_add_ps(hi, lo)); }

}  // namespace kvloom_simd
#endif
