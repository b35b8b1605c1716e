// Fused elementwise ops of a decoder layer, for CPUs. Each replaces a chain of small
// PyTorch ops (one kernel launch, one temporary and one pass over memory each) by a
// single pass; at decode batch sizes the chain's dispatch overhead, not arithmetic,
// was the cost. The pure-PyTorch versions in kvloom/models/ops.py are the reference.
//
// Rounding follows the PyTorch chains they replace: for bf16, every intermediate that
// PyTorch materialises in bf16 is rounded here too (round-to-nearest-even), so the
// result equals the reference up to float32 summation order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include "simd.h"

namespace {

using kvloom_simd::from_float;
using kvloom_simd::round_to;
using kvloom_simd::to_float;

// Rows are shared between the threads from two rows and 4,096 elements on: at decode the
// ops ran on the calling thread while the other spun in OpenMP's wait (at batch 16 about
// 1 ms of a 21 ms step, AMD EPYC model 17); a row is one thread's whole, so the split
// changes no bit.
inline bool parallel_worth_it(int64_t rows, int64_t elements) { return rows >= 2 && elements >= (1 << 12); }

// An RMSNorm's first pass over a row: residual (nullptr: none) <- round(x + residual), and
// the sum of the squares of what is normed (that sum's values, or x's), in float32, in each
// path's order (16 lanes, or 8 and then the scalar rule for the tail).
template <typename T>
inline float sum_of_squares(const T* xr, T* res, int64_t n) {
#ifdef KVLOOM_AVX512
  using namespace kvloom_simd;
  __m512 sum_v = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = load16(xr + i, n - i);
    if (res) {
      v = round16(_mm512_add_ps(v, load16(res + i, n - i)), res);
      store16(res + i, v, n - i);
    }
    sum_v = _mm512_fmadd_ps(v, v, sum_v);
  }
  return _mm512_reduce_add_ps(sum_v);
#else
  int64_t vec = 0;  // elements the vector loop takes
  float sum_sq = 0.0f;
#ifdef KVLOOM_AVX2
  using namespace kvloom_simd;
  vec = n / 8 * 8;
  __m256 sum_v = _mm256_setzero_ps();
  for (int64_t i = 0; i < vec; i += 8) {
    __m256 v = to_float8(xr + i);
    if (res) {
      v = round8(_mm256_add_ps(v, to_float8(res + i)), res);
      store8(res + i, v);
    }
    sum_v = _mm256_fmadd_ps(v, v, sum_v);
  }
  sum_sq = reduce_add8(sum_v);
#endif
  for (int64_t i = vec; i < n; ++i) {
    float v = to_float(xr[i]);
    if (res) {
      v = round_to(v + to_float(res[i]), res);
      from_float(v, res + i);
    }
    sum_sq += v * v;
  }
  return sum_sq;
#endif
}

// residual (optional): residual <- round(x + residual), then normalise that sum.
// out <- round(weight * round(v * rsqrt(mean(v^2) + eps))), v in float32. out may be x.
template <typename T>
void rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for if (parallel_worth_it(rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* res = residual ? residual + r * n : nullptr;
    T* o = out + r * n;
    const float inv = 1.0f / std::sqrt(sum_of_squares(xr, res, n) / static_cast<float>(n) + eps);
    const T* src = res ? res : xr;
#ifdef KVLOOM_AVX512
    using namespace kvloom_simd;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 normed = round16(_mm512_mul_ps(load16(src + i, n - i), _mm512_set1_ps(inv)), o);
      store16(o + i, _mm512_mul_ps(load16(weight + i, n - i), normed), n - i);
    }
    continue;
#endif
    // The scalar rule, for every element or (AVX2) for those past the last 8 lanes.
    int64_t vec = 0;  // elements the vector loop takes
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)  // an AVX-512 build took its own path above
    using namespace kvloom_simd;
    vec = n / 8 * 8;
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 normed = round8(_mm256_mul_ps(to_float8(src + i), _mm256_set1_ps(inv)), o);
      store8(o + i, _mm256_mul_ps(to_float8(weight + i), normed));
    }
#endif
    for (int64_t i = vec; i < n; ++i) {
      const float normed = round_to(to_float(src[i]) * inv, o);
      from_float(round_to(to_float(weight[i]) * normed, o), o + i);
    }
  }
}

// Gemma's and OLMo 2's RMSNorm: the scale applied in float32 before the one rounding.
// residual (optional) as rms_norm's; out <- round((v * rsqrt(mean(v^2) + eps)) * (offset + weight)),
// both products in float32 (transformers' `x32 * rsqrt(...)`, then `* (offset + w.float())`,
// then the cast; Llama's rms_norm rounds the normed value before it scales). out may be x.
template <typename T>
void rms_norm_scaled(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps,
                     float offset) {
#pragma omp parallel for if (parallel_worth_it(rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* res = residual ? residual + r * n : nullptr;
    T* o = out + r * n;
    const float inv = 1.0f / std::sqrt(sum_of_squares(xr, res, n) / static_cast<float>(n) + eps);
    const T* src = res ? res : xr;
#ifdef KVLOOM_AVX512
    using namespace kvloom_simd;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 normed = _mm512_mul_ps(load16(src + i, n - i), _mm512_set1_ps(inv));
      store16(o + i, _mm512_mul_ps(normed, _mm512_add_ps(_mm512_set1_ps(offset), load16(weight + i, n - i))), n - i);
    }
    continue;
#endif
    int64_t vec = 0;  // elements the vector loop takes; the scalar rule does the rest
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
    using namespace kvloom_simd;
    vec = n / 8 * 8;
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 normed = _mm256_mul_ps(to_float8(src + i), _mm256_set1_ps(inv));
      store8(o + i, _mm256_mul_ps(normed, _mm256_add_ps(_mm256_set1_ps(offset), to_float8(weight + i))));
    }
#endif
    for (int64_t i = vec; i < n; ++i) from_float(to_float(src[i]) * inv * (offset + to_float(weight[i])), o + i);
  }
}

// LayerNorm with a weight and a bias (StarCoder2's, GPT-2's): residual (optional) as
// rms_norm's; out <- round((v - mean) * rsqrt(var + eps) * weight + bias), the mean and
// the (biased) variance of the row in float32, two passes, everything in float32 before
// the one rounding (torch's layer_norm computes in float32 and rounds once). out may be x.
template <typename T>
void layer_norm(const T* x, T* residual, const T* weight, const T* bias, T* out, int64_t rows, int64_t n,
                float eps) {
#pragma omp parallel for if (parallel_worth_it(rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* res = residual ? residual + r * n : nullptr;
    T* o = out + r * n;
#ifdef KVLOOM_AVX512
    using namespace kvloom_simd;
    __m512 sum_v = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      __m512 v = load16(xr + i, n - i);
      if (res) {
        v = round16(_mm512_add_ps(v, load16(res + i, n - i)), res);
        store16(res + i, v, n - i);
      }
      sum_v = _mm512_add_ps(sum_v, v);
    }
    const T* src_v = res ? res : xr;
    const __m512 mean_v = _mm512_set1_ps(_mm512_reduce_add_ps(sum_v) / static_cast<float>(n));
    __m512 sq_v = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 d = _mm512_maskz_mov_ps(lanes(n - i), _mm512_sub_ps(load16(src_v + i, n - i), mean_v));
      sq_v = _mm512_fmadd_ps(d, d, sq_v);
    }
    const __m512 inv_v = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq_v) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 normed = _mm512_mul_ps(_mm512_sub_ps(load16(src_v + i, n - i), mean_v), inv_v);
      store16(o + i, _mm512_add_ps(_mm512_mul_ps(normed, load16(weight + i, n - i)), load16(bias + i, n - i)),
              n - i);
    }
    continue;
#endif
    int64_t vec = 0;  // elements the vector loops take; the scalar rule does the rest
    float sum = 0.0f;
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
    using namespace kvloom_simd;
    vec = n / 8 * 8;
    __m256 sum_v = _mm256_setzero_ps();
    for (int64_t i = 0; i < vec; i += 8) {
      __m256 v = to_float8(xr + i);
      if (res) {
        v = round8(_mm256_add_ps(v, to_float8(res + i)), res);
        store8(res + i, v);
      }
      sum_v = _mm256_add_ps(sum_v, v);
    }
    sum = reduce_add8(sum_v);
#endif
    for (int64_t i = vec; i < n; ++i) {
      float v = to_float(xr[i]);
      if (res) {
        v = round_to(v + to_float(res[i]), res);
        from_float(v, res + i);
      }
      sum += v;
    }
    const T* src = res ? res : xr;
    const float mean = sum / static_cast<float>(n);
    float sq = 0.0f;
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
    __m256 sq_v = _mm256_setzero_ps();
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 d = _mm256_sub_ps(to_float8(src + i), _mm256_set1_ps(mean));
      sq_v = _mm256_fmadd_ps(d, d, sq_v);
    }
    sq = reduce_add8(sq_v);
#endif
    for (int64_t i = vec; i < n; ++i) sq += (to_float(src[i]) - mean) * (to_float(src[i]) - mean);
    const float inv = 1.0f / std::sqrt(sq / static_cast<float>(n) + eps);
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 normed = _mm256_mul_ps(_mm256_sub_ps(to_float8(src + i), _mm256_set1_ps(mean)),
                                          _mm256_set1_ps(inv));
      store8(o + i, _mm256_add_ps(_mm256_mul_ps(normed, to_float8(weight + i)), to_float8(bias + i)));
    }
#endif
    for (int64_t i = vec; i < n; ++i)
      from_float((to_float(src[i]) - mean) * inv * to_float(weight[i]) + to_float(bias[i]), o + i);
  }
}

// ---- the MLP's activations: each a functor with its 16-lane, 8-lane and scalar forms (the
// same operations in the same order), run by one of two drivers below.

// SiLU, x / (1 + exp(-x)).
struct Silu {
#ifdef KVLOOM_AVX512
  __m512 operator()(__m512 x) const {
    using namespace kvloom_simd;
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
  }
#endif
#ifdef KVLOOM_AVX2
  __m256 operator()(__m256 x) const {  // exp8: exp16's arithmetic
    using namespace kvloom_simd;
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
  }
#endif
  float operator()(float x) const { return x / (1.0f + std::exp(-x)); }
};

// GELU's tanh form (transformers' gelu_pytorch_tanh), 0.5 x (1 + tanh(u)) with
// u = sqrt(2 / pi) (x + 0.044715 x^3), computed as x / (1 + exp(-2u)), the same value
// without tanh's cancellation near 1 + tanh(u) = 0; exp overflows to inf (the result -0,
// as torch's) or underflows to 0 (the result x) at the ends.
constexpr float GELU_BETA = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_KAPPA = 0.044715f;
struct GeluTanh {
#ifdef KVLOOM_AVX512
  __m512 operator()(__m512 x) const {
    using namespace kvloom_simd;
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(-2.0f * GELU_BETA),
                                       _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(GELU_KAPPA), cube)));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(inner)));
  }
#endif
#ifdef KVLOOM_AVX2
  __m256 operator()(__m256 x) const {
    using namespace kvloom_simd;
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(-2.0f * GELU_BETA),
                                       _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_KAPPA), cube)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(inner)));
  }
#endif
  float operator()(float x) const { return x / (1.0f + std::exp(-2.0f * GELU_BETA * (x + GELU_KAPPA * (x * x * x)))); }
};

// GELU's exact form, 0.5 x (1 + erf(x / sqrt(2))) (GPT-NeoX's "gelu"), through erfc: with
// z = |x| / sqrt(2), 1 + erf(x / sqrt 2) is erfc(z) for x < 0 and 2 - erfc(z) for x >= 0 (so
// gelu is x erfc(z) / 2, or x (1 - erfc(z) / 2): no product past |x|, and -0 stays -0), and
// erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), P Numerical Recipes' Chebyshev fit
// (relative error below 1.2e-7 for every z: float32's own step, in the tails too).
constexpr float ERFC_P[10] = {-1.26551223f, 1.00002368f, 0.37409196f, 0.09678418f, -0.18628806f,
                              0.27886807f,  -1.13520398f, 1.48851587f, -0.82215223f, 0.17087277f};
constexpr float INV_SQRT2 = 0.7071067811865476f;
struct GeluErf {
#ifdef KVLOOM_AVX512
  __m512 operator()(__m512 x) const {
    using namespace kvloom_simd;
    const __m512 u = _mm512_mul_ps(x, _mm512_set1_ps(INV_SQRT2));
    const __m512 z = _mm512_max_ps(u, _mm512_sub_ps(_mm512_setzero_ps(), u));  // |u|
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_set1_ps(0.5f), z, _mm512_set1_ps(1.0f)));
    __m512 poly = _mm512_set1_ps(ERFC_P[9]);
    for (int k = 8; k >= 0; --k) poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(ERFC_P[k]));
    const __m512 half_tail = _mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_mul_ps(t, exp16(_mm512_sub_ps(poly, _mm512_mul_ps(z, z)))));
    return _mm512_mask_mov_ps(_mm512_mul_ps(x, _mm512_sub_ps(_mm512_set1_ps(1.0f), half_tail)),
                              _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_mul_ps(x, half_tail));
  }
#endif
#ifdef KVLOOM_AVX2
  __m256 operator()(__m256 x) const {
    using namespace kvloom_simd;
    const __m256 u = _mm256_mul_ps(x, _mm256_set1_ps(INV_SQRT2));
    const __m256 z = _mm256_max_ps(u, _mm256_sub_ps(_mm256_setzero_ps(), u));  // |u|
    const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(0.5f), z, _mm256_set1_ps(1.0f)));
    __m256 poly = _mm256_set1_ps(ERFC_P[9]);
    for (int k = 8; k >= 0; --k) poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(ERFC_P[k]));
    const __m256 half_tail = _mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(t, exp8(_mm256_sub_ps(poly, _mm256_mul_ps(z, z)))));
    return _mm256_blendv_ps(_mm256_mul_ps(x, _mm256_sub_ps(_mm256_set1_ps(1.0f), half_tail)), _mm256_mul_ps(x, half_tail),
                            _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  }
#endif
  float operator()(float x) const {
    const float z = std::fabs(x * INV_SQRT2), t = 1.0f / (1.0f + 0.5f * z);
    float poly = ERFC_P[9];
    for (int k = 8; k >= 0; --k) poly = poly * t + ERFC_P[k];
    const float half_tail = 0.5f * (t * std::exp(poly - z * z));
    return x < 0 ? x * half_tail : x * (1.0f - half_tail);
  }
};

// ReLU as torch's: x where x is not below 0 (so -0 and NaN pass), else +0. Exact.
struct Relu {
#ifdef KVLOOM_AVX512
  __m512 operator()(__m512 x) const {
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), x);
  }
#endif
#ifdef KVLOOM_AVX2
  __m256 operator()(__m256 x) const {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ), x);
  }
#endif
  float operator()(float x) const { return x < 0.0f ? 0.0f : x; }
};

// ReLU squared (transformers' relu2: torch.square(relu(x))), its one rounding the square's.
struct Relu2 {
#ifdef KVLOOM_AVX512
  __m512 operator()(__m512 x) const {
    const __m512 r = Relu()(x);
    return _mm512_mul_ps(r, r);
  }
#endif
#ifdef KVLOOM_AVX2
  __m256 operator()(__m256 x) const {
    const __m256 r = Relu()(x);
    return _mm256_mul_ps(r, r);
  }
#endif
  float operator()(float x) const {
    const float r = Relu()(x);
    return r * r;
  }
};

// x: [rows, n]. out[rows, n] <- round(act(x)): torch's F.gelu, relu or relu's square (the
// un-gated MLP of StarCoder2, GPT-2, Phi, GPT-NeoX, OPT, Nemotron and Arcee). out may be x.
template <typename T, class Act>
void activation(const T* x, T* out, int64_t rows, int64_t n, Act act) {
#pragma omp parallel for if (parallel_worth_it(rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = x + r * n;
    T* o = out + r * n;
#ifdef KVLOOM_AVX512
    using namespace kvloom_simd;
    for (int64_t i = 0; i < n; i += 16) store16(o + i, act(load16(g + i, n - i)), n - i);
    continue;
#endif
    int64_t vec = 0;  // elements the vector loop takes; the scalar rule does the rest
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
    using namespace kvloom_simd;
    vec = n / 8 * 8;
    for (int64_t i = 0; i < vec; i += 8) store8(o + i, act(to_float8(g + i)));
#endif
    for (int64_t i = vec; i < n; ++i) from_float(act(to_float(g[i])), o + i);
  }
}

// gate_up: [rows, 2n] (gate then up). out[rows, n] <- round(round(act(gate)) * up): torch's
// F.silu(gate) * up (SwiGLU) or F.gelu(gate, approximate="tanh") * up (Gemma's GeGLU), each
// op rounded to T.
template <typename T, class Act>
void gated(const T* gate_up, T* out, int64_t rows, int64_t n, Act act) {
#pragma omp parallel for if (parallel_worth_it(rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * n;
    const T* u = g + n;
    T* o = out + r * n;
#ifdef KVLOOM_AVX512
    using namespace kvloom_simd;
    for (int64_t i = 0; i < n; i += 16)
      store16(o + i, _mm512_mul_ps(round16(act(load16(g + i, n - i)), o), load16(u + i, n - i)), n - i);
    continue;
#endif
    int64_t vec = 0;  // elements the vector loop takes; the scalar rule does the rest
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
    using namespace kvloom_simd;
    vec = n / 8 * 8;
    for (int64_t i = 0; i < vec; i += 8) store8(o + i, _mm256_mul_ps(round8(act(to_float8(g + i)), o), to_float8(u + i)));
#endif
    for (int64_t i = vec; i < n; ++i) from_float(round_to(round_to(act(to_float(g[i])), o) * to_float(u[i]), o), o + i);
  }
}

// Rotate-half rotary embedding, in place, on `heads` consecutive head vectors of each
// token row (q's heads then k's heads: they are adjacent in the fused qkv output), over
// the first `rotary_dim` dimensions of each head (all of them, or Phi-4's part; the rest
// pass). cos/sin: [tokens, rotary_dim] float32, the two halves equal. Per element, as the
// reference: x1' = round(round(x1 c) + round(-x2 s)), x2' = round(round(x2 c) + round(x1 s)),
// with c and s rounded to the activation type first.
template <typename T>
void rotary(T* x, int64_t row_stride, const float* cos, const float* sin, int64_t tokens,
            int64_t heads, int64_t head_dim, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
#pragma omp parallel for if (parallel_worth_it(tokens, tokens * heads * rotary_dim))
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * rotary_dim;
    const float* s = sin + t * rotary_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * row_stride + h * head_dim;
#ifdef KVLOOM_AVX512
      using namespace kvloom_simd;
      for (int64_t i = 0; i < half; i += 16) {
        const int64_t m = half - i;
        const __m512 ci = round16(load16(c + i, m), v), si = round16(load16(s + i, m), v);
        const __m512 x1 = load16(v + i, m), x2 = load16(v + i + half, m);
        const __m512 y1 = _mm512_add_ps(round16(_mm512_mul_ps(x1, ci), v),
                                        round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), si), v));
        const __m512 y2 = _mm512_add_ps(round16(_mm512_mul_ps(x2, ci), v), round16(_mm512_mul_ps(x1, si), v));
        store16(v + i, y1, m);
        store16(v + i + half, y2, m);
      }
      continue;
#endif
      int64_t vec = 0;  // dims the vector loop takes; the scalar rule does the rest
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
      using namespace kvloom_simd;
      vec = half / 8 * 8;
      for (int64_t i = 0; i < vec; i += 8) {
        const __m256 ci = round8(to_float8(c + i), v), si = round8(to_float8(s + i), v);
        const __m256 x1 = to_float8(v + i), x2 = to_float8(v + i + half);
        const __m256 y1 = _mm256_add_ps(round8(_mm256_mul_ps(x1, ci), v),
                                        round8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), si), v));
        const __m256 y2 = _mm256_add_ps(round8(_mm256_mul_ps(x2, ci), v), round8(_mm256_mul_ps(x1, si), v));
        store8(v + i, y1);
        store8(v + i + half, y2);
      }
#endif
      for (int64_t i = vec; i < half; ++i) {
        const float ci = round_to(c[i], v), si = round_to(s[i], v);
        const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
        const float y1 = round_to(round_to(x1 * ci, v) + round_to(-x2 * si, v), v);
        const float y2 = round_to(round_to(x2 * ci, v) + round_to(x1 * si, v), v);
        from_float(y1, v + i);
        from_float(y2, v + i + half);
      }
    }
  }
}


// x[i] <- clamp(x[i], -limit, limit) for i < count, in place: torch's x.clamp_(-limit, limit)
// (OLMo 1's clip_qkv), a bound rounded to T where it is taken, NaN kept as it is.
template <typename T>
void clamp(T* x, int64_t count, float limit) {
#pragma omp parallel for if (count >= (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    const float v = to_float(x[i]);
    if (v < -limit) from_float(-limit, x + i);
    else if (v > limit) from_float(limit, x + i);
  }
}

// y[rows[i]] <- round(y[rows[i]] + delta[i]) for i < count (rows nullptr: row i), rows of
// n elements: torch's `y += delta` and `y.index_add_(0, rows, delta)`, the float sum
// rounded once (LoRA's deltas, kvloom/lora/layers.py). The rows must be distinct.
template <typename T>
void add_rows(T* y, const T* delta, const int64_t* rows, int64_t count, int64_t n) {
#pragma omp parallel for if (parallel_worth_it(count, count * n))
  for (int64_t i = 0; i < count; ++i) {
    T* yr = y + (rows != nullptr ? rows[i] : i) * n;
    const T* d = delta + i * n;
#ifdef KVLOOM_AVX512
    using namespace kvloom_simd;
    for (int64_t j = 0; j < n; j += 16) store16(yr + j, _mm512_add_ps(load16(yr + j, n - j), load16(d + j, n - j)), n - j);
    continue;
#endif
    int64_t vec = 0;  // elements the vector loop takes; the scalar rule does the rest
#if defined(KVLOOM_AVX2) && !defined(KVLOOM_AVX512)
    using namespace kvloom_simd;
    vec = n / 8 * 8;
    for (int64_t j = 0; j < vec; j += 8) store8(yr + j, _mm256_add_ps(to_float8(yr + j), to_float8(d + j)));
#endif
    for (int64_t j = vec; j < n; ++j) from_float(to_float(yr[j]) + to_float(d[j]), yr + j);
  }
}

// 1 / (1 + exp(-x)) in float32: a router's sigmoid scores and a shared expert's gate.
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// x[r] <- round(round(sigmoid(gate[r])) * x[r]) for each of `rows` rows of n, gate [rows] (a
// [rows, 1] column): Qwen2-MoE's gated shared expert, torch's `sigmoid(gate) * x` with the
// sigmoid rounded to T first (its exp is not torch's, so to within an ulp of its sigmoid).
template <typename T>
void sigmoid_gate(T* x, const T* gate, int64_t rows, int64_t n) {
#pragma omp parallel for if (parallel_worth_it(rows, rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const float g = round_to(sigmoid(to_float(gate[r])), gate);
    T* xr = x + r * n;
    for (int64_t j = 0; j < n; ++j) from_float(g * to_float(xr[j]), xr + j);
  }
}

// x as computed, not fused into the operation after it: -ffast-math lets GCC contract a
// product and a sum into one fma, which rounds once where torch rounds the product first.
template <class V>
inline V kept(V x) {
  asm("" : "+v"(x));
  return x;
}

// out[t] <- the sum over r < k of round(y[p] * weights[p]) for p = pairs[t][r] (p < 0:
// none), added in r's order onto +0, each sum rounded to T: a mixture-of-experts layer's
// experts' outputs weighted and added up token by token (models/moe.py: `(y * w).to(T)`,
// then one `index_add_` per expert in ascending order; pairs[t] lists token t's rows of y
// in that order). weights are float32 (a bf16 weight widens exactly); the product is
// rounded to float32 and then to T, as torch's bf16-times-float32 product and its cast.
template <typename T>
void moe_combine(const T* y, const float* weights, const int64_t* pairs, T* out, int64_t tokens, int64_t k,
                 int64_t n) {
#pragma omp parallel for if (parallel_worth_it(tokens, tokens * k * n))
  for (int64_t t = 0; t < tokens; ++t) {
    T* o = out + t * n;
    for (int64_t j = 0; j < n; ++j) from_float(0.0f, o + j);
    for (int64_t r = 0; r < k; ++r) {
      const int64_t p = pairs[t * k + r];
      if (p < 0) continue;
      const T* yr = y + p * n;
      const float w = weights[p];
      int64_t vec = 0;  // elements the vector loop takes; the scalar rule does the rest
#ifdef KVLOOM_AVX512
      {
        using namespace kvloom_simd;
        const __m512 wv = _mm512_set1_ps(w);
        for (int64_t j = 0; j < n; j += 16) {
          const __m512 c = round16(kept(_mm512_mul_ps(load16(yr + j, n - j), wv)), o);
          store16(o + j, _mm512_add_ps(load16(o + j, n - j), c), n - j);
        }
        vec = n;
      }
#elif defined(KVLOOM_AVX2)
      {
        using namespace kvloom_simd;
        const __m256 wv = _mm256_set1_ps(w);
        vec = n / 8 * 8;
        for (int64_t j = 0; j < vec; j += 8)
          store8(o + j, _mm256_add_ps(to_float8(o + j), round8(kept(_mm256_mul_ps(to_float8(yr + j), wv)), o)));
      }
#endif
      for (int64_t j = vec; j < n; ++j) from_float(to_float(o[j]) + round_to(kept(to_float(yr[j]) * w), o), o + j);
    }
  }
}

// A mixture-of-experts router's top-k, token by token: models/moe.py's route() is the torch
// reference, which this matches to float32 rounding, not bit for bit (its exp is torch's own).
// Per token t, the scores in float32: softmax(logits[t]) (the max subtracted, exp, times the
// reciprocal of the sum added in expert order; Mixtral's, Qwen's, OLMoE's rule), or where
// sigmoid_scores 1 / (1 + exp(-logit)) (LFM2-MoE's, DeepSeek-V3's in one group). The top_k largest
// of score + bias[e] (bias nullptr: the score alone; ties to the lower expert), in
// descending order, into experts[t]; their scores (not the bias) into weights[t], divided
// by their sum (added in that order) plus eps where norm, times scaling, and rounded to
// bf16 (kept as float) where round_to_bf16. A token's result depends on its row alone.
// Group-limited choice (DeepSeek's; group_rule not GROUPS_NONE): the experts form num_groups
// equal groups in order, each scored by its best score + bias (GROUPS_BEST, DeepSeek-V2's
// group_limited_greedy) or the sum of its two best (GROUPS_TOP2_SUM, V3's noaux_tc); the top_k
// come from the topk_groups best groups alone (ties to the lower group).
constexpr int64_t MAX_ROUTED_EXPERTS = 1024;  // a token's scores and choices sit on the stack
enum GroupRule { GROUPS_NONE, GROUPS_BEST, GROUPS_TOP2_SUM };

template <typename T>
void moe_route(const T* logits, const float* bias, float* weights, int64_t* experts, int64_t tokens,
               int64_t num_experts, int64_t top_k, int64_t sigmoid_scores, int64_t norm, float eps, float scaling,
               int64_t round_to_bf16, int64_t num_groups, int64_t topk_groups, int64_t group_rule) {
#pragma omp parallel for if (parallel_worth_it(tokens, tokens * num_experts * 4))
  for (int64_t t = 0; t < tokens; ++t) {
    const T* l = logits + t * num_experts;
    float scores[MAX_ROUTED_EXPERTS], choice[MAX_ROUTED_EXPERTS];
    if (sigmoid_scores) {
      for (int64_t e = 0; e < num_experts; ++e) scores[e] = sigmoid(to_float(l[e]));
    } else {
      float top = -INFINITY;
      for (int64_t e = 0; e < num_experts; ++e) top = std::max(top, to_float(l[e]));
      float sum = 0.0f;
      for (int64_t e = 0; e < num_experts; ++e) {
        scores[e] = std::exp(to_float(l[e]) - top);
        sum += scores[e];
      }
      const float inverse = 1.0f / sum;  // torch multiplies by the sum's reciprocal
      for (int64_t e = 0; e < num_experts; ++e) scores[e] *= inverse;
    }
    for (int64_t e = 0; e < num_experts; ++e) choice[e] = bias != nullptr ? scores[e] + bias[e] : scores[e];
    float* w = weights + t * top_k;
    int64_t* chosen = experts + t * top_k;
    bool taken[MAX_ROUTED_EXPERTS];
    std::fill_n(taken, num_experts, false);
    if (group_rule != GROUPS_NONE && num_groups > 1) {  // the experts outside the chosen groups count as taken
      const int64_t size = num_experts / num_groups;
      float group_score[MAX_ROUTED_EXPERTS];
      for (int64_t g = 0; g < num_groups; ++g) {
        float best = -INFINITY, second = -INFINITY;
        for (int64_t e = g * size; e < (g + 1) * size; ++e) {
          if (choice[e] > best) {
            second = best;
            best = choice[e];
          } else if (choice[e] > second) {
            second = choice[e];
          }
        }
        group_score[g] = group_rule == GROUPS_BEST ? best : best + second;
      }
      bool chosen_group[MAX_ROUTED_EXPERTS];
      std::fill_n(chosen_group, num_groups, false);
      for (int64_t j = 0; j < topk_groups; ++j) {
        int64_t best = -1;
        for (int64_t g = 0; g < num_groups; ++g)
          if (!chosen_group[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
        chosen_group[best] = true;
      }
      for (int64_t e = 0; e < num_experts; ++e) taken[e] = !chosen_group[e / size];
    }
    for (int64_t j = 0; j < top_k; ++j) {  // k passes: the best expert not taken yet (k is small)
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e)
        if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
      taken[best] = true;
      chosen[j] = best;
      w[j] = scores[best];
    }
    float denominator = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) denominator += w[j];
    denominator += eps;
    for (int64_t j = 0; j < top_k; ++j) {
      float v = norm ? w[j] / denominator : w[j];
      if (scaling != 1.0f) v *= scaling;
      w[j] = round_to_bf16 ? round_to(v, static_cast<const uint16_t*>(nullptr)) : v;
    }
  }
}

// A float32 router (DeepSeek's: transformers keeps the gate's weight float32 and computes its
// logits in float32): logits[t, e] = x[t] . weight[e], x bf16 widened exactly, each logit one
// chain of fused multiply-adds over 16 lanes in steps of 16 (a zero tail adds nothing) and the
// lanes summed in _mm512_reduce_add_ps's order (halves, quarters, pairs). A logit's bits depend
// on its row alone, not on the rows beside it, the blocking or the threads; the AVX-512 and AVX2
// builds give the same bits (docs/results/issue17/genoa37/router_paths_check.py), a build without
// AVX2 its own (-ffast-math lets the compiler reorder its scalar lanes' sums).
namespace router {

// The 16 lanes' sum in the AVX-512 reduction's order (the AVX2 and scalar paths).
inline float reduce16(const float* lane) {
  float half[8], quarter[4];
  for (int i = 0; i < 8; ++i) half[i] = lane[i + 8] + lane[i];
  for (int i = 0; i < 4; ++i) quarter[i] = half[i + 4] + half[i];
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

// One logit where no AVX-512 path runs: 16 lanes of fmas, lane for lane the AVX-512 chain (AVX2).
inline float dot(const uint16_t* x, const float* w, int64_t n) {
  float lane[16] = {};
#ifdef KVLOOM_AVX2
  using namespace kvloom_simd;
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const int64_t whole = n / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) {
    lo = _mm256_fmadd_ps(to_float8(x + i), _mm256_loadu_ps(w + i), lo);
    hi = _mm256_fmadd_ps(to_float8(x + i + 8), _mm256_loadu_ps(w + i + 8), hi);
  }
  _mm256_storeu_ps(lane, lo);
  _mm256_storeu_ps(lane + 8, hi);
  for (int64_t i = whole; i < n; ++i) lane[i - whole] = std::fma(to_float(x[i]), w[i], lane[i - whole]);
#else
  for (int64_t i = 0; i < n; ++i) lane[i % 16] = std::fma(to_float(x[i]), w[i], lane[i % 16]);
#endif
  return reduce16(lane);
}

#ifdef KVLOOM_AVX512
// ROWS rows x EXPERTS experts of logits at once: independent chains (each still its own, in
// its own order) so that the fma latency is hidden, each weight line loaded once for ROWS rows.
template <int ROWS, int EXPERTS>
inline void block(const uint16_t* x, const float* w, float* out, int64_t n, int64_t num_experts) {
  using namespace kvloom_simd;
  __m512 acc[ROWS][EXPERTS];
  for (int r = 0; r < ROWS; ++r)
    for (int e = 0; e < EXPERTS; ++e) acc[r][e] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 xs[ROWS];
    for (int r = 0; r < ROWS; ++r) xs[r] = load16(x + r * n + i, n - i);
    for (int e = 0; e < EXPERTS; ++e) {
      const __m512 we = load16(w + e * n + i, n - i);
      for (int r = 0; r < ROWS; ++r) acc[r][e] = _mm512_fmadd_ps(xs[r], we, acc[r][e]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int e = 0; e < EXPERTS; ++e) out[r * num_experts + e] = _mm512_reduce_add_ps(acc[r][e]);
}
#endif

// Logits of rows [row, row + rows) and experts [first, first + count) (rows <= 2, count <= 4).
inline void tile(const uint16_t* x, const float* weight, float* logits, int64_t row, int64_t rows, int64_t first,
                 int64_t count, int64_t n, int64_t num_experts) {
  const uint16_t* xr = x + row * n;
  const float* w = weight + first * n;
  float* out = logits + row * num_experts + first;
#ifdef KVLOOM_AVX512
  if (rows == 2 && count == 4) return block<2, 4>(xr, w, out, n, num_experts);
  if (rows == 1 && count == 4) return block<1, 4>(xr, w, out, n, num_experts);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < count; ++e) block<1, 1>(xr + r * n, w + e * n, out + r * num_experts + e, n, num_experts);
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < count; ++e) out[r * num_experts + e] = dot(xr + r * n, w + e * n, n);
#endif
}

void logits(const uint16_t* x, const float* weight, float* out, int64_t tokens, int64_t num_experts, int64_t n) {
  const int64_t row_tiles = (tokens + 1) / 2, expert_tiles = (num_experts + 3) / 4;
#pragma omp parallel for schedule(dynamic, 4) if (parallel_worth_it(row_tiles * expert_tiles, tokens * num_experts * n))
  for (int64_t item = 0; item < row_tiles * expert_tiles; ++item) {
    const int64_t row = item / expert_tiles * 2, first = item % expert_tiles * 4;
    tile(x, weight, out, row, std::min<int64_t>(2, tokens - row), first, std::min<int64_t>(4, num_experts - first),
         n, num_experts);
  }
}

}  // namespace router

}  // namespace

extern "C" {

void kvloom_rms_norm_f32(const float* x, float* residual, const float* weight, float* out, int64_t rows,
                         int64_t n, float eps) {
  rms_norm(x, residual, weight, out, rows, n, eps);
}
void kvloom_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                          int64_t rows, int64_t n, float eps) {
  rms_norm(x, residual, weight, out, rows, n, eps);
}
void kvloom_silu_and_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t n) {
  gated(gate_up, out, rows, n, Silu());
}
void kvloom_silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n) {
  gated(gate_up, out, rows, n, Silu());
}
void kvloom_rms_norm_scaled_f32(const float* x, float* residual, const float* weight, float* out, int64_t rows,
                                int64_t n, float eps, float offset) {
  rms_norm_scaled(x, residual, weight, out, rows, n, eps, offset);
}
void kvloom_rms_norm_scaled_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                                 int64_t rows, int64_t n, float eps, float offset) {
  rms_norm_scaled(x, residual, weight, out, rows, n, eps, offset);
}
void kvloom_gelu_tanh_and_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t n) {
  gated(gate_up, out, rows, n, GeluTanh());
}
void kvloom_gelu_tanh_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n) {
  gated(gate_up, out, rows, n, GeluTanh());
}
void kvloom_layer_norm_f32(const float* x, float* residual, const float* weight, const float* bias, float* out,
                           int64_t rows, int64_t n, float eps) {
  layer_norm(x, residual, weight, bias, out, rows, n, eps);
}
void kvloom_layer_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, const uint16_t* bias,
                            uint16_t* out, int64_t rows, int64_t n, float eps) {
  layer_norm(x, residual, weight, bias, out, rows, n, eps);
}
void kvloom_gelu_tanh_f32(const float* x, float* out, int64_t rows, int64_t n) { activation(x, out, rows, n, GeluTanh()); }
void kvloom_gelu_erf_f32(const float* x, float* out, int64_t rows, int64_t n) { activation(x, out, rows, n, GeluErf()); }
void kvloom_gelu_erf_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t n) { activation(x, out, rows, n, GeluErf()); }
void kvloom_gelu_tanh_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t n) { activation(x, out, rows, n, GeluTanh()); }
void kvloom_relu_f32(const float* x, float* out, int64_t rows, int64_t n) { activation(x, out, rows, n, Relu()); }
void kvloom_relu_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t n) { activation(x, out, rows, n, Relu()); }
void kvloom_relu2_f32(const float* x, float* out, int64_t rows, int64_t n) { activation(x, out, rows, n, Relu2()); }
void kvloom_relu2_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t n) { activation(x, out, rows, n, Relu2()); }
void kvloom_rotary_f32(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t tokens,
                       int64_t num_heads, int64_t head_dim, int64_t rotary_dim) {
  rotary(x, row_stride, cos, sin, tokens, num_heads, head_dim, rotary_dim);
}
void kvloom_rotary_bf16(uint16_t* x, int64_t row_stride, const float* cos, const float* sin, int64_t tokens,
                        int64_t num_heads, int64_t head_dim, int64_t rotary_dim) {
  rotary(x, row_stride, cos, sin, tokens, num_heads, head_dim, rotary_dim);
}

void kvloom_clamp_f32(float* x, int64_t count, float limit) { clamp(x, count, limit); }
void kvloom_clamp_bf16(uint16_t* x, int64_t count, float limit) { clamp(x, count, limit); }
void kvloom_add_rows_f32(float* y, const float* delta, const int64_t* rows, int64_t count, int64_t n) {
  add_rows(y, delta, rows, count, n);
}
void kvloom_moe_combine_f32(const float* y, const float* weights, const int64_t* pairs, float* out, int64_t tokens,
                            int64_t k, int64_t n) {
  moe_combine(y, weights, pairs, out, tokens, k, n);
}
void kvloom_moe_combine_bf16(const uint16_t* y, const float* weights, const int64_t* pairs, uint16_t* out,
                             int64_t tokens, int64_t k, int64_t n) {
  moe_combine(y, weights, pairs, out, tokens, k, n);
}
// 0, or 1 where num_experts is past MAX_ROUTED_EXPERTS or top_k outside [1, num_experts] (nothing written).
// Returns 1 (nothing written) for shapes it does not take: more than MAX_ROUTED_EXPERTS experts, top_k
// outside [1, experts], or groups that do not divide the experts or hold fewer than top_k between the
// topk_groups chosen (or, for GROUPS_TOP2_SUM, fewer than two experts a group).
inline bool routable(int64_t num_experts, int64_t top_k, int64_t num_groups, int64_t topk_groups, int64_t group_rule) {
  if (num_experts > MAX_ROUTED_EXPERTS || top_k < 1 || top_k > num_experts) return false;
  if (group_rule == GROUPS_NONE) return true;
  return group_rule <= GROUPS_TOP2_SUM && num_groups >= 1 && num_experts % num_groups == 0 && topk_groups >= 1 &&
         topk_groups <= num_groups && topk_groups * (num_experts / num_groups) >= top_k &&
         (group_rule != GROUPS_TOP2_SUM || num_experts / num_groups >= 2);
}
int kvloom_moe_route_f32(const float* logits, const float* bias, float* weights, int64_t* experts, int64_t tokens,
                         int64_t num_experts, int64_t top_k, int64_t sigmoid, int64_t norm, float eps, float scaling,
                         int64_t round_to_bf16, int64_t num_groups, int64_t topk_groups, int64_t group_rule) {
  if (!routable(num_experts, top_k, num_groups, topk_groups, group_rule)) return 1;
  moe_route(logits, bias, weights, experts, tokens, num_experts, top_k, sigmoid, norm, eps, scaling, round_to_bf16,
            num_groups, topk_groups, group_rule);
  return 0;
}
int kvloom_moe_route_bf16(const uint16_t* logits, const float* bias, float* weights, int64_t* experts,
                          int64_t tokens, int64_t num_experts, int64_t top_k, int64_t sigmoid, int64_t norm, float eps,
                          float scaling, int64_t round_to_bf16, int64_t num_groups, int64_t topk_groups,
                          int64_t group_rule) {
  if (!routable(num_experts, top_k, num_groups, topk_groups, group_rule)) return 1;
  moe_route(logits, bias, weights, experts, tokens, num_experts, top_k, sigmoid, norm, eps, scaling, round_to_bf16,
            num_groups, topk_groups, group_rule);
  return 0;
}
// logits [tokens, num_experts] float32 = x [tokens, n] (bf16) . weight [num_experts, n] (float32) (router::logits).
void kvloom_router_logits_bf16(const uint16_t* x, const float* weight, float* logits, int64_t tokens,
                               int64_t num_experts, int64_t n) {
  router::logits(x, weight, logits, tokens, num_experts, n);
}
void kvloom_sigmoid_gate_f32(float* x, const float* gate, int64_t rows, int64_t n) { sigmoid_gate(x, gate, rows, n); }
void kvloom_sigmoid_gate_bf16(uint16_t* x, const uint16_t* gate, int64_t rows, int64_t n) {
  sigmoid_gate(x, gate, rows, n);
}
void kvloom_add_rows_bf16(uint16_t* y, const uint16_t* delta, const int64_t* rows, int64_t count, int64_t n) {
  add_rows(y, delta, rows, count, n);
}

}
