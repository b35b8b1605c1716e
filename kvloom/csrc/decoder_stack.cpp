// The decoder layers of a Llama-family model, all of them, in one native call.
//
// Why: at decode sizes a layer's kernels take tens of microseconds each, and the
// Python between them (module calls, argument checks, output allocation, the ctypes
// round trip, a GIL hand-off per kernel) took about a third of a batch-1 step
// (docs/benchmarks.md). This file walks the layers in C instead.
//
// Invariant: it does no arithmetic of its own. It calls the very kernels the module
// path calls (csrc/cpu_ops.cpp, gemm.cpp, paged_attention.cpp, handed over as entry
// points so each keeps its own build flags), in the same order, on the same values,
// with the same thread count; the results are bit-identical to LlamaForCausalLM's
// module path (tests/models/test_decoder_stack.py holds it to that). Only the bf16
// paired-layout attention and kvloom's GEMM are wired here: anything else takes the
// module path.
//
// Per layer, with T tokens:
//   normed  = rms_norm(layer 0: residual; else residual += hidden)
//   qkv     = normed @ Wqkv (+ b)              [T, q + 2 kv]
//   rotary(q and k heads of qkv), in place
//   write k, v into the layer's cache (paired layout)
//   q_rows  = q of qkv, contiguous              [T, q]
//   attn    = paged_attention(q_rows)           [T, q]
//   hidden  = attn @ Wo (+ b)                   [T, H]
//   normed  = rms_norm(residual += hidden)
//   gate_up = normed @ Wgu (+ b)                [T, 2 I]
//   act     = silu(gate) * up                   [T, I]
//   hidden  = act @ Wdown (+ b)                 [T, H]
// The caller adds the last `hidden` into `residual` with the final norm. Under tensor
// parallel (a non-null `reduce`: the shared-memory all-reduce's context) each rank holds
// its heads and MLP features, and `hidden` is summed over the ranks after the o and the
// down projections, as the module path's all-reduces do, with the same function.
#include <cstdint>
#include <cstring>

namespace {

using RmsNormFn = void (*)(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                           int64_t rows, int64_t n, float eps);
using GemmFn = int (*)(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y, int64_t m,
                       int64_t n, int64_t k, int isa, int num_threads);
using RotaryFn = void (*)(uint16_t* x, int64_t row_stride, const float* cos, const float* sin, int64_t tokens,
                          int64_t num_heads, int64_t head_dim);
using WriteKvFn = void (*)(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                           const int64_t* slots, int64_t tokens, uint16_t* k_cache, uint16_t* v_cache,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int num_threads);
using AttentionFn = void (*)(const void* q, void* out, const void* k_cache, const void* v_cache,
                             const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                             const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, int num_threads, int kernel);
using SiluFn = void (*)(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n);
using AllReduceFn = int (*)(int64_t* context, uint16_t* data, int64_t numel);  // csrc/shm_collectives.cpp

// The order of the entry points in `kernels` and of a layer's row in `weights`
// (kvloom/models/decoder_stack.py builds both).
enum Kernel { K_RMS_NORM, K_GEMM, K_ROTARY, K_WRITE_KV, K_ATTENTION, K_SILU, K_ALL_REDUCE, NUM_KERNELS };
enum Weight { W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_O, W_O_BIAS, W_POST_NORM, W_GATE_UP, W_GATE_UP_BIAS, W_DOWN,
              W_DOWN_BIAS, NUM_WEIGHTS };
constexpr int PAIRED_KERNEL = 2;  // paged_attention.cpp's code for a bf16 cache in the paired layout

template <class T>
T entry(const int64_t* kernels, Kernel which) { return reinterpret_cast<T>(kernels[which]); }
inline const uint16_t* weight(const int64_t* row, Weight which) {
  return reinterpret_cast<const uint16_t*>(row[which]);  // 0 (a missing bias) is nullptr
}

}  // namespace

extern "C" {

// Scratch elements (bf16) the walk needs for `tokens` rows: normed, qkv, q rows,
// attention output, gate_up and the activation.
int64_t kvloom_decoder_stack_scratch(int64_t tokens, int64_t hidden_size, int64_t q_size, int64_t kv_size,
                                     int64_t intermediate) {
  return tokens * (hidden_size + (q_size + 2 * kv_size) + 2 * q_size + 3 * intermediate);
}

// kernels: [NUM_KERNELS] entry points; weights: [num_layers, NUM_WEIGHTS] data pointers
// (packed GEMM weights, bf16 norm weights and biases, 0 for no bias). residual: [tokens,
// hidden_size] (the embeddings in; the stream before the last `hidden` out); hidden:
// [tokens, hidden_size] out. kv_caches: [num_layers, 2, num_blocks, block_size, kv heads,
// head_dim] bf16 in the paired layout. reduce: nullptr, or the all-reduce's context
// (kernels[K_ALL_REDUCE] then sums `hidden` over the tensor-parallel ranks). Returns 0,
// 1 + the layer whose GEMM refused `isa` (nothing after it ran), or the all-reduce's
// failure (-1 timed out, -2 a rank died).
int kvloom_decoder_stack(const int64_t* kernels, const int64_t* weights, int64_t num_layers, uint16_t* residual,
                         uint16_t* hidden, uint16_t* scratch, uint16_t* kv_caches, int64_t num_blocks,
                         const float* cos, const float* sin, const int64_t* slots, const int32_t* block_tables,
                         int64_t max_blocks, const int32_t* seq_lens, const int32_t* query_start,
                         const int32_t* query_lens, int64_t num_seqs, int64_t tokens, int64_t hidden_size,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                         int64_t block_size, float eps, float scale, int isa, int num_threads,
                         int64_t* reduce) {
  const auto rms_norm = entry<RmsNormFn>(kernels, K_RMS_NORM);
  const auto gemm = entry<GemmFn>(kernels, K_GEMM);
  const auto rotary = entry<RotaryFn>(kernels, K_ROTARY);
  const auto write_kv = entry<WriteKvFn>(kernels, K_WRITE_KV);
  const auto attention = entry<AttentionFn>(kernels, K_ATTENTION);
  const auto silu = entry<SiluFn>(kernels, K_SILU);
  const auto all_reduce = entry<AllReduceFn>(kernels, K_ALL_REDUCE);

  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qkv_width = q_size + 2 * kv_size;
  uint16_t* normed = scratch;                        // [T, H]
  uint16_t* qkv = normed + tokens * hidden_size;     // [T, q + 2 kv]
  uint16_t* q_rows = qkv + tokens * qkv_width;       // [T, q]
  uint16_t* attn = q_rows + tokens * q_size;         // [T, q]
  uint16_t* gate_up = attn + tokens * q_size;        // [T, 2 I]
  uint16_t* act = gate_up + tokens * 2 * intermediate;  // [T, I]
  const int64_t half_cache = num_blocks * block_size * kv_size;  // K's (or V's) elements in one layer

  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t* w = weights + layer * NUM_WEIGHTS;
    uint16_t* k_cache = kv_caches + layer * 2 * half_cache;
    uint16_t* v_cache = k_cache + half_cache;
    if (layer == 0) rms_norm(residual, nullptr, weight(w, W_INPUT_NORM), normed, tokens, hidden_size, eps);
    else rms_norm(hidden, residual, weight(w, W_INPUT_NORM), normed, tokens, hidden_size, eps);
    if (gemm(normed, weight(w, W_QKV), weight(w, W_QKV_BIAS), qkv, tokens, qkv_width, hidden_size, isa,
             num_threads) != 0)
      return static_cast<int>(layer) + 1;
    rotary(qkv, qkv_width, cos, sin, tokens, num_heads + num_kv_heads, head_dim);
    write_kv(qkv + q_size, qkv_width, qkv + q_size + kv_size, qkv_width, slots, tokens, k_cache, v_cache,
             num_kv_heads, head_dim, block_size, num_threads);
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(q_rows + t * q_size, qkv + t * qkv_width, q_size * sizeof(uint16_t));
    attention(q_rows, attn, k_cache, v_cache, block_tables, max_blocks, seq_lens, query_start, query_lens, num_seqs,
              num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, PAIRED_KERNEL);
    if (gemm(attn, weight(w, W_O), weight(w, W_O_BIAS), hidden, tokens, hidden_size, q_size, isa, num_threads) != 0)
      return static_cast<int>(layer) + 1;
    if (reduce != nullptr) {
      const int status = all_reduce(reduce, hidden, tokens * hidden_size);
      if (status != 0) return status;
    }
    rms_norm(hidden, residual, weight(w, W_POST_NORM), normed, tokens, hidden_size, eps);
    if (gemm(normed, weight(w, W_GATE_UP), weight(w, W_GATE_UP_BIAS), gate_up, tokens, 2 * intermediate,
             hidden_size, isa, num_threads) != 0)
      return static_cast<int>(layer) + 1;
    silu(gate_up, act, tokens, intermediate);
    if (gemm(act, weight(w, W_DOWN), weight(w, W_DOWN_BIAS), hidden, tokens, hidden_size, intermediate, isa,
             num_threads) != 0)
      return static_cast<int>(layer) + 1;
    if (reduce != nullptr) {
      const int status = all_reduce(reduce, hidden, tokens * hidden_size);
      if (status != 0) return status;
    }
  }
  return 0;
}

}  // extern "C"
