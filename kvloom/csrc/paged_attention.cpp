// Paged attention for CPUs: reads K/V straight through the block table (no gather).
//
// One work item = (sequence, kv head, tile of up to TILE query rows). The item's
// query heads that share the kv head (GQA group) and its query rows all reuse each
// K/V block once it has been converted to float, flash-attention style: per block,
// scores -> running max -> rescaled accumulator. Accumulation is float32 whatever
// the storage type. With bf16 storage on a CPU with AVX512-BF16 both dot products
// run on vdpbf16ps straight from the cache (block_update_bf16); otherwise K/V rows are
// converted to float once per block and kv head. Plain C ABI (called through ctypes)
// so that building needs no torch headers and takes about a second.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

constexpr int TILE = 16;
constexpr int64_t PREFETCH_BLOCKS = 2;  // how far ahead in the block table to prefetch

using kvloom_simd::from_float;
using kvloom_simd::to_float;

// Row primitives. With AVX-512 they work 16 floats at a time (head_dim % 16 == 0);
// otherwise, and for any remainder, plain loops.
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float total = 0.0f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}
inline void scale_add(float* acc, const float* v, float p, int64_t n) {  // acc += p * v
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 pv = _mm512_set1_ps(p);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * v[i];
}
// x[i] = exp(x[i] - shift) for i < n, returning the sum. Arguments are <= 0 here (the
// shift is the running max). AVX-512 path: 2^t with t = n + f, |f| <= 1/2, a degree-7
// Taylor polynomial for 2^f (relative error ~1e-8) and scalef for the 2^n.
inline float exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.0f;
#ifdef __AVX512F__
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 lowest = _mm512_set1_ps(-126.0f);
  const __m512 c1 = _mm512_set1_ps(0.693147180559945f), c2 = _mm512_set1_ps(0.240226506959101f),
               c3 = _mm512_set1_ps(0.0555041086648216f), c4 = _mm512_set1_ps(0.00961812910762848f),
               c5 = _mm512_set1_ps(0.00133335581464284f), c6 = _mm512_set1_ps(0.000154035303933816f),
               c7 = _mm512_set1_ps(1.52527338040598e-05f), one = _mm512_set1_ps(1.0f);
  const __m512 shift_v = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + i), shift_v), log2e);
    t = _mm512_max_ps(t, lowest);  // exp underflows to ~0 there anyway; keeps scalef sane
    const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, whole);
    __m512 p = _mm512_fmadd_ps(c7, f, c6);
    p = _mm512_fmadd_ps(p, f, c5);
    p = _mm512_fmadd_ps(p, f, c4);
    p = _mm512_fmadd_ps(p, f, c3);
    p = _mm512_fmadd_ps(p, f, c2);
    p = _mm512_fmadd_ps(p, f, c1);
    p = _mm512_fmadd_ps(p, f, one);
    const __m512 e = _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, whole));
    _mm512_mask_storeu_ps(x + i, live, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    total += x[i];
  }
  return total;
}

// exp(old_max - new_max), the factor that rescales what was accumulated under the old
// running max. After the first blocks the max rarely moves, so the common case skips
// the scalar exp (measurably: one per query and block).
inline float rescale_factor(float old_max, float new_max) {
  return old_max == new_max ? 1.0f : std::exp(old_max - new_max);
}

inline void scale_row(float* acc, float c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] *= c;
}

// One query vector against `visible` keys of a block (rows `stride` apart), updating
// its running max, sum and accumulator (online softmax).
inline void block_update_generic(int64_t head_dim, const float* qv, const float* kb, const float* vb,
                                 int64_t stride, int64_t visible, float* a, float* row_max,
                                 float* row_sum, float* sc) {
  float block_max = -INFINITY;
  for (int64_t t = 0; t < visible; ++t) {
    sc[t] = dot(qv, kb + t * stride, head_dim);
    block_max = std::max(block_max, sc[t]);
  }
  const float new_max = std::max(*row_max, block_max);
  const float correction = rescale_factor(*row_max, new_max);
  scale_row(a, correction, head_dim);
  const float sum = exp_shifted(sc, visible, new_max);
  for (int64_t t = 0; t < visible; ++t) scale_add(a, vb + t * stride, sc[t], head_dim);
  *row_max = new_max;
  *row_sum = *row_sum * correction + sum;
}

#ifdef __AVX512F__
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

// Online-softmax update of one query's accumulator with a block's scores (already in
// sc[0, visible), their maximum block_max) and its float V rows: rescale, exp, add.
template <int D>
inline void softmax_accumulate(const float* vb, int64_t stride, int64_t visible, float block_max,
                               float* a, float* row_max, float* row_sum, float* sc) {
  constexpr int R = D / 16;
  const float new_max = std::max(*row_max, block_max);
  const float factor = rescale_factor(*row_max, new_max);
  const __m512 correction = _mm512_set1_ps(factor);
  const float sum = exp_shifted(sc, visible, new_max);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * r), correction);
  for (int64_t t = 0; t < visible; ++t) {
    const __m512 p = _mm512_set1_ps(sc[t]);
    const float* v = vb + t * stride;
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * r), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(a + 16 * r, acc[r]);
  *row_sum = *row_sum * factor + sum;
  *row_max = new_max;
}

// The same with head_dim fixed at compile time: the query and the accumulator live in
// registers for the whole block (no store-to-load chains through memory).
// Scores of one query against `visible` keys, 16 at a time: row_dot(t) is the 16-lane
// partial product of key t (summed across lanes by sum16), times `scale`. Stored to
// sc; returns their maximum.
template <typename RowDot>
inline float block_scores(RowDot row_dot, int64_t visible, float scale, float* sc) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  float block_max = -INFINITY;
  for (int64_t t0 = 0; t0 < visible; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, visible - t0);
    __m512 prods[16];
    for (int64_t t = 0; t < 16; ++t) prods[t] = t < count ? row_dot(t0 + t) : _mm512_setzero_ps();
    const __mmask16 live = count == 16 ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
    const __m512 scores = _mm512_mul_ps(sum16(prods), scale_v);
    _mm512_mask_storeu_ps(sc + t0, live, scores);
    block_max = std::max(block_max, _mm512_mask_reduce_max_ps(live, scores));
  }
  return block_max;
}

template <int D>
inline void block_update_fixed(const float* qv, const float* kb, const float* vb, int64_t stride,
                               int64_t visible, float* a, float* row_max, float* row_sum, float* sc) {
  constexpr int R = D / 16;
  __m512 q[R];
  for (int r = 0; r < R; ++r) q[r] = _mm512_loadu_ps(qv + 16 * r);
  const float block_max = block_scores([&](int64_t t) {
    const float* k = kb + t * stride;
    __m512 prod = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
    for (int r = 1; r < R; ++r) prod = _mm512_fmadd_ps(q[r], _mm512_loadu_ps(k + 16 * r), prod);
    return prod;
  }, visible, 1.0f, sc);  // the query is pre-scaled
  softmax_accumulate<D>(vb, stride, visible, block_max, a, row_max, row_sum, sc);
}

#ifdef __AVX512BF16__
// bf16 storage with AVX512-BF16 (vdpbf16ps: 32 bf16 products per instruction, summed
// in pairs into float32 lanes). Both halves of attention use it:
// - scores: the cache's bf16 K rows against the query as stored (a product of two
//   bf16 values is exact in float32, so only the float32 sums round), then scaled;
// - output: the probabilities rounded to bf16 (2^-9 relative, below the bf16 output's
//   own rounding) against V rows interleaved in pairs of tokens (build_v_pairs).
// Half the multiply instructions of the float path, and no K/V conversion to float.

// V rows of one kv head as token pairs: out[j * D + d] holds (v[2j][d], v[2j+1][d]) as
// two bf16 in one 32-bit lane; a missing odd row is zero (its weight is zero too, and
// an unwritten slot could hold a NaN pattern).
template <int D>
inline void build_v_pairs(const uint16_t* v, int64_t stride, int64_t slots, uint32_t* out) {
  for (int64_t j = 0; 2 * j < slots; ++j) {
    const uint16_t* even = v + 2 * j * stride;
    const uint16_t* odd = 2 * j + 1 < slots ? even + stride : nullptr;
    for (int d = 0; d < D; d += 16) {
      const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d)));
      const __m512i high = odd ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d))), 16)
                               : _mm512_setzero_si512();
      _mm512_storeu_si512(out + j * D + d, _mm512_or_si512(low, high));
    }
  }
}

template <int D>
inline void block_update_bf16(const uint16_t* qv, float scale, const uint16_t* kb, int64_t k_stride,
                              const uint32_t* v_pairs, int64_t visible, float* a,
                              float* row_max, float* row_sum, float* sc) {
  constexpr int QR = D / 32;  // bf16 query registers
  constexpr int R = D / 16;   // float32 accumulator registers
  __m512bh q[QR];
  for (int r = 0; r < QR; ++r) q[r] = (__m512bh)_mm512_loadu_si512(qv + 32 * r);
  const float block_max = block_scores([&](int64_t t) {
    const uint16_t* k = kb + t * k_stride;
    __m512 prod = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
    for (int r = 1; r < QR; ++r) prod = _mm512_dpbf16_ps(prod, q[r], (__m512bh)_mm512_loadu_si512(k + 32 * r));
    return prod;
  }, visible, scale, sc);
  const float new_max = std::max(*row_max, block_max);
  const float correction = rescale_factor(*row_max, new_max);
  const float sum = exp_shifted(sc, visible, new_max);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * r), _mm512_set1_ps(correction));
  for (int64_t t0 = 0; t0 < visible; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, visible - t0);
    alignas(32) uint32_t weight_pairs[8];  // (p[2j], p[2j+1]) as bf16, zero past `visible`
    const __mmask16 live = count == 16 ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(weight_pairs),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, sc + t0)));
    const uint32_t* pairs = v_pairs + (t0 / 2) * D;
    for (int64_t j = 0; 2 * j < count; ++j) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[j]));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_loadu_si512(pairs + j * D + 16 * r));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(a + 16 * r, acc[r]);
  *row_sum = *row_sum * correction + sum;
  *row_max = new_max;
}
#endif
#endif

// Whether block_update_bf16 serves this storage type and head size.
template <typename T>
constexpr bool bf16_dot(int64_t head_dim) {
#ifdef __AVX512BF16__
  return std::is_same_v<T, uint16_t> && (head_dim == 32 || head_dim == 64 || head_dim == 128);
#else
  (void)head_dim;
  return false;
#endif
}

inline void v_pairs_q16(int64_t head_dim, const uint16_t* v, int64_t stride, int64_t slots, uint32_t* out) {
#ifdef __AVX512BF16__
  switch (head_dim) {
    case 64: return build_v_pairs<64>(v, stride, slots, out);
    case 128: return build_v_pairs<128>(v, stride, slots, out);
    case 32: return build_v_pairs<32>(v, stride, slots, out);
    default: break;
  }
#endif
  (void)v; (void)stride; (void)slots; (void)out;
  std::abort();  // callers check bf16_dot first
}

inline void block_update_q16(int64_t head_dim, const uint16_t* qv, float scale, const uint16_t* kb,
                             int64_t k_stride, const uint32_t* v_pairs, int64_t visible,
                             float* a, float* row_max, float* row_sum, float* sc) {
#ifdef __AVX512BF16__
  switch (head_dim) {
    case 64: return block_update_bf16<64>(qv, scale, kb, k_stride, v_pairs, visible, a, row_max, row_sum, sc);
    case 128: return block_update_bf16<128>(qv, scale, kb, k_stride, v_pairs, visible, a, row_max, row_sum, sc);
    case 32: return block_update_bf16<32>(qv, scale, kb, k_stride, v_pairs, visible, a, row_max, row_sum, sc);
    default: break;
  }
#endif
  (void)qv; (void)scale; (void)kb; (void)k_stride; (void)v_pairs;
  (void)visible; (void)a; (void)row_max; (void)row_sum; (void)sc;
  std::abort();  // callers check bf16_dot first
}

inline void block_update(int64_t head_dim, const float* qv, const float* kb, const float* vb,
                         int64_t stride, int64_t visible, float* a, float* row_max,
                         float* row_sum, float* sc) {
#ifdef __AVX512F__
  switch (head_dim) {
    case 64: return block_update_fixed<64>(qv, kb, vb, stride, visible, a, row_max, row_sum, sc);
    case 128: return block_update_fixed<128>(qv, kb, vb, stride, visible, a, row_max, row_sum, sc);
    case 32: return block_update_fixed<32>(qv, kb, vb, stride, visible, a, row_max, row_sum, sc);
    default: break;
  }
#endif
  block_update_generic(head_dim, qv, kb, vb, stride, visible, a, row_max, row_sum, sc);
}

template <typename T>
void attend(const T* q, T* out, const T* k_cache, const T* v_cache,
            const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
            const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
            int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const bool use_bf16_dot = bf16_dot<T>(head_dim);
  const int64_t slot_stride = num_kv_heads * head_dim;  // one token slot: all kv heads
  const int64_t block_stride = block_size * slot_stride;
  // Work items: (seq, first query row, first kv head, kv heads). An item normally takes
  // every kv head, so a block is one contiguous read; with too few items to keep the
  // threads busy (few long sequences) it is split by kv head instead.
  int64_t num_tiles = 0;
  for (int64_t s = 0; s < num_seqs; ++s) num_tiles += (query_lens[s] + TILE - 1) / TILE;
  const int64_t heads_per_item = num_tiles >= 2 * num_threads ? num_kv_heads : 1;
  std::vector<int64_t> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = 0; r < query_lens[s]; r += TILE)
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item) {
        items.push_back(s); items.push_back(r); items.push_back(h);
      }
  const int64_t num_items = static_cast<int64_t>(items.size() / 3);
  const int64_t max_vecs = TILE * heads_per_item * group;

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> kbuf(use_bf16_dot ? 0 : block_stride), vbuf(use_bf16_dot ? 0 : block_stride);
    std::vector<float> qbuf(max_vecs * head_dim), acc(max_vecs * head_dim);
    std::vector<float> row_max(max_vecs), row_sum(max_vecs), scores(block_size);
    std::vector<uint32_t> v_pairs(use_bf16_dot ? (block_size + 1) / 2 * head_dim : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t s = items[3 * item], r0 = items[3 * item + 1], kv0 = items[3 * item + 2];
      const int64_t q_len = query_lens[s];
      const int64_t seq_len = seq_lens[s];
      const int64_t rows = std::min<int64_t>(TILE, q_len - r0);
      const int64_t heads = heads_per_item * group;  // query heads of this item
      const int64_t vecs = rows * heads;             // vector m = row m / heads, head m % heads
      // Query row r sits at absolute position seq_len - q_len + r and sees keys <= it.
      const int64_t first_pos = seq_len - q_len + r0;
      const int64_t last_key = first_pos + rows;  // exclusive bound on keys any row sees
      for (int64_t r = 0; r < rows && !use_bf16_dot; ++r)  // the bf16 path reads q as stored
        for (int64_t h = 0; h < heads; ++h) {
          const T* src = q + ((query_start[s] + r0 + r) * num_heads + kv0 * group + h) * head_dim;
          float* dst = &qbuf[(r * heads + h) * head_dim];
          load_row(src, dst, head_dim);
          scale_row(dst, scale, head_dim);
        }
      std::fill(acc.begin(), acc.begin() + vecs * head_dim, 0.0f);
      std::fill(row_max.begin(), row_max.begin() + vecs, -INFINITY);
      std::fill(row_sum.begin(), row_sum.begin() + vecs, 0.0f);
      const int32_t* table = block_tables + s * max_blocks;
      const int64_t num_blocks = (last_key + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t base_pos = b * block_size;
        const int64_t slots = std::min<int64_t>(block_size, last_key - base_pos);
        const T* kb = k_cache + table[b] * block_stride + kv0 * head_dim;
        const T* vb = v_cache + table[b] * block_stride + kv0 * head_dim;
        if (b + PREFETCH_BLOCKS < num_blocks) {
          // Blocks are scattered in the pool: fetch ahead while this one computes.
          const int64_t ahead = table[b + PREFETCH_BLOCKS];
          const char* next_k = reinterpret_cast<const char*>(k_cache + ahead * block_stride + kv0 * head_dim);
          const char* next_v = reinterpret_cast<const char*>(v_cache + ahead * block_stride + kv0 * head_dim);
          const int64_t bytes = block_stride * static_cast<int64_t>(sizeof(T));
          for (int64_t off = 0; off < bytes; off += 64) {
            __builtin_prefetch(next_k + off);
            __builtin_prefetch(next_v + off);
          }
        }
        // One kv head at a time: its K/V rows are converted to float once and shared by
        // the query heads of its group (x the item's query rows); the float copy stays
        // small enough (2 x block_size x head_dim) to live in L1.
        for (int64_t kh = 0; kh < heads_per_item; ++kh) {
          if constexpr (std::is_same_v<T, uint16_t>) {
            if (use_bf16_dot) v_pairs_q16(head_dim, vb + kh * head_dim, slot_stride, slots, v_pairs.data());
          }
          for (int64_t t = 0; t < slots && !use_bf16_dot; ++t) {
            load_row(kb + t * slot_stride + kh * head_dim, &kbuf[t * head_dim], head_dim);
            load_row(vb + t * slot_stride + kh * head_dim, &vbuf[t * head_dim], head_dim);
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t visible = std::min<int64_t>(slots, first_pos + r + 1 - base_pos);
            if (visible <= 0) continue;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t m = r * heads + kh * group + g;
              if constexpr (std::is_same_v<T, uint16_t>) {
                if (use_bf16_dot) {  // K straight from the cache, the query as stored
                  const T* qv = q + ((query_start[s] + r0 + r) * num_heads + kv0 * group + kh * group + g) * head_dim;
                  block_update_q16(head_dim, qv, scale, kb + kh * head_dim, slot_stride, v_pairs.data(),
                                   visible, &acc[m * head_dim], &row_max[m], &row_sum[m], scores.data());
                  continue;
                }
              }
              block_update(head_dim, &qbuf[m * head_dim], kbuf.data(), vbuf.data(), head_dim, visible,
                           &acc[m * head_dim], &row_max[m], &row_sum[m], scores.data());
            }
          }
        }
      }
      for (int64_t m = 0; m < vecs; ++m) {
        const float inv = 1.0f / row_sum[m];
        T* dst = out + ((query_start[s] + r0 + m / heads) * num_heads + kv0 * group + m % heads) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) from_float(acc[m * head_dim + d] * inv, dst + d);
      }
    }
  }
}

}  // namespace

extern "C" {

#define KVLOOM_ARGS(T)                                                                       \
  const T *q, T *out, const T *k_cache, const T *v_cache, const int32_t *block_tables,       \
      int64_t max_blocks, const int32_t *seq_lens, const int32_t *query_start,               \
      const int32_t *query_lens,                                                             \
      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,           \
      int64_t block_size, float scale, int num_threads
#define KVLOOM_CALL                                                                          \
  attend(q, out, k_cache, v_cache, block_tables, max_blocks, seq_lens, query_start, query_lens, \
         num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads)

void kvloom_paged_attention_f32(KVLOOM_ARGS(float)) { KVLOOM_CALL; }
void kvloom_paged_attention_bf16(KVLOOM_ARGS(uint16_t)) { KVLOOM_CALL; }

}
