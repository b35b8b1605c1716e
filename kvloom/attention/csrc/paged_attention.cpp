// Paged attention for CPUs: reads K/V straight through the block table (no gather).
//
// One work item = (sequence, kv head, tile of up to TILE query rows). The item's
// query heads that share the kv head (GQA group) and its query rows all reuse each
// K/V block once it has been converted to float, flash-attention style: per block,
// scores -> running max -> rescaled accumulator. Accumulation is float32 whatever
// the storage type. Plain C ABI (called through ctypes) so that building needs no
// torch headers and takes about a second.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <omp.h>

namespace {

constexpr int TILE = 16;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16 -> float: the high half of a float
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, uint16_t* dst) {  // round to nearest even, NaN kept NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) { *dst = 0x7fc0; return; }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
}

template <typename T>
void attend(const T* q, T* out, const T* k_cache, const T* v_cache,
            const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
            const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
            int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  // Work items: (seq, kv_head, tile start row).
  std::vector<int64_t> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_lens[s];
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = 0; r < q_len; r += TILE) { items.push_back(s); items.push_back(h); items.push_back(r); }
  }
  const int64_t num_items = static_cast<int64_t>(items.size() / 3);
  const int64_t slot_stride = num_kv_heads * head_dim;           // one token slot
  const int64_t block_stride = block_size * slot_stride;         // one block

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> kbuf(block_size * head_dim), vbuf(block_size * head_dim);
    std::vector<float> qbuf(TILE * group * head_dim), acc(TILE * group * head_dim);
    std::vector<float> row_max(TILE * group), row_sum(TILE * group), scores(block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t s = items[3 * item], kvh = items[3 * item + 1], r0 = items[3 * item + 2];
      const int64_t q_len = query_lens[s];
      const int64_t seq_len = seq_lens[s];
      const int64_t rows = std::min<int64_t>(TILE, q_len - r0);
      const int64_t vecs = rows * group;
      // Query row r sits at absolute position seq_len - q_len + r and sees keys <= it.
      const int64_t first_pos = seq_len - q_len + r0;
      const int64_t last_key = first_pos + rows;  // exclusive bound on keys any row sees
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = q + ((query_start[s] + r0 + r) * num_heads + kvh * group + g) * head_dim;
          float* dst = &qbuf[(r * group + g) * head_dim];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
        }
      std::fill(acc.begin(), acc.begin() + vecs * head_dim, 0.0f);
      std::fill(row_max.begin(), row_max.begin() + vecs, -INFINITY);
      std::fill(row_sum.begin(), row_sum.begin() + vecs, 0.0f);
      const int32_t* table = block_tables + s * max_blocks;
      const int64_t num_blocks = (last_key + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t base_pos = b * block_size;
        const int64_t slots = std::min<int64_t>(block_size, last_key - base_pos);
        const T* kb = k_cache + table[b] * block_stride + kvh * head_dim;
        const T* vb = v_cache + table[b] * block_stride + kvh * head_dim;
        for (int64_t t = 0; t < slots; ++t)
          for (int64_t d = 0; d < head_dim; ++d) {
            kbuf[t * head_dim + d] = to_float(kb[t * slot_stride + d]);
            vbuf[t * head_dim + d] = to_float(vb[t * slot_stride + d]);
          }
        for (int64_t m = 0; m < vecs; ++m) {
          const int64_t visible = std::min<int64_t>(slots, first_pos + m / group + 1 - base_pos);
          if (visible <= 0) continue;
          const float* qv = &qbuf[m * head_dim];
          float block_max = -INFINITY;
          for (int64_t t = 0; t < visible; ++t) {
            const float* kv = &kbuf[t * head_dim];
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qv[d] * kv[d];
            scores[t] = dot;
            block_max = std::max(block_max, dot);
          }
          const float new_max = std::max(row_max[m], block_max);
          const float correction = std::exp(row_max[m] - new_max);
          float* a = &acc[m * head_dim];
          float sum = row_sum[m] * correction;
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
          for (int64_t t = 0; t < visible; ++t) {
            const float p = std::exp(scores[t] - new_max);
            sum += p;
            const float* vv = &vbuf[t * head_dim];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vv[d];
          }
          row_max[m] = new_max;
          row_sum[m] = sum;
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t m = r * group + g;
          const float inv = 1.0f / row_sum[m];
          T* dst = out + ((query_start[s] + r0 + r) * num_heads + kvh * group + g) * head_dim;
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
