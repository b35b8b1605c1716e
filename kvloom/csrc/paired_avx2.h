// Paired-layout attention on AVX2 + FMA (Zen 1-3, Haswell to Alder Lake: no AVX-512).
//
// The AVX-512 FMA path (PairsFma in paged_attention.cpp) on 8-lane registers: a
// 16-key sub-tile is two halves of 8 lanes, and every lane does that path's operations
// in its order (pair products hi then lo, the scale, the running max, exp through
// exp8, per-lane partial sums, probabilities rounded to bf16, V's pair products, the
// final reduction in _mm512_reduce_add_ps's order). With 16 vector registers instead
// of 32 the accumulators cannot stay in registers: they live in an L1-resident array,
// and the V update walks them one 8-dim slice at a time for all vectors of the group,
// so each loaded and split V word still serves every vector.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "paired.h"
#include "simd.h"

#ifdef KVLOOM_AVX2
namespace kvloom_paired {
namespace {  // paged_attention.cpp's own: not exported from its library, called directly (no PLT)

constexpr int AVX2_GROUP = 4;  // query vectors per walk: 2 x 4 accumulators + 4 split keys + 2 broadcasts

// The two bf16 of 8 words as floats: hi (the upper halves), lo (the lower ones).
struct Split8 {
  __m256 hi, lo;
  explicit Split8(const uint32_t* words) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
    hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // acc + hi * b_hi, then + lo * b_lo: the pair product (paired.h), b broadcast.
  __m256 dot(__m256 acc, __m256 b_lo, __m256 b_hi) const {
    return _mm256_fmadd_ps(lo, b_lo, _mm256_fmadd_ps(hi, b_hi, acc));
  }
};

inline float horizontal_max(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtss_f32(m);
}

// G query vectors (same kv head; the same sequence, or sequences whose block tables
// agree over the range) against the keys, flash-attention style. limit[g] is the
// number of keys vector g sees. A vector's arithmetic does not depend on the others in
// its group, nor on G.
template <int D, int G>
void attend_group_avx2(const KeySource& src, const uint16_t* const* q, const int64_t* limit,
                       uint16_t* const* out, const BlockRange& range) {
  using namespace kvloom_simd;
  constexpr int P = D / 2;  // dim pairs
  constexpr int S = D / 8;  // 8-dim slices of an accumulator row
  alignas(32) float acc[G][D];
  alignas(32) float sums[G][16];     // per-lane partial sums, reduced once at the end
  alignas(32) float query[G][D];     // query[g][2p], [2p + 1]: the pair's lo and hi
  alignas(32) float scores[G][16];   // one sub-tile's scaled scores
  alignas(32) float weights[G][16];  // its probabilities, rounded to bf16
  float row_max[G];
  int64_t max_limit = 0;
  for (int g = 0; g < G; ++g) {
    if (range.resume) {
      const PairedState& st = *range.resume[g];
      std::memcpy(acc[g], st.acc, sizeof(acc[g]));
      std::memcpy(sums[g], st.sum, sizeof(sums[g]));
      row_max[g] = st.row_max;
    } else {
      std::fill(acc[g], acc[g] + D, 0.0f);
      std::fill(sums[g], sums[g] + 16, 0.0f);
      row_max[g] = -INFINITY;
    }
    for (int s = 0; s < S; ++s) _mm256_store_ps(query[g] + 8 * s, to_float8(q[g] + 8 * s));
    max_limit = std::max(max_limit, limit[g]);
  }
  const __m256 scale = _mm256_set1_ps(src.scale);
  const int64_t block_size = src.block_size;
  const int64_t num_blocks = range.end >= 0 ? range.end : (max_limit + block_size - 1) / block_size;
  for (int64_t b = range.begin; b < num_blocks; ++b) {
    const int64_t offset = src.table[b] * src.block_stride + src.head_offset;
    const uint32_t* kb = reinterpret_cast<const uint32_t*>(src.k_cache + offset);
    const uint32_t* vb = reinterpret_cast<const uint32_t*>(src.v_cache + offset);
    src.prefetch_ahead(b, num_blocks, block_size * D * 2);
    for (int64_t t0 = 0; t0 < block_size; t0 += 16) {
      const int64_t base = b * block_size + t0;  // position of this sub-tile's first key
      if (base >= max_limit) break;
      {  // QK^T: both 8-key halves at once, so 2G accumulator chains hide the FMA latency
        __m256 s_lo[G], s_hi[G];
        for (int g = 0; g < G; ++g) s_lo[g] = s_hi[g] = _mm256_setzero_ps();
        for (int p = 0; p < P; ++p) {
          const Split8 keys_lo(kb + p * block_size + t0), keys_hi(kb + p * block_size + t0 + 8);
          for (int g = 0; g < G; ++g) {
            const __m256 q_lo = _mm256_broadcast_ss(&query[g][2 * p]), q_hi = _mm256_broadcast_ss(&query[g][2 * p + 1]);
            s_lo[g] = keys_lo.dot(s_lo[g], q_lo, q_hi);
            s_hi[g] = keys_hi.dot(s_hi[g], q_lo, q_hi);
          }
        }
        for (int g = 0; g < G; ++g) {
          _mm256_store_ps(scores[g], _mm256_mul_ps(s_lo[g], scale));
          _mm256_store_ps(scores[g] + 8, _mm256_mul_ps(s_hi[g], scale));
        }
      }
      for (int g = 0; g < G; ++g) {  // online softmax over the sub-tile's live keys
        const int64_t count = limit[g] - base;
        __m256 e_lo = _mm256_setzero_ps(), e_hi = _mm256_setzero_ps();
        if (count > 0) {
          const __m256 live_lo = live8(count, 0), live_hi = live8(count, 8);
          const __m256 s_lo = _mm256_load_ps(scores[g]), s_hi = _mm256_load_ps(scores[g] + 8);
          const __m256 old_max = _mm256_set1_ps(row_max[g]);
          const __m256 above = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(s_lo, old_max, _CMP_GT_OQ), live_lo),
                                            _mm256_and_ps(_mm256_cmp_ps(s_hi, old_max, _CMP_GT_OQ), live_hi));
          if (_mm256_movemask_ps(above)) {  // a live score passes the running max: rescale
            const __m256 none = _mm256_set1_ps(-INFINITY);
            const float new_max = std::max(row_max[g], horizontal_max(_mm256_max_ps(
                _mm256_blendv_ps(none, s_lo, live_lo), _mm256_blendv_ps(none, s_hi, live_hi))));
            const __m256 correction = _mm256_set1_ps(std::exp(row_max[g] - new_max));
            for (int s = 0; s < S; ++s)
              _mm256_store_ps(acc[g] + 8 * s, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * s), correction));
            for (int s = 0; s < 2; ++s)
              _mm256_store_ps(sums[g] + 8 * s, _mm256_mul_ps(_mm256_load_ps(sums[g] + 8 * s), correction));
            row_max[g] = new_max;
          }
          const __m256 shift = _mm256_set1_ps(row_max[g]);
          e_lo = _mm256_and_ps(exp8(_mm256_sub_ps(s_lo, shift)), live_lo);
          e_hi = _mm256_and_ps(exp8(_mm256_sub_ps(s_hi, shift)), live_hi);
          _mm256_store_ps(sums[g], _mm256_add_ps(_mm256_load_ps(sums[g]), e_lo));
          _mm256_store_ps(sums[g] + 8, _mm256_add_ps(_mm256_load_ps(sums[g] + 8), e_hi));
        }
        _mm256_store_ps(weights[g], _mm256_castsi256_ps(bf16_bits8(e_lo)));
        _mm256_store_ps(weights[g] + 8, _mm256_castsi256_ps(bf16_bits8(e_hi)));
      }
      const uint32_t* pairs = vb + (t0 / 2) * D;  // PV: 8 token pairs, two 8-dim slices at a time
      for (int s = 0; s < S; s += 2) {
        __m256 a0[G], a1[G];
        for (int g = 0; g < G; ++g) {
          a0[g] = _mm256_load_ps(acc[g] + 8 * s);
          a1[g] = _mm256_load_ps(acc[g] + 8 * s + 8);
        }
        for (int j = 0; j < 8; ++j) {
          const Split8 values0(pairs + j * D + 8 * s), values1(pairs + j * D + 8 * s + 8);
          for (int g = 0; g < G; ++g) {
            const __m256 w_lo = _mm256_broadcast_ss(&weights[g][2 * j]), w_hi = _mm256_broadcast_ss(&weights[g][2 * j + 1]);
            a0[g] = values0.dot(a0[g], w_lo, w_hi);
            a1[g] = values1.dot(a1[g], w_lo, w_hi);
          }
        }
        for (int g = 0; g < G; ++g) {
          _mm256_store_ps(acc[g] + 8 * s, a0[g]);
          _mm256_store_ps(acc[g] + 8 * s + 8, a1[g]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    if (range.suspend) {
      PairedState& st = *range.suspend[g];
      std::memcpy(st.acc, acc[g], sizeof(acc[g]));
      std::memcpy(st.sum, sums[g], sizeof(sums[g]));
      st.row_max = row_max[g];
      continue;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / reduce_add16(_mm256_load_ps(sums[g]), _mm256_load_ps(sums[g] + 8)));
    for (int s = 0; s < S; ++s) store8(out[g] + 8 * s, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * s), inv));
  }
}

template <int D>
void attend_group_avx2_dispatch(const KeySource& src, int64_t count, const uint16_t* const* q,
                                const int64_t* limit, uint16_t* const* out, const BlockRange& range) {
  switch (count) {
    case 1: return attend_group_avx2<D, 1>(src, q, limit, out, range);
    case 2: return attend_group_avx2<D, 2>(src, q, limit, out, range);
    case 3: return attend_group_avx2<D, 3>(src, q, limit, out, range);
    case 4: return attend_group_avx2<D, 4>(src, q, limit, out, range);
    default: std::abort();  // callers never pass more than AVX2_GROUP
  }
}

inline void attend_group_avx2(int64_t head_dim, const KeySource& src, int64_t count, const uint16_t* const* q,
                              const int64_t* limit, uint16_t* const* out, const BlockRange& range) {
  switch (head_dim) {
    case 64: return attend_group_avx2_dispatch<64>(src, count, q, limit, out, range);
    case 128: return attend_group_avx2_dispatch<128>(src, count, q, limit, out, range);
    case 32: return attend_group_avx2_dispatch<32>(src, count, q, limit, out, range);
    default: std::abort();  // paired_supported was checked
  }
}

}  // namespace
}  // namespace kvloom_paired
#endif
