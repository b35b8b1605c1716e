// Random sampling of one token per row by inverse CDF, in one pass over each row's
// logits instead of PyTorch's chain (divide, softmax, cumsum, searchsorted, a scan for
// the last token with mass), each a full [rows, vocab] pass with its own allocation.
//
// Row r draws token i = the first index whose running sum of w_j = exp((x_j - max) *
// inv_temp[r]) exceeds uniforms[r] * sum(w): the same rule as runner/sampler.py's
// `_inverse_cdf` (searchsorted with right=True on the unnormalised CDF). Entries at
// -inf (filtered out) weigh exactly zero and are never drawn. The running sum is
// formed 16 lanes at a time and then chunk by chunk in order, and the total is that
// same sequence of chunk sums, so the search always ends inside the row; a rounding
// gap inside the final chunk falls back to its last token with mass.
#include <cmath>
#include <cstdint>
#include <vector>
#include <omp.h>

#include "simd.h"

namespace {

int64_t sample_row(const float* x, int64_t vocab, float inv_temp, float uniform, float* weights,
                   float* chunk_sums) {
  float row_max = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) row_max = std::max(row_max, x[i]);
  if (row_max == -INFINITY) return 0;  // nothing has mass: callers never pass such rows
  const int64_t chunks = (vocab + 15) / 16;
  float total = 0.0f;
#ifdef KVLOOM_AVX512
  const __m512 shift = _mm512_set1_ps(row_max), scale = _mm512_set1_ps(inv_temp);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t count = std::min<int64_t>(16, vocab - 16 * c);
    const __mmask16 live = kvloom_simd::lanes(count);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + 16 * c);
    const __mmask16 has_mass = live & _mm512_cmp_ps_mask(v, minus_inf, _CMP_NEQ_OQ);
    const __m512 w = _mm512_maskz_mov_ps(has_mass, kvloom_simd::exp16(_mm512_mul_ps(_mm512_sub_ps(v, shift), scale)));
    _mm512_storeu_ps(weights + 16 * c, w);
    chunk_sums[c] = _mm512_reduce_add_ps(w);
    total += chunk_sums[c];
  }
#else
  int64_t vec = 0;  // chunks the vector loop takes; the scalar rule does the rest (a partial last one)
#ifdef KVLOOM_AVX2
  // The AVX-512 chunk on two 8-lane halves: exp8 is exp16's arithmetic, and
  // reduce_add16 sums a chunk in _mm512_reduce_add_ps's order.
  vec = vocab / 16;
  const __m256 shift = _mm256_set1_ps(row_max), scale = _mm256_set1_ps(inv_temp);
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  for (int64_t c = 0; c < vec; ++c) {
    __m256 w[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_loadu_ps(x + 16 * c + 8 * h);
      const __m256 has_mass = _mm256_cmp_ps(v, minus_inf, _CMP_NEQ_OQ);
      w[h] = _mm256_and_ps(kvloom_simd::exp8(_mm256_mul_ps(_mm256_sub_ps(v, shift), scale)), has_mass);
      _mm256_storeu_ps(weights + 16 * c + 8 * h, w[h]);
    }
    chunk_sums[c] = kvloom_simd::reduce_add16(w[0], w[1]);
    total += chunk_sums[c];
  }
#endif
  for (int64_t c = vec; c < chunks; ++c) {
    float sum = 0.0f;
    for (int64_t i = 16 * c; i < std::min<int64_t>(vocab, 16 * c + 16); ++i) {
      weights[i] = x[i] == -INFINITY ? 0.0f : std::exp((x[i] - row_max) * inv_temp);
      sum += weights[i];
    }
    chunk_sums[c] = sum;
    total += sum;
  }
#endif
  const float target = uniform * total;
  float running = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (running + chunk_sums[c] <= target) {
      running += chunk_sums[c];
      continue;
    }
    const int64_t end = std::min<int64_t>(vocab, 16 * c + 16);
    int64_t last_with_mass = -1;
    for (int64_t i = 16 * c; i < end; ++i) {
      if (weights[i] == 0.0f) continue;
      running += weights[i];
      last_with_mass = i;
      if (running > target) return i;
    }
    if (last_with_mass >= 0) return last_with_mass;
  }
  for (int64_t i = vocab - 1; i > 0; --i)  // target == total after rounding
    if (weights[i] > 0.0f) return i;
  return 0;
}

// Greedy: the index of the row's first maximum, as torch.argmax (a NaN counts as the
// maximum: the first NaN's index). Each of 16 lanes keeps the first maximum of its
// indices (strictly greater replaces), so the row's answer is the smallest index among
// the lanes holding the overall maximum.
template <typename T>
int64_t argmax_row(const T* x, int64_t vocab) {
#ifdef KVLOOM_AVX512
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = _mm512_setzero_si512();
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 live = kvloom_simd::lanes(vocab - i);
    const __m512 v = kvloom_simd::load16(x + i, vocab - i);
    if (_mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q)) {
      for (int64_t j = i;; ++j)
        if (std::isnan(kvloom_simd::to_float(x[j]))) return j;
    }
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(live, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    at = _mm512_add_epi32(at, step);
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  // Lanes never replaced hold index 0 with -inf: right when the whole row is -inf.
  return _mm512_mask_reduce_min_epi32(holders, best_at);
#elif defined(KVLOOM_AVX2)
  // The same on 8 lanes; a tail shorter than 8 goes through the scalar loop's rule.
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_at = _mm256_setzero_si256();
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 v = kvloom_simd::to_float8(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
      for (int64_t j = i;; ++j)
        if (std::isnan(kvloom_simd::to_float(x[j]))) return j;
    }
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, greater);
    best_at = _mm256_blendv_epi8(best_at, at, _mm256_castps_si256(greater));
    at = _mm256_add_epi32(at, step);
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_at[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), best_at);
  float top = lane_best[0];
  int64_t top_at = lane_at[0];  // lanes never replaced hold index 0 with -inf: right for a -inf row
  for (int lane = 1; lane < 8; ++lane)
    if (lane_best[lane] > top || (lane_best[lane] == top && lane_at[lane] < top_at)) {
      top = lane_best[lane];
      top_at = lane_at[lane];
    }
  for (; i < vocab; ++i) {  // the tail: later indices, so only a strictly greater value wins
    const float v = kvloom_simd::to_float(x[i]);
    if (std::isnan(v)) return i;
    if (v > top) { top = v; top_at = i; }
  }
  return top_at;
#else
  int64_t best_at = 0;
  float best = kvloom_simd::to_float(x[0]);
  if (std::isnan(best)) return 0;
  for (int64_t i = 1; i < vocab; ++i) {
    const float v = kvloom_simd::to_float(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) { best = v; best_at = i; }
  }
  return best_at;
#endif
}

}  // namespace

extern "C" {

// logits: [rows, vocab] float32 (dtype 0) or bf16 (1), contiguous; out: [rows].
void kvloom_argmax_rows(const void* logits, int dtype, int64_t rows, int64_t vocab, int64_t* out,
                        int num_threads) {
#pragma omp parallel for schedule(static) num_threads(rows > 1 ? num_threads : 1)
  for (int64_t r = 0; r < rows; ++r)
    out[r] = dtype == 0 ? argmax_row(static_cast<const float*>(logits) + r * vocab, vocab)
                        : argmax_row(static_cast<const uint16_t*>(logits) + r * vocab, vocab);
}


// Structured output's mask, in place: row rows[c] of logits ([batch, vocab] float32 or
// bf16, contiguous) gets -inf at every token whose bit in bitmask[c] ([count, width]
// int32, bit b of word w for token 32 * w + b) is clear. A word of all ones (a free-text
// grammar allows nearly every token) is skipped whole, so the pass costs a read of the
// bitmask and a write of each forbidden token alone. Bits past vocab are ignored.
void kvloom_apply_token_bitmask(void* logits, int dtype, int64_t vocab, const int64_t* rows,
                                const int32_t* bitmask, int64_t count, int64_t width, int num_threads) {
  const uint16_t bf16_minus_inf = 0xFF80;
#pragma omp parallel for schedule(static) num_threads(count > 1 ? num_threads : 1)
  for (int64_t c = 0; c < count; ++c) {
    const int32_t* words = bitmask + c * width;
    float* f32 = static_cast<float*>(logits) + rows[c] * vocab;
    uint16_t* bf16 = static_cast<uint16_t*>(logits) + rows[c] * vocab;
    for (int64_t w = 0; w < width; ++w) {
      const uint32_t allowed = static_cast<uint32_t>(words[w]);
      if (allowed == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, vocab - 32 * w);
      for (int64_t b = 0; b < end; ++b) {
        if (allowed >> b & 1u) continue;
        if (dtype == 0) f32[32 * w + b] = -INFINITY;
        else bf16[32 * w + b] = bf16_minus_inf;
      }
    }
  }
}


// logits: [rows, vocab] float32, contiguous; inv_temp, uniforms: [rows]; out: [rows].
void kvloom_sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* inv_temp,
                        const float* uniforms, int64_t* out, int num_threads) {
#pragma omp parallel num_threads(rows > 1 ? num_threads : 1)
  {
    std::vector<float> weights(vocab + 16), chunk_sums(vocab / 16 + 1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      out[r] = sample_row(logits + r * vocab, vocab, inv_temp[r], uniforms[r], weights.data(),
                          chunk_sums.data());
  }
}

}
