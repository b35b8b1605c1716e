// Paged attention for CPUs: reads K/V straight through the block table (no gather).
//
// One work item = (sequence, query tile of up to TILE rows, kv heads). Two paths:
// - paired layout (bf16 on a CPU with AVX2 or AVX-512; paired.h, attend_paired): the
//   cache is arranged so that both dot products run on vdpbf16ps (or two FMAs that are
//   its arithmetic: AVX-512 without AVX512-BF16, and AVX2 in paired_avx2.h) from
//   registers loaded straight out of the block, with row groups of query vectors
//   sharing every load and the flash-attention state (max, sum, accumulator) in
//   registers (in L1 on AVX2), or on AMX tiles;
// - token-major layout (float storage, or bf16 elsewhere; see attend): K/V rows are
//   converted to float once per block and kv head and shared by the group's query
//   heads and the tile's rows, flash-attention style per block.
// Accumulation is float32 whatever the storage type. Plain C ABI (called through
// ctypes) so that building needs no torch headers and takes about a second.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <array>
#include <utility>  // std::make_integer_sequence (the group table)
#include <cstdlib>
#include <type_traits>
#include <atomic>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "amx.h"
#include "paired.h"
#include "paired_avx2.h"
#include "simd.h"

namespace {

using namespace kvloom_paired;

constexpr int TILE = 16;

using kvloom_simd::from_float;
#ifdef KVLOOM_AVX512
using kvloom_simd::sum16;
#endif
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
                                 float* row_sum, float* sc, float softcap) {
  float block_max = -INFINITY;
  for (int64_t t = 0; t < visible; ++t) sc[t] = dot(qv, kb + t * stride, head_dim);
  if (softcap > 0) soft_cap(sc, visible, softcap);
  for (int64_t t = 0; t < visible; ++t) block_max = std::max(block_max, sc[t]);
  const float new_max = std::max(*row_max, block_max);
  const float correction = rescale_factor(*row_max, new_max);
  scale_row(a, correction, head_dim);
  const float sum = exp_shifted(sc, visible, new_max);
  for (int64_t t = 0; t < visible; ++t) scale_add(a, vb + t * stride, sc[t], head_dim);
  *row_max = new_max;
  *row_sum = *row_sum * correction + sum;
}

#ifdef __AVX512F__
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
                               int64_t visible, float* a, float* row_max, float* row_sum, float* sc,
                               float softcap) {
  constexpr int R = D / 16;
  __m512 q[R];
  for (int r = 0; r < R; ++r) q[r] = _mm512_loadu_ps(qv + 16 * r);
  float block_max = block_scores([&](int64_t t) {
    const float* k = kb + t * stride;
    __m512 prod = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
    for (int r = 1; r < R; ++r) prod = _mm512_fmadd_ps(q[r], _mm512_loadu_ps(k + 16 * r), prod);
    return prod;
  }, visible, 1.0f, sc);  // the query is pre-scaled
  if (softcap > 0) {
    soft_cap(sc, visible, softcap);
    block_max = *std::max_element(sc, sc + visible);
  }
  softmax_accumulate<D>(vb, stride, visible, block_max, a, row_max, row_sum, sc);
}

#endif

inline void block_update(int64_t head_dim, const float* qv, const float* kb, const float* vb,
                         int64_t stride, int64_t visible, float* a, float* row_max,
                         float* row_sum, float* sc, float softcap) {
#ifdef __AVX512F__
  switch (head_dim) {
    case 64: return block_update_fixed<64>(qv, kb, vb, stride, visible, a, row_max, row_sum, sc, softcap);
    case 128: return block_update_fixed<128>(qv, kb, vb, stride, visible, a, row_max, row_sum, sc, softcap);
    case 32: return block_update_fixed<32>(qv, kb, vb, stride, visible, a, row_max, row_sum, sc, softcap);
    default: break;
  }
#endif
  block_update_generic(head_dim, qv, kb, vb, stride, visible, a, row_max, row_sum, sc, softcap);
}

// Work items: (seq, first query row, first kv head), TILE query rows each. An item
// normally takes every kv head, so a block is one contiguous read; it is split by kv
// head instead where whole items cannot keep the threads evenly busy: too few of them
// (few long sequences), or one costing more than a thread's share of the call (the
// last long contexts of a decode batch, e.g. 200 x 4 and 2,000: 3.0 -> 2.8 ms, 30
// layers on AMD EPYC model 17, docs/results/issue17/genoa4/attention_longest_first.txt).
//
// Longest walk first. The threads take items as they free up (schedule(dynamic)), so
// an expensive item taken last leaves the others waiting for it: a decode batch's one
// long context, or a prompt's last query tiles, which see the most keys, were last in
// batch order. The order changes no result (items are independent).
struct WorkItems {
  std::vector<int64_t> items;  // 3 per item
  int64_t heads_per_item;
  int64_t size() const { return static_cast<int64_t>(items.size() / 3); }
};

// shared_blocks: per sequence, the blocks another walk covers (the cascade's), or nullptr.
inline WorkItems make_items(const int32_t* query_lens, const int32_t* seq_lens, const int64_t* shared_blocks,
                            int64_t block_size, int64_t num_seqs, int64_t num_kv_heads, int num_threads) {
  struct Tile { int64_t cost, seq, row; };  // cost: query rows x the keys they see
  std::vector<Tile> tiles;
  int64_t total = 0, largest = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = 0; r < query_lens[s]; r += TILE) {
      const int64_t rows = std::min<int64_t>(TILE, query_lens[s] - r);
      const int64_t skipped = shared_blocks ? shared_blocks[s] * block_size : 0;
      const int64_t cost = rows * (seq_lens[s] - query_lens[s] + r + (rows + 1) / 2 - skipped);
      tiles.push_back({cost, s, r});
      total += cost;
      largest = std::max(largest, cost);
    }
  WorkItems work;
  const bool split = static_cast<int64_t>(tiles.size()) < 2 * num_threads || largest * num_threads > total;
  work.heads_per_item = split ? 1 : num_kv_heads;
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  work.items.reserve(tiles.size() * 3 * (num_kv_heads / work.heads_per_item));
  for (const Tile& tile : tiles)
    for (int64_t h = 0; h < num_kv_heads; h += work.heads_per_item) {
      work.items.push_back(tile.seq); work.items.push_back(tile.row); work.items.push_back(h);
    }
  return work;
}

// Token-major layout: a block is [block_size][kv_heads][head_dim], the layout every
// backend but the paired one uses (attention/base.py). Float storage, or bf16 where
// the paired layout does not apply; K/V rows are converted to float once per block
// and kv head and shared by the group's query heads and the item's query rows.
template <typename T>
void attend(const T* q, T* out, const T* k_cache, const T* v_cache,
            const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
            const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
            float softcap, const float* sinks, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // one token slot: all kv heads
  const int64_t block_stride = block_size * slot_stride;
  const WorkItems work = make_items(query_lens, seq_lens, nullptr, block_size, num_seqs, num_kv_heads, num_threads);
  const int64_t heads_per_item = work.heads_per_item;
  const int64_t max_vecs = TILE * heads_per_item * group;

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> kbuf(block_stride), vbuf(block_stride);
    std::vector<float> qbuf(max_vecs * head_dim), acc(max_vecs * head_dim);
    std::vector<float> row_max(max_vecs), row_sum(max_vecs), scores(block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work.size(); ++item) {
      const int64_t s = work.items[3 * item], r0 = work.items[3 * item + 1], kv0 = work.items[3 * item + 2];
      const int64_t q_len = query_lens[s];
      const int64_t seq_len = seq_lens[s];
      const int64_t rows = std::min<int64_t>(TILE, q_len - r0);
      const int64_t heads = heads_per_item * group;  // query heads of this item
      const int64_t vecs = rows * heads;             // vector m = row m / heads, head m % heads
      // Query row r sits at absolute position seq_len - q_len + r and sees keys <= it
      // (under a sliding window, only the last `window` of them).
      const int64_t first_pos = seq_len - q_len + r0;
      const int64_t last_key = first_pos + rows;  // exclusive bound on keys any row sees
      const auto first_key = [&](int64_t r) {
        return window > 0 ? std::max<int64_t>(0, first_pos + r + 1 - window) : 0;
      };
      for (int64_t r = 0; r < rows; ++r)
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
      // Blocks wholly before row 0's first key are seen by no row (row 0's is the earliest).
      for (int64_t b = first_key(0) / block_size; b < num_blocks; ++b) {
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
          for (int64_t t = 0; t < slots; ++t) {
            load_row(kb + t * slot_stride + kh * head_dim, &kbuf[t * head_dim], head_dim);
            load_row(vb + t * slot_stride + kh * head_dim, &vbuf[t * head_dim], head_dim);
          }
          for (int64_t r = 0; r < rows; ++r) {
            // The row's keys in this block: slots [skip, visible), the same whatever step
            // the row is computed in (blocks sit at absolute positions).
            const int64_t visible = std::min<int64_t>(slots, first_pos + r + 1 - base_pos);
            const int64_t skip = std::max<int64_t>(0, first_key(r) - base_pos);
            if (visible <= skip) continue;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t m = r * heads + kh * group + g;
              block_update(head_dim, &qbuf[m * head_dim], &kbuf[skip * head_dim], &vbuf[skip * head_dim], head_dim,
                           visible - skip, &acc[m * head_dim], &row_max[m], &row_sum[m], scores.data(), softcap);
            }
          }
        }
      }
      for (int64_t m = 0; m < vecs; ++m) {
        const int64_t head = kv0 * group + m % heads;
        // The head's sink joins the denominator in row_sum's units (exp of the scaled score
        // less the running max). Never an empty row: a query sees at least its own key.
        const float total = sinks ? row_sum[m] + std::exp(sinks[head] - row_max[m]) : row_sum[m];
        const float inv = 1.0f / total;
        T* dst = out + ((query_start[s] + r0 + m / heads) * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) from_float(acc[m * head_dim + d] * inv, dst + d);
      }
    }
  }
}

// ---------------------------------------------------------------------------------
// Paired layout (paired.h): bf16 storage, block_size a multiple of 16, head_dim
// 32/64/128/256, on a CPU with AVX2 or AVX-512. The AVX-512 paths below keep a group's
// whole state in registers; AVX2's (paired_avx2.h) keeps the accumulators in L1.
#if defined(KVLOOM_AVX512) || defined(KVLOOM_AVX2)
#define KVLOOM_PAIRED 1

// The paired layout's paths, worst to best (kvloom/kernels/paged_attention.py's
// PAIRED_ISAS): one for the whole process, chosen by kvloom_paired_attention_isa.
enum PairedPath : int { PAIRED_AVX2 = 0, PAIRED_AVX512 = 1, PAIRED_BF16 = 2, PAIRED_AMX = 3 };

inline bool paired_supported(int64_t head_dim, int64_t block_size) {
  return (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256) && block_size % 16 == 0;
}

#ifdef KVLOOM_AVX512
// PairsBf16 (vdpbf16ps) and PairsFma (its arithmetic as two FMAs, for AVX-512 CPUs
// without AVX512-BF16, as paired.h describes), each doing a split of the loaded
// register where it needs one. Tests hold every path to the float32 reference
// (tests/attention/conftest.py's paired_path). Keys: 16 loaded words; Pair: one word,
// broadcast.
#ifdef __AVX512BF16__
struct PairsBf16 {
  using Keys = __m512i;
  using Pair = uint32_t;
  static Keys load(const uint32_t* words) { return _mm512_loadu_si512(words); }
  static __m512 dot(__m512 acc, Keys a, Pair b) {
    // The broadcast last, so it folds into the instruction as a {1to16} operand.
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32(static_cast<int>(b)));
  }
  static void query(const uint16_t* q, int64_t head_dim, Pair* out) { std::memcpy(out, q, head_dim * 2); }
  // 16 probabilities as 8 words of two bf16 (out 32-byte aligned).
  static void probabilities(__m512 e, Pair* out) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(e));
  }
};
#endif

struct PairsFma {
  struct Keys { __m512 hi, lo; };
  struct Pair { float lo, hi; };  // a word's two bf16 as floats, in memory order
  static Keys load(const uint32_t* words) {
    const __m512i w = _mm512_loadu_si512(words);
    return {_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))),
            _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static __m512 dot(__m512 acc, const Keys& a, const Pair& b) {
    return _mm512_fmadd_ps(a.lo, _mm512_set1_ps(b.lo), _mm512_fmadd_ps(a.hi, _mm512_set1_ps(b.hi), acc));
  }
  static void query(const uint16_t* q, int64_t head_dim, Pair* out) {
    for (int64_t i = 0; i < head_dim / 2; ++i) out[i] = {to_float(q[2 * i]), to_float(q[2 * i + 1])};
  }
  // 16 probabilities rounded to bf16 (vcvtneps2bf16's rounding), kept as floats (out
  // 64-byte aligned: 8 pairs).
  static void probabilities(__m512 e, Pair* out) {
    _mm512_store_ps(&out[0].lo, _mm512_castsi512_ps(kvloom_simd::bf16_bits(e)));
  }
};

// max(row_max, the live scores): one compare where no live score passes the running
// max (after the first blocks, nearly always), the full reduction only where one does.
// Scaled scores softcapped where the model asks (Gemma 2; cap 0: as they are).
inline __m512 capped(__m512 scores, float cap) {
  if (cap <= 0) return scores;
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, scores);
  soft_cap(lanes, 16, cap);
  return _mm512_load_ps(lanes);
}

inline float running_max(float row_max, __m512 scores, __mmask16 live) {
  if (!_mm512_mask_cmp_ps_mask(live, scores, _mm512_set1_ps(row_max), _CMP_GT_OQ)) return row_max;
  return std::max(row_max, _mm512_mask_reduce_max_ps(live, scores));
}

// The row group (query vectors sharing every K/V load): G x head_dim / 16 accumulators
// plus 2G scores and G running sums. Past what fits the 32 vector registers outright
// (4, 4 and 2 at head_dim 32, 64 and 128) the compiler keeps a few in memory, and each K
// and V load serves more vectors: prompt attention, one process alternating builds on AMD
// EPYC model 17 (docs/results/issue17/attention_ab.py; docs/results/issue17/genoa8/
// prompt_groups.txt), 8 x 256 and 2 x 1,000, on vdpbf16ps and on AVX-512 fma:
//   head_dim 64:  6 against 4  1.075-1.095x, 1.030-1.037x; fma 1.060x, 1.045x (3: 12%
//                 slower, 8: no faster than 4)
//   head_dim 32:  8 against 4  1.185x, 1.168x (6: 1.137x, 1.101x); fma 1.117x, 1.050x
//   head_dim 128: 4 against 2  1.281x, 1.352x (3: 1.198x, 1.298x; 6: no faster than 2);
//                 fma 1.133x, 1.110x
// Decode (a row's query heads of one kv head) changes only where they were more than
// the old group. A vector's arithmetic does not depend on G, so no result changes.
// head_dim 256 (Gemma's): one vector's 16 accumulators fill half the registers; two
// would spill every step.
constexpr int max_group(int head_dim) {
  return head_dim == 256 ? 1 : head_dim == 128 ? 4 : head_dim == 64 ? 6 : 8;
}

// G query vectors (same kv head; the same sequence, or sequences whose block tables
// agree over the range) against the keys, flash-attention style with the whole state
// in registers: per 16 keys, scores -> running max -> rescale -> exp -> weighted V.
// limit[g] is the number of keys vector g sees (a prefix of the sequence: causal
// within the query tile). A vector's arithmetic does not depend on the others in its
// group, nor on G.
template <class Pairs, int D, int G>
void attend_group_paired(const KeySource& src, const uint16_t* const* q, const int64_t* limit,
                         uint16_t* const* out, const BlockRange& range) {
  const uint16_t *k_cache = src.k_cache, *v_cache = src.v_cache;
  const int64_t block_size = src.block_size;
  constexpr int P = D / 2;   // dim pairs: vdpbf16ps steps per 16 scores
  constexpr int R = D / 16;  // float32 registers per accumulator row
  __m512 acc[G][R], sum[G];
  float row_max[G];
  int64_t max_limit = 0, min_first = INT64_MAX, first_key[G];
  for (int g = 0; g < G; ++g) {
    first_key[g] = src.first_key(limit[g]);
    min_first = std::min(min_first, first_key[g]);
    if (range.resume) {
      const PairedState& st = *range.resume[g];
      for (int r = 0; r < R; ++r) acc[g][r] = _mm512_load_ps(st.acc + 16 * r);
      sum[g] = _mm512_load_ps(st.sum);
      row_max[g] = st.row_max;
    } else {
      for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
      sum[g] = _mm512_setzero_ps();  // per-lane partial sums; reduced once at the end
      row_max[g] = -INFINITY;
    }
    max_limit = std::max(max_limit, limit[g]);
  }
  const __m512 scale_v = _mm512_set1_ps(src.scale);
  typename Pairs::Pair query[G][P];
  for (int g = 0; g < G; ++g) Pairs::query(q[g], D, query[g]);
  const int64_t num_blocks = range.end >= 0 ? range.end : (max_limit + block_size - 1) / block_size;
  // The blocks ahead, a K line and a V line per dim pair of QK^T: P steps per 16 keys
  // are the lines of 16 keys of K and of V (paired.h, LineFeed).
  // Tiles of 16 keys, u = 0, 1, ... from the range's first block; those past every
  // vector's limit, or before every vector's first key, are skipped.
  const int64_t per_block = block_size / 16;
  const int64_t first = std::max(range.begin * per_block, min_first / 16);
  LineFeed feed;
  feed.bytes = block_size * D * 2;
  feed.prime(src, first / per_block, num_blocks);
  const int64_t last = std::min(num_blocks * per_block, (max_limit + 15) / 16);
  // Scores of N tiles at once (N = 2 but for an odd last one): each tile's sums are
  // chains of P dependent dot products, so two tiles give the core twice the
  // independent chains to overlap (one tile's G chains leave it waiting on latency).
  // Each tile's arithmetic is as if it were alone.
  __m512 s[2][G];
  const auto scores = [&](auto n, int64_t u) __attribute__((always_inline)) {
    constexpr int N = decltype(n)::value;
    const uint32_t* kt[N];
    for (int i = 0; i < N; ++i) {
      if ((u + i) % per_block == 0) feed.add(src, (u + i) / per_block, num_blocks);  // scattered: fetch ahead
      // Tile u + i's first K word: its block's dim-pair rows, 16 keys in (the K layout).
      kt[i] = reinterpret_cast<const uint32_t*>(k_cache + src.block_offset((u + i) / per_block)) + (u + i) % per_block * 16;
      for (int g = 0; g < G; ++g) s[i][g] = _mm512_setzero_ps();
    }
    for (int p = 0; p < P; ++p)
      for (int i = 0; i < N; ++i) {
        feed.step();
        const auto keys = Pairs::load(kt[i] + p * block_size);
        for (int g = 0; g < G; ++g) s[i][g] = Pairs::dot(s[i][g], keys, query[g][p]);
      }
  };
  // Tile u's online-softmax update from its scores sc, then its weighted V rows.
  const auto accumulate = [&](const __m512* sc, int64_t u) __attribute__((always_inline)) {
    const int64_t base = u * 16;  // position of the tile's first key
    alignas(64) typename Pairs::Pair weights[G][8];  // probabilities as bf16 token pairs
    for (int g = 0; g < G; ++g) {
      __mmask16 live = kvloom_simd::lanes(std::max<int64_t>(0, limit[g] - base));
      if (first_key[g] > base) live &= ~kvloom_simd::lanes(first_key[g] - base);  // the window's first tile
      __m512 e = _mm512_setzero_ps();
      if (live) {
        const __m512 scaled = capped(_mm512_mul_ps(sc[g], scale_v), src.softcap);
        const float new_max = running_max(row_max[g], scaled, live);
        if (new_max != row_max[g]) {  // rescale what was accumulated under the old max
          const __m512 correction = _mm512_set1_ps(std::exp(row_max[g] - new_max));
          for (int r = 0; r < R; ++r) acc[g][r] = _mm512_mul_ps(acc[g][r], correction);
          sum[g] = _mm512_mul_ps(sum[g], correction);
          row_max[g] = new_max;
        }
        e = _mm512_maskz_mov_ps(live, kvloom_simd::exp16(_mm512_sub_ps(scaled, _mm512_set1_ps(new_max))));
        sum[g] = _mm512_add_ps(sum[g], e);
      }
      Pairs::probabilities(e, weights[g]);
    }
    // Tile u's token pairs: 8 rows of D words (the V layout, paired.h).
    const uint32_t* vt = reinterpret_cast<const uint32_t*>(v_cache + src.block_offset(u / per_block))
                         + (u % per_block) * 8 * D;
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < R; ++r) {
        const auto values = Pairs::load(vt + j * D + 16 * r);
        for (int g = 0; g < G; ++g) acc[g][r] = Pairs::dot(acc[g][r], values, weights[g][j]);
      }
  };
  int64_t u = first;
  for (; u + 1 < last; u += 2) {
    scores(std::integral_constant<int, 2>{}, u);
    accumulate(s[0], u);
    accumulate(s[1], u + 1);
  }
  if (u < last) {
    scores(std::integral_constant<int, 1>{}, u);
    accumulate(s[0], u);
  }
  for (int g = 0; g < G; ++g) {
    if (range.suspend) {
      PairedState& st = *range.suspend[g];
      for (int r = 0; r < R; ++r) _mm512_store_ps(st.acc + 16 * r, acc[g][r]);
      _mm512_store_ps(st.sum, sum[g]);
      st.row_max = row_max[g];
      continue;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum[g]));
    for (int r = 0; r < R; ++r) kvloom_simd::store16(out[g] + 16 * r, _mm512_mul_ps(acc[g][r], inv), 16);
  }
}

// attend_group_paired<Pairs, D, G> for G = 1 .. max_group(D), indexed by G - 1.
using GroupFn = void (*)(const KeySource&, const uint16_t* const*, const int64_t*, uint16_t* const*,
                         const BlockRange&);
template <class Pairs, int D, int... G>
constexpr std::array<GroupFn, sizeof...(G)> group_table(std::integer_sequence<int, G...>) {
  return {&attend_group_paired<Pairs, D, G + 1>...};
}

template <class Pairs, int D>
void attend_group_dispatch(const KeySource& src, int64_t count, const uint16_t* const* q, const int64_t* limit,
                           uint16_t* const* out, const BlockRange& range) {
  static constexpr auto table = group_table<Pairs, D>(std::make_integer_sequence<int, max_group(D)>());
  if (count < 1 || count > max_group(D)) std::abort();  // callers never pass more than max_group(D)
  table[count - 1](src, q, limit, out, range);
}


// ---- AMX: up to 16 query vectors against the keys, the dot products as tiles ------
// Where the CPU has AMX (and Linux grants its state), every paired-layout call takes
// this path instead of the vector one, so that a query's result never depends on
// which path served it (AMX's tdpbf16ps rounds its pair products differently from
// vdpbf16ps: the two agree to rounding, not bit for bit). Per 16 keys: S = Q K^T as
// one tile product per 32 dims (the K block's rows are a B tile as they lie), the
// softmax of the vector path on S's rows, then acc += P V as one tile product per 16
// dims (the V block's token-pair rows are a B tile). Rows are independent in every
// tile operation, so a vector's result does not depend on the others in its group.
// Tiles: 0 S (16 x 16 float), 1 an accumulator slice (16 x 16 float), 2 queries
// (16 x 32 bf16), 3 keys (16 dim pairs x 16 keys), 4 probabilities (16 x 8 key
// pairs), 5 values (8 key pairs x 16 dims).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVLOOM_PAIRED_AMX 1

constexpr int AMX_VECTORS = 16;

void amx_configure() {  // per thread, before its first tile instruction of a call
  kvloom_amx::TileConfig config;
  const int rows[6] = {16, 16, 16, 16, 16, 8}, colsb[6] = {64, 64, 64, 64, 32, 64};
  for (int t = 0; t < 6; ++t) config.set(t, rows[t], colsb[t]);
  _tile_loadconfig(&config);
}

template <int D>
void attend_group_amx(const KeySource& src, int64_t count, const uint16_t* const* q, const int64_t* limit,
                      uint16_t* const* out, const BlockRange& range) {
  constexpr int R = D / 16;  // accumulator slices
  constexpr int C = D / 32;  // query tiles
  const int64_t block_size = src.block_size;
  alignas(64) uint16_t queries[AMX_VECTORS * D] = {};  // rows past count stay zero
  alignas(64) float acc[AMX_VECTORS * D] = {};
  alignas(64) float sums[AMX_VECTORS * 16];
  alignas(64) float scores[AMX_VECTORS * 16];
  alignas(64) uint16_t probs[AMX_VECTORS * 16] = {};
  float row_max[AMX_VECTORS];
  int64_t max_limit = 0, min_first = INT64_MAX, first_key[AMX_VECTORS];
  for (int64_t g = 0; g < count; ++g) {
    first_key[g] = src.first_key(limit[g]);
    min_first = std::min(min_first, first_key[g]);
    std::memcpy(queries + g * D, q[g], D * sizeof(uint16_t));
    if (range.resume) {
      const PairedState& st = *range.resume[g];
      std::memcpy(acc + g * D, st.acc, D * sizeof(float));
      std::memcpy(sums + g * 16, st.sum, sizeof(st.sum));
      row_max[g] = st.row_max;
    } else {
      std::memset(sums + g * 16, 0, 16 * sizeof(float));
      row_max[g] = -INFINITY;
    }
    max_limit = std::max(max_limit, limit[g]);
  }
  const __m512 scale_v = _mm512_set1_ps(src.scale);
  const int64_t num_blocks = range.end >= 0 ? range.end : (max_limit + block_size - 1) / block_size;
  // The blocks ahead, two K lines and two V lines per vector's softmax and one of each
  // per accumulator slice (paired.h, LineFeed): 16 keys of K and of V are D / 2 lines
  // each, 2 * count + R steps.
  const int64_t begin = std::max(range.begin, min_first / block_size);  // blocks before every first key: skipped
  LineFeed feed;
  feed.bytes = block_size * D * 2;
  feed.prime(src, begin, num_blocks);
  for (int64_t b = begin; b < num_blocks; ++b) {
    const uint32_t* kb = reinterpret_cast<const uint32_t*>(src.k_cache + src.block_offset(b));
    const uint32_t* vb = reinterpret_cast<const uint32_t*>(src.v_cache + src.block_offset(b));
    feed.add(src, b, num_blocks);  // blocks are scattered: fetch ahead
    for (int64_t t0 = 0; t0 < block_size; t0 += 16) {
      const int64_t base = b * block_size + t0;
      if (base >= max_limit) break;
      if (base + 16 <= min_first) continue;
      _tile_zero(0);
      for (int c = 0; c < C; ++c) {
        _tile_loadd(2, queries + 32 * c, D * 2);
        _tile_loadd(3, kb + 16 * c * block_size + t0, block_size * 4);
        _tile_dpbf16ps(0, 2, 3);
      }
      _tile_stored(0, scores, 64);
      for (int64_t g = 0; g < count; ++g) {
        feed.step();
        feed.step();
        __mmask16 live = kvloom_simd::lanes(std::max<int64_t>(0, limit[g] - base));
        if (first_key[g] > base) live &= ~kvloom_simd::lanes(first_key[g] - base);  // the window's first tile
        __m512 e = _mm512_setzero_ps();
        if (live) {
          const __m512 s = capped(_mm512_mul_ps(_mm512_load_ps(scores + 16 * g), scale_v), src.softcap);
          const float new_max = running_max(row_max[g], s, live);
          __m512 sum = _mm512_load_ps(sums + 16 * g);
          if (new_max != row_max[g]) {  // rescale what was accumulated under the old max
            const __m512 correction = _mm512_set1_ps(std::exp(row_max[g] - new_max));
            for (int r = 0; r < R; ++r)
              _mm512_store_ps(acc + g * D + 16 * r, _mm512_mul_ps(_mm512_load_ps(acc + g * D + 16 * r), correction));
            sum = _mm512_mul_ps(sum, correction);
            row_max[g] = new_max;
          }
          e = _mm512_maskz_mov_ps(live, kvloom_simd::exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
          _mm512_store_ps(sums + 16 * g, _mm512_add_ps(sum, e));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(probs + 16 * g), (__m256i)_mm512_cvtneps_pbh(e));
      }
      _tile_loadd(4, probs, 32);
      const uint32_t* pairs = vb + (t0 / 2) * D;
      for (int r = 0; r < R; ++r) {
        feed.step();
        _tile_loadd(1, acc + 16 * r, D * 4);
        _tile_loadd(5, pairs + 16 * r, D * 4);
        _tile_dpbf16ps(1, 4, 5);
        _tile_stored(1, acc + 16 * r, D * 4);
      }
    }
  }
  for (int64_t g = 0; g < count; ++g) {
    if (range.suspend) {
      PairedState& st = *range.suspend[g];
      std::memcpy(st.acc, acc + g * D, D * sizeof(float));
      std::memcpy(st.sum, sums + g * 16, sizeof(st.sum));
      st.row_max = row_max[g];
      continue;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(sums + 16 * g)));
    for (int r = 0; r < R; ++r)
      kvloom_simd::store16(out[g] + 16 * r, _mm512_mul_ps(_mm512_load_ps(acc + g * D + 16 * r), inv), 16);
  }
}
#endif  // AMX

template <class Pairs>
void attend_group_vector(int64_t head_dim, const KeySource& src, int64_t count, const uint16_t* const* q,
                         const int64_t* limit, uint16_t* const* out, const BlockRange& range) {
  switch (head_dim) {
    case 64: return attend_group_dispatch<Pairs, 64>(src, count, q, limit, out, range);
    case 128: return attend_group_dispatch<Pairs, 128>(src, count, q, limit, out, range);
    case 32: return attend_group_dispatch<Pairs, 32>(src, count, q, limit, out, range);
    case 256: return attend_group_dispatch<Pairs, 256>(src, count, q, limit, out, range);
    default: std::abort();  // paired_supported was checked
  }
}
#endif  // KVLOOM_AVX512

// The best path this build has short of AMX: the one paired-layout calls take until
// kvloom_paired_attention_isa says otherwise.
#if defined(__AVX512BF16__) && defined(KVLOOM_AVX512)
constexpr PairedPath BEST_VECTOR_PATH = PAIRED_BF16;
#elif defined(KVLOOM_AVX512)
constexpr PairedPath BEST_VECTOR_PATH = PAIRED_AVX512;
#else
constexpr PairedPath BEST_VECTOR_PATH = PAIRED_AVX2;
#endif
// The worst path this build has (AVX2 exists wherever AVX-512 does; -march=native).
#ifdef KVLOOM_AVX2
constexpr PairedPath WORST_PATH = PAIRED_AVX2;
#else
constexpr PairedPath WORST_PATH = PAIRED_AVX512;
#endif
std::atomic<int> paired_path{BEST_VECTOR_PATH};
constexpr int MAX_WIDTH = 16;  // the widest group of any path

// The widest group a path takes: 16 tile rows, or what the vector registers hold.
int group_width(int64_t head_dim, int path) {
#ifdef KVLOOM_AVX512
  if (path == PAIRED_AVX512 || path == PAIRED_BF16) return max_group(static_cast<int>(head_dim));
#endif
  (void)head_dim;
  return path == PAIRED_AMX ? 16 : AVX2_GROUP;
}

void attend_group(int64_t head_dim, const KeySource& src, int64_t count, const uint16_t* const* q,
                  const int64_t* limit, uint16_t* const* out, const BlockRange& range, int path) {
#ifdef KVLOOM_PAIRED_AMX
  if (path == PAIRED_AMX) {
    switch (head_dim) {
      case 64: return attend_group_amx<64>(src, count, q, limit, out, range);
      case 128: return attend_group_amx<128>(src, count, q, limit, out, range);
      case 32: return attend_group_amx<32>(src, count, q, limit, out, range);
      case 256: return attend_group_amx<256>(src, count, q, limit, out, range);
      default: std::abort();
    }
  }
#endif
#if defined(__AVX512BF16__) && defined(KVLOOM_AVX512)
  if (path == PAIRED_BF16) return attend_group_vector<PairsBf16>(head_dim, src, count, q, limit, out, range);
#endif
#ifdef KVLOOM_AVX512
  if (path == PAIRED_AVX512) return attend_group_vector<PairsFma>(head_dim, src, count, q, limit, out, range);
#endif
#ifdef KVLOOM_AVX2
  if (path == PAIRED_AVX2) return attend_group_avx2(head_dim, src, count, q, limit, out, range);
#endif
  std::abort();  // kvloom_paired_attention_isa only sets paths this build has
}

// GPT-OSS's attention sinks on the paired paths: a vector whose walk ended suspended in
// `st` (every path stores the same state: its accumulator, per-lane partial sums and
// running max), finished as out = acc / (sum + exp(sink - row_max)), the sink joining the
// denominator in the sum's units. One finish for every path (AVX2, AVX-512, vdpbf16ps,
// AMX), in their own finish's operations (the sum in _mm512_reduce_add_ps's order, one
// reciprocal, the product rounded to bf16 as store16 and store8 round), so a sink of -inf
// (exp gives exactly 0) gives the bits of a walk without one.
inline void finish_with_sink(const PairedState& st, int64_t head_dim, float sink, uint16_t* out) {
#ifdef KVLOOM_AVX512
  const float sum = _mm512_reduce_add_ps(_mm512_load_ps(st.sum));
  const __m512 inv = _mm512_set1_ps(1.0f / (sum + std::exp(sink - st.row_max)));
  for (int64_t d = 0; d < head_dim; d += 16)
    kvloom_simd::store16(out + d, _mm512_mul_ps(_mm512_load_ps(st.acc + d), inv), 16);
#else
  const float sum = kvloom_simd::reduce_add16(_mm256_load_ps(st.sum), _mm256_load_ps(st.sum + 8));
  const __m256 inv = _mm256_set1_ps(1.0f / (sum + std::exp(sink - st.row_max)));
  for (int64_t d = 0; d < head_dim; d += 8) kvloom_simd::store8(out + d, _mm256_mul_ps(_mm256_load_ps(st.acc + d), inv));
#endif
}

// Shared prefixes in a batch (the radix cache hands many sequences the same leading
// blocks): decoding sequences whose block tables start with the same blocks form a
// group, and the group's query vectors walk those shared blocks together, a block's
// K/V loaded once for all of them (from memory once a step, instead of once per
// sequence), each vector's state then suspended; every sequence resumes from its
// states over its own blocks. A vector's arithmetic is the same as walking alone (the
// same blocks in the same order, the same per-vector operations), so grouping changes
// no bit of any result: tests/attention/test_attention_invariance.py holds the two to equality.
struct Cascade {
  std::vector<int64_t> shared;       // per sequence: its group's shared blocks (0: none)
  std::vector<int64_t> first_state;  // per sequence: index of its first query vector's state
  std::vector<int64_t> members;      // sequences, group after group
  std::vector<int64_t> group_begin;  // groups' offsets in members (one past the last too)
  std::vector<int64_t> group_shared; // per group: blocks shared (fully seen by every vector)
  int64_t num_states = 0;
};

constexpr int64_t CASCADE_MIN_BLOCKS = 4;  // shorter shared runs are not worth a suspend

// No groups under a sliding window (window > 0): its keys are each sequence's own recent
// ones, and a shared prefix mostly lies before them.
Cascade plan_cascade(const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                     const int32_t* query_lens, int64_t num_seqs, int64_t num_heads, int64_t block_size,
                     int64_t window = 0) {
  Cascade plan;
  plan.shared.assign(num_seqs, 0);
  plan.first_state.assign(num_seqs, 0);
  plan.group_begin.push_back(0);
  if (window > 0) return plan;
  // Decodes (and other steps of one query tile): the blocks their first row sees whole.
  std::vector<int64_t> seen(num_seqs, 0), order;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (query_lens[s] < 1 || query_lens[s] > TILE) continue;
    seen[s] = std::min<int64_t>(max_blocks, (seq_lens[s] - query_lens[s] + 1) / block_size);
    if (seen[s] >= CASCADE_MIN_BLOCKS) order.push_back(s);
  }
  if (order.size() < 2) return plan;
  // Sorted by their tables (as far as each sees whole blocks), sequences that share
  // leading blocks are neighbours; a group is a run of neighbours that share at least
  // CASCADE_MIN_BLOCKS, and shares the least of its neighbours' common prefixes.
  const auto table = [&](int64_t s) { return block_tables + s * max_blocks; };
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(table(a), table(a) + seen[a], table(b), table(b) + seen[b]);
  });
  const auto common = [&](int64_t a, int64_t b) {
    const int64_t most = std::min(seen[a], seen[b]);
    int64_t n = 0;
    while (n < most && table(a)[n] == table(b)[n]) ++n;
    return n;
  };
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    int64_t shared = seen[order[i]];
    while (j < order.size()) {
      const int64_t next = common(order[j - 1], order[j]);
      if (next < CASCADE_MIN_BLOCKS) break;
      shared = std::min(shared, next);
      ++j;
    }
    if (j - i >= 2) {
      for (size_t m = i; m < j; ++m) {
        const int64_t s = order[m];
        plan.shared[s] = shared;
        plan.first_state[s] = plan.num_states;
        plan.num_states += query_lens[s] * num_heads;
        plan.members.push_back(s);
      }
      plan.group_begin.push_back(static_cast<int64_t>(plan.members.size()));
      plan.group_shared.push_back(shared);
    }
    i = j;
  }
  return plan;
}

void attend_paired(const uint16_t* q, uint16_t* out, const uint16_t* k_cache, const uint16_t* v_cache,
                   const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                   const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   float scale, int64_t window, float softcap, const float* sinks, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = block_size * num_kv_heads * head_dim;
  const int64_t head_stride = block_size * head_dim;  // one kv head's K (or V) in a block
  const int path = paired_path.load(std::memory_order_relaxed);  // one path for the whole call
  const int max_rows = group_width(head_dim, path);
  const Cascade plan = plan_cascade(block_tables, max_blocks, seq_lens, query_lens, num_seqs, num_heads,
                                    block_size, window);
  const WorkItems work = make_items(query_lens, seq_lens, plan.shared.data(), block_size, num_seqs, num_kv_heads,
                                    num_threads);
  static thread_local std::vector<PairedState> states;  // reused: no page faults per call
  if (states.size() < static_cast<size_t>(plan.num_states)) states.resize(plan.num_states);
  PairedState* const state = states.data();  // the calling thread's: the workers' own are empty
  // Vector i of kv head kh in a tile starting at row r0: its row, query head, and token.
  const auto vector_at = [&](int64_t r0, int64_t kh, int64_t i, int64_t* row, int64_t* head) {
    *row = r0 + i / group;
    *head = kh * group + i % group;
  };
  // Query vector `head` of a token (a row of q in the batch).
  const auto query_vector = [&](int64_t token, int64_t head) { return q + (token * num_heads + head) * head_dim; };
  // The shared walks: items of (group, kv head, up to CHUNK of its sequences).
  constexpr int64_t CHUNK = 16;
  std::vector<int64_t> shared_items;  // (group, first member) pairs
  for (size_t g = 0; g + 1 < plan.group_begin.size(); ++g)
    for (int64_t m = plan.group_begin[g]; m < plan.group_begin[g + 1]; m += CHUNK) {
      shared_items.push_back(static_cast<int64_t>(g));
      shared_items.push_back(m);
    }
  const int64_t num_shared_items = static_cast<int64_t>(shared_items.size() / 2) * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
#ifdef KVLOOM_PAIRED_AMX
    if (path == PAIRED_AMX) amx_configure();
#endif
    // With sinks, a group's own walk ends suspended here and finish_with_sink writes the
    // outputs (the walks themselves know no heads, so no sinks).
    PairedState finals[MAX_WIDTH];
    PairedState* final_states[MAX_WIDTH];
    for (int i = 0; i < MAX_WIDTH; ++i) final_states[i] = &finals[i];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_shared_items; ++item) {
      const int64_t g = shared_items[2 * (item / num_kv_heads)], m_begin = shared_items[2 * (item / num_kv_heads) + 1];
      const int64_t kh = item % num_kv_heads;
      const int64_t m_end = std::min(plan.group_begin[g + 1], m_begin + CHUNK);
      const int32_t* table = block_tables + plan.members[plan.group_begin[g]] * max_blocks;
      const KeySource src{table, k_cache, v_cache, block_stride, kh * head_stride, block_size, scale, window,
                          softcap};
      // Every vector of the chunk's sequences for this kv head, in groups of max_rows.
      const uint16_t* qs[MAX_WIDTH];
      int64_t limit[MAX_WIDTH];
      PairedState* suspend[MAX_WIDTH];
      int64_t count = 0;
      const BlockRange range{0, plan.group_shared[g], nullptr, suspend};
      for (int64_t m = m_begin; m < m_end; ++m) {
        const int64_t s = plan.members[m];
        for (int64_t i = 0; i < query_lens[s] * group; ++i) {
          int64_t row, head;
          vector_at(0, kh, i, &row, &head);
          qs[count] = query_vector(query_start[s] + row, head);
          limit[count] = seq_lens[s] - query_lens[s] + row + 1;
          suspend[count] = &state[plan.first_state[s] + row * num_heads + head];
          if (++count == max_rows) {
            attend_group(head_dim, src, count, qs, limit, nullptr, range, path);
            count = 0;
          }
        }
      }
      if (count) attend_group(head_dim, src, count, qs, limit, nullptr, range, path);
    }
    // Then every sequence over its own blocks (all of them, where it is in no group).
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work.size(); ++item) {
      const int64_t s = work.items[3 * item], r0 = work.items[3 * item + 1], kv0 = work.items[3 * item + 2];
      const int64_t rows = std::min<int64_t>(TILE, query_lens[s] - r0);
      // Query row r sits at absolute position seq_len - q_len + r and sees keys <= it.
      const int64_t first_pos = seq_lens[s] - query_lens[s] + r0;
      const int32_t* table = block_tables + s * max_blocks;
      const int64_t shared = plan.shared[s];
      for (int64_t kh = kv0; kh < kv0 + work.heads_per_item; ++kh) {
        // The kv head's query vectors, row-major then head: a row's heads share a limit.
        const int64_t vecs = rows * group;
        for (int64_t m0 = 0; m0 < vecs; m0 += max_rows) {
          const int64_t count = std::min<int64_t>(max_rows, vecs - m0);
          const uint16_t* qs[MAX_WIDTH];
          uint16_t* outs[MAX_WIDTH];
          int64_t limit[MAX_WIDTH], heads[MAX_WIDTH];
          PairedState* resume[MAX_WIDTH];
          for (int64_t i = 0; i < count; ++i) {
            int64_t row, head;
            vector_at(r0, kh, m0 + i, &row, &head);
            const int64_t token = query_start[s] + row;
            heads[i] = head;
            qs[i] = query_vector(token, head);
            outs[i] = out + (token * num_heads + head) * head_dim;
            limit[i] = first_pos + (row - r0) + 1;
            if (shared) resume[i] = &state[plan.first_state[s] + row * num_heads + head];
          }
          // The next group's query vectors, fetched while this group walks its keys: a
          // prompt's vectors are each read once, by one group, fresh from the matmul that
          // made them (they missed in cache at the head of every group of a prefill).
          for (int64_t i = m0 + count; i < std::min(vecs, m0 + count + max_rows); ++i) {
            int64_t row, head;
            vector_at(r0, kh, i, &row, &head);
            const char* vector = reinterpret_cast<const char*>(query_vector(query_start[s] + row, head));
            for (int64_t at = 0; at < head_dim * 2; at += 64) __builtin_prefetch(vector + at);
          }
          const KeySource src{table, k_cache, v_cache, block_stride, kh * head_stride, block_size, scale, window,
                              softcap};
          attend_group(head_dim, src, count, qs, limit, outs,
                       BlockRange{shared, -1, shared ? resume : nullptr, sinks ? final_states : nullptr}, path);
          if (sinks)
            for (int64_t i = 0; i < count; ++i) finish_with_sink(finals[i], head_dim, sinks[heads[i]], outs[i]);
        }
      }
    }
#ifdef KVLOOM_PAIRED_AMX
    if (path == PAIRED_AMX) _tile_release();
#endif
  }
}
#else
inline bool paired_supported(int64_t, int64_t) { return false; }
#endif

// Scatter tokens' K/V ([tokens, kv_heads, head_dim], `k_stride`/`v_stride` elements
// between tokens) into their slots of a paired-layout cache (the layout above).
void write_paired(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                  const int64_t* slots, int64_t tokens, uint16_t* k_cache, uint16_t* v_cache,
                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int num_threads) {
  const int64_t block_stride = block_size * num_kv_heads * head_dim;
  const int64_t pairs = head_dim / 2;
// Threads from two tokens on: each token's K writes touch head_dim / 2 cold cache lines
// (one word each), a latency-bound scatter that two threads halve (decode steps).
#pragma omp parallel for num_threads(tokens >= 2 ? num_threads : 1)
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const uint32_t* k_words = reinterpret_cast<const uint32_t*>(k + i * k_stride + h * head_dim);
      uint32_t* k_dst = reinterpret_cast<uint32_t*>(k_cache + block * block_stride) + h * pairs * block_size + offset;
      for (int64_t p = 0; p < pairs; ++p) k_dst[p * block_size] = k_words[p];
      const uint16_t* v_row = v + i * v_stride + h * head_dim;
      uint16_t* v_dst = v_cache + block * block_stride + (h * (block_size / 2) + offset / 2) * head_dim * 2
                        + offset % 2;  // then every other bf16: the token's half of each pair word
      for (int64_t d = 0; d < head_dim; ++d) v_dst[2 * d] = v_row[d];
    }
  }
}

}  // namespace

extern "C" {

// The C ABI that kvloom/kernels/paged_attention.py declares (tests/kernels/test_op_schemas.py
// holds those declarations to these prototypes).

// Whether bf16 caches of this shape use the paired layout (kvloom_paged_attention's kernel 2).
int kvloom_paired_layout(int64_t head_dim, int64_t block_size) { return paired_supported(head_dim, block_size); }

void kvloom_write_kv_paired(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                            const int64_t* slots, int64_t tokens, uint16_t* k_cache, uint16_t* v_cache,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int num_threads) {
  write_paired(k, k_stride, v, v_stride, slots, tokens, k_cache, v_cache, num_kv_heads, head_dim, block_size,
               num_threads);
}

// Sets the path of paired-layout calls (PairedPath) to the best one up to `want` that
// this build has (AMX only where Linux grants its state) and returns it; -1 where the
// paired layout is not built.
int kvloom_paired_attention_isa(int want) {
#ifdef KVLOOM_PAIRED
  int path = std::max<int>(WORST_PATH, std::min<int>(want, BEST_VECTOR_PATH));
#ifdef KVLOOM_PAIRED_AMX
  if (want >= PAIRED_AMX && kvloom_amx::permitted()) path = PAIRED_AMX;
#endif
  paired_path = path;
  return path;
#else
  (void)want;
  return -1;
#endif
}

// How many of the sequences a paired-layout call walks partly in shared groups (the
// Cascade above); 0 where the paired layout is not built. For tests.
int64_t kvloom_paired_cascade_members(const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                                      const int32_t* query_lens, int64_t num_seqs, int64_t block_size) {
#ifdef KVLOOM_PAIRED
  return static_cast<int64_t>(
      plan_cascade(block_tables, max_blocks, seq_lens, query_lens, num_seqs, 1, block_size).members.size());
#else
  (void)block_tables, (void)max_blocks, (void)seq_lens, (void)query_lens, (void)num_seqs, (void)block_size;
  return 0;
#endif
}

// kernel: 0 a float32 cache, 1 a token-major bf16 cache, 2 a bf16 cache in the paired
// layout (only where kvloom_paired_layout said so). window > 0: a sliding window, each
// query at position p attending keys (p - window, p]; 0: every key up to p. softcap > 0:
// each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2's); 0: none. sinks:
// GPT-OSS's attention sinks, one logit per query head ([num_heads] float32) that joins
// each query's softmax denominator with no value (nullptr: none, and then no bit of the
// output changes). q, out and the caches hold that element type: float, or bf16 as uint16_t.
void kvloom_paged_attention_sinks(const void* q, void* out, const void* k_cache, const void* v_cache,
                                  const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                                  const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int64_t window, float softcap, const float* sinks, int num_threads,
                                  int kernel) {
  auto run = [&](auto attend_fn, auto element) {
    using T = decltype(element);
    attend_fn(static_cast<const T*>(q), static_cast<T*>(out), static_cast<const T*>(k_cache),
              static_cast<const T*>(v_cache), block_tables, max_blocks, seq_lens, query_start, query_lens,
              num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, sinks,
              num_threads);
  };
  if (kernel == 0) {
    run(attend<float>, float{});
  } else if (kernel == 1) {
    run(attend<uint16_t>, uint16_t{});
  } else {
#ifdef KVLOOM_PAIRED
    run(attend_paired, uint16_t{});
#else
    std::abort();  // kvloom_paired_layout returned 0
#endif
  }
}

// kvloom_paged_attention_sinks without sinks. Its own entry point, with the signature it
// had before sinks, because the decoder walk holds its address as that signature
// (decoder_stack.cpp's AttentionFn; it serves no model with sinks).
void kvloom_paged_attention(const void* q, void* out, const void* k_cache, const void* v_cache,
                            const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                            const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, int64_t window, float softcap, int num_threads, int kernel) {
  kvloom_paged_attention_sinks(q, out, k_cache, v_cache, block_tables, max_blocks, seq_lens, query_start,
                               query_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window,
                               softcap, nullptr, num_threads, kernel);
}

}
