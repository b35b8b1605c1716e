// The decoder layers of a Llama-family model (and of every dense family kvloom serves whose
// layer is Llama's with its norms, MLP and adds moved or changed), all of them, in one native call.
//
// Why: at decode sizes a layer's kernels take tens of microseconds each, and the
// Python between them (module calls, argument checks, output allocation, the ctypes
// round trip, a GIL hand-off per kernel) took about a third of a batch-1 step
// (docs/benchmarks.md). This file walks the layers in C instead.
//
// Invariant: it does no arithmetic of its own. It calls the very kernels the module
// path calls (csrc/cpu_ops.cpp, gemm.cpp, paged_attention.cpp, handed over as entry
// points so each keeps its own build flags), in the same order, on the same values;
// the results are bit-identical to the model's module path
// (tests/models/test_decoder_stack.py holds it to that). Only the bf16 paired-layout
// attention and kvloom's GEMM are wired here: anything else takes the module path.
//
// Per layer, with T tokens:
//   normed  = rms_norm(layer 0: residual; else residual += hidden)
//   qkv     = normed @ Wqkv (+ b)              [T, q + 2 kv]
//   Qwen3, Gemma 3: each q head rms_norm(Wq_norm), each k head rms_norm(Wk_norm), in qkv
//   rotary(q and k heads of qkv), in place (the layer's table: Gemma 3's windowed layers have their own)
//   write k, v into the layer's cache (paired layout)
//   q_rows  = q of qkv, contiguous              [T, q]
//   attn    = paged_attention(q_rows)           [T, q]  (Gemma 2: scores softcapped)
//   hidden  = attn @ Wo (+ b)                   [T, H]
//   normed  = rms_norm(residual += hidden)
//             Gemma 2 and 3 (sandwich norms): rms_norm(residual += rms_norm(hidden, Wpost), Wpre_ff)
//   gate_up = normed @ Wgu (+ b)                [T, 2 I]
//   act     = silu(gate) * up                   [T, I]  (Gemma: gelu_tanh(gate) * up)
//   hidden  = act @ Wdown (+ b)                 [T, H]
//             Gemma 2 and 3: hidden = rms_norm(hidden, Wpost_ff)
// OLMo 2 and EXAONE 4 norm each block's output instead and have no input norm (W_INPUT_NORM
// 0): a layer's qkv matmul reads the stream (residual += hidden, layer 0 the embeddings),
// the attention's output is normed (Wpost) and added into the stream, which the MLP reads;
// its output is normed (Wpost_ff) and added in by the next layer (or the final norm).
// OLMo 2's q and k norms span the whole projection (qk_norm_whole), not a head each.
// Every rms_norm is Llama's (x / rms(x) rounded, then times the weight) or, for Gemma and
// Helium, cpu_ops.cpp's rms_norm_scaled (times offset + weight in float32, one rounding), or
// its layer_norm (a weight and a bias: StarCoder2, GPT-2, Phi, GPT-NeoX, StableLM, OLMo 1 with
// weight 1 and bias 0). StarCoder2's, GPT-2's, Phi's and GPT-NeoX's MLP is un-gated:
// gate_up is fc1's output [T, I], act = gelu(it) (the tanh form, or GPT-NeoX's exact one),
// down is fc2.
// Phi and GPT-NeoX add attention and MLP to the stream side by side (parallel): the MLP
// reads the attention's input (Phi: W_POST_NORM 0) or the stream normed by its own norm
// (GPT-NeoX), writes mlp_out, and hidden = attention's output + mlp_out, which the next
// layer's norm adds into the stream (transformers' (A + M) + S, an add per rounding); StableLM's
// adds the attention's output into the stream at once and the MLP's next ((S + A) + M).
// OLMo 1 clamps qkv to [-clip, clip] after its projection (cpu_ops.cpp's clamp, torch's
// clamp_'s values).
// Granite's residual multiplier (residual_scale != 1): each `hidden` is scaled before it
// is added into `residual`, every product rounded to bf16 as the module path's
// `hidden * s` (a float32 product, rounded to nearest even); the caller scales the last.
// Hybrid stacks (Bamba, IBM Granite 4.0: W_MIXER MIXER_MAMBA in some layers; LiquidAI LFM2:
// MIXER_SHORT_CONV): such a layer's block keeps a state per request in place of the
// attention, its projections in the W_QKV and W_O columns:
//   proj    = normed @ Win (+ b)                [T, inter + conv_dim + heads]  (LFM2: [T, 3 H])
//   mixed   = mamba_mixer(proj)                 [T, inter]  (ssm.cpp: conv + silu, the scan from
//             and into the requests' state slots, the gated norm; every row, as the state moves on)
//             LFM2: short_conv(proj)            [T, H]  (C * conv(B * x), ssm.cpp)
//   hidden  = mixed @ Wout (+ b)                [T, H]
// and the MLP follows as in any layer. The attention layers write the KV pool's layer
// W_KV_LAYER (their rank among the attention layers). No tensor parallel, no LoRA.
// Mixture-of-experts layers (W_ROUTER set: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE, DeepSeek,
// Granite 4.0's, LFM2-MoE's and Nemotron 3's hybrids; models/moe.py is the module path) take the MLP's
// place (LoRA adapters on the attention only: kvloom/lora hands no table while one adapts an expert
// layer; under tensor parallel every expert's share of the features, the sum all-reduced at the end as
// SparseMoE's; under expert parallel the rank's experts whole, the other ranks' pairs left out):
//   logits  = normed @ Wrouter                  [T, E]  (DeepSeek's float32 router: router_logits)
//   weights, experts = moe_route(logits)        [T, k] each (cpu_ops.cpp: a softmax's or sigmoids' top-k,
//             within the best groups where the router picks groups first)
//   rows    = normed's rows, a (row, choice) pair each, grouped by expert  [T k, H]
//   up      = grouped_gemm(rows, every expert's Wgu)    [T k, 2 I_e]  (gemm.cpp, one call; I_e un-gated)
//   hidden  = moe_combine(grouped_gemm(silu(up), every expert's Wdown), weights)  [T, H]
//             (each row's experts added in ascending order, cpu_ops.cpp; un-gated: relu2(up))
//   hidden += (silu(gate) * up)(normed @ Wgu) @ Wdown   a shared expert's (Granite 4.0's), if any,
//             times sigmoid(normed @ Wshared_gate) first where it has a gate (Qwen2-MoE's)
// DeepSeek's latent attention (W_MIXER MIXER_LATENT, models/deepseek.py's LatentAttention the module
// path) takes the attention's place: the latent written to the latent pool, the query through each
// head's up-projection into latent space, kvloom_latent_attention, each head's output out of it, o_proj
// (latent_block has the steps; under tensor parallel the rank's heads, o_proj's sum all-reduced).
// NVIDIA Nemotron-H's single-mixer blocks pair up as layers: a mixer or attention block and
// the MLP block after it; a block with no MLP after it is a layer without an MLP (W_GATE_UP
// 0: its output joins the stream at the next layer's norm), an MLP block after no other a
// layer without a block (MIXER_NONE: the MLP's norm adds the layer before's output in).
// The caller adds the last `hidden` into `residual` with the final norm. Under tensor
// parallel (a non-null `reduce`: the shared-memory all-reduce's context) each rank holds
// its heads and MLP features, and `hidden` is summed over the ranks after the o and the
// down projections, as the module path's all-reduces do, with the same function.
//
// The last layer for the rows the step reads (an `Outputs` list: the rows it samples
// at). Every layer writes every row's K and V, which later steps read; but of the last
// layer's rows only those whose final state is read need their attention, o
// projection and MLP. So after writing the cache the last layer gathers those rows
// (their q vectors, their residual rows, moved to the front of `residual` in order)
// and runs the rest on them alone: a 2,048-token prompt step that samples at a few
// rows skips ~85% of a layer's matmuls and its attention. No bit of a kept row
// changes (each kernel computes a row on its own, below; attention a query vector
// alone, so the kept rows are asked for as the last rows of their sequences' queries).
//
// Two walks at once (split_seqs > 0): the batch's first split_seqs sequences and the
// rest, each walked by half the threads, concurrently. Why: a decode step crosses ~300
// kernels, each ending in a barrier where the thread that finished first waits for the
// other; two walks never wait on each other. Decode at batch 32-128 and context 300 ran
// 3-8% faster (AMD EPYC model 17, docs/benchmarks.md; 0-4% when first tried, before the
// GEMM's threads shared their work). Making the walks take turns at attention, so that
// one core's memory-bound attention would run beside the other's matmuls, gained nothing
// more: one core reads its half of the KV at about the rate two read the whole. Each
// walk reads all the weights, so small batches, bound by that read, keep one walk (batch
// 16: 9-15% slower split); the caller decides (kvloom/models/decoder_stack.py). Every
// kernel's result for a row is independent of which rows share its call and of its
// thread count (the GEMM keeps one K order per output; attention computes each query
// vector alone; the norms, rotary and silu work a row at a time), so the split changes
// no bit; and a sequence lies in one walk, so neither reads what the other writes.
//
// LoRA adapters (lora_weights non-null; kvloom/lora/layers.py is the module path): after
// each of a layer's four matmuls, the rows of each adapter slot in the walk get that
// slot's delta, (x A^T) B^T with A and B packed for the GEMM, added in by cpu_ops.cpp's
// add_rows: the rows gathered where they are not one run, the same GEMM calls on the
// same rows and the same rounding as LoRALinear's, so bit-identical to it as well. In the
// last layer of an Outputs list, the kept rows' slots, as they are moved to the front.
//
// KV fetched ahead (kv_prefetch_bytes > 0; the caller asks for it where the walks
// split): each walk's down projection and the next layer's qkv projection fetch up to
// that many bytes of the next layer's KV, the walk's sequences in order, into L2 as
// they compute (side_stream.h), so that the attention after them reads it from cache.
// A walk's matmuls on one core are bound by their arithmetic and leave memory
// bandwidth spare, while its attention is bound by one core's misses in flight. Decode
// on AMD EPYC model 17, alternating in one process: batch 32 / 64 / 128 at context 300
// 32.6 -> 31.5, 65.5 -> 63.4 and 125.2 -> 121.4 ms, batch 96 at context 600 107.7 ->
// 104.7. Fetched from the o and gate_up projections as well, it gained less (batch 64
// 63.2 -> 61.4 against 60.4), and a single walk on both cores (batch 16), whose matmuls
// already wait on memory, lost 2-6% (docs/benchmarks.md, the eleventh session). A fetch
// changes no bit.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "side_stream.h"
#include "simd.h"

namespace {

using RmsNormFn = void (*)(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                           int64_t rows, int64_t n, float eps);
using kvloom_side::SideStream;
using GemmFn = int (*)(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y, int64_t m,
                       int64_t n, int64_t k, int isa, int num_threads, const SideStream* side);  // gemm.cpp's _side
using RotaryFn = void (*)(uint16_t* x, int64_t row_stride, const float* cos, const float* sin, int64_t tokens,
                          int64_t num_heads, int64_t head_dim, int64_t rotary_dim);
using WriteKvFn = void (*)(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                           const int64_t* slots, int64_t tokens, uint16_t* k_cache, uint16_t* v_cache,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int num_threads);
using AttentionFn = void (*)(const void* q, void* out, const void* k_cache, const void* v_cache,
                             const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                             const int32_t* query_start, const int32_t* query_lens, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, int64_t window, float softcap, int num_threads, int kernel);
using ScaledNormFn = void (*)(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                             int64_t rows, int64_t n, float eps, float offset);
using LayerNormFn = void (*)(const uint16_t* x, uint16_t* residual, const uint16_t* weight, const uint16_t* bias,
                            uint16_t* out, int64_t rows, int64_t n, float eps);
using SiluFn = void (*)(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n);  // and gelu_tanh(_and_mul)
using ClampFn = void (*)(uint16_t* x, int64_t count, float limit);
using AllReduceFn = int (*)(int64_t* context, uint16_t* data, int64_t numel);  // csrc/shm_collectives.cpp
using AddRowsFn = void (*)(uint16_t* y, const uint16_t* delta, const int64_t* rows, int64_t count, int64_t n);
using MambaMixerFn = int64_t (*)(const uint16_t* proj, const float* weight_t, const float* conv_bias,
                                 uint16_t* conv_state, float* ssm_state, const float* dt_bias, const float* A_log,
                                 const float* D, const uint16_t* norm_weight, const int64_t* starts,
                                 const int64_t* lengths, const int64_t* slots, const int32_t* has_state,
                                 uint16_t* xbc, float* y, uint16_t* out, int64_t n, int64_t num_slots,
                                 int64_t tokens, int64_t inter, int64_t conv_dim, int64_t heads, int64_t head_dim,
                                 int64_t d_state, int64_t groups, int64_t k, float dt_lo, float dt_hi, float eps,
                                 int num_threads);  // ssm.cpp's kvloom_mamba_mixer_bf16
using GroupedGemmFn = int (*)(const uint16_t* x, const uint16_t* packed, const int64_t* starts, uint16_t* y,
                             int64_t groups, int64_t m, int64_t n, int64_t k, int64_t weight_stride, int isa,
                             int num_threads);  // gemm.cpp's kvloom_gemm_grouped_bf16
using MoeRouteFn = int (*)(const uint16_t* logits, const float* bias, float* weights, int64_t* experts,
                           int64_t tokens, int64_t num_experts, int64_t top_k, int64_t sigmoid, int64_t norm,
                           float eps, float scaling, int64_t round_to_bf16, int64_t num_groups, int64_t topk_groups,
                           int64_t group_rule);  // cpu_ops.cpp's kvloom_moe_route_bf16
using MoeRouteF32Fn = int (*)(const float* logits, const float* bias, float* weights, int64_t* experts,
                              int64_t tokens, int64_t num_experts, int64_t top_k, int64_t sigmoid, int64_t norm,
                              float eps, float scaling, int64_t round_to_bf16, int64_t num_groups,
                              int64_t topk_groups, int64_t group_rule);  // kvloom_moe_route_f32
using RouterLogitsFn = void (*)(const uint16_t* x, const float* weight, float* logits, int64_t tokens,
                                int64_t num_experts, int64_t n);  // cpu_ops.cpp's kvloom_router_logits_bf16
using MoeCombineFn = void (*)(const uint16_t* y, const float* weights, const int64_t* pairs, uint16_t* out,
                              int64_t tokens, int64_t k, int64_t n);  // kvloom_moe_combine_bf16
using SigmoidGateFn = void (*)(uint16_t* x, const uint16_t* gate, int64_t rows, int64_t n);  // kvloom_sigmoid_gate_bf16
using ShortConvFn = int64_t (*)(const uint16_t* proj, const float* weight_t, const float* bias, uint16_t* conv_state,
                                const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                                const int32_t* has_state, uint16_t* bx, uint16_t* out, int64_t n, int64_t num_slots,
                                int64_t tokens, int64_t channels, int64_t k, int num_threads);  // kvloom_short_conv_bf16
using LatentAttentionFn = int (*)(const void* q, void* out, const void* cache, const int32_t* block_tables,
                                  int64_t max_blocks, const int32_t* seq_lens, const int32_t* query_start,
                                  const int32_t* query_lens, int64_t num_seqs, int64_t num_heads, int64_t dim,
                                  int64_t value_dim, int64_t block_size, float scale, int dtype, int products,
                                  int num_threads);  // latent_attention.cpp's kvloom_latent_attention
using LatentRotaryFn = void (*)(const void* x, void* out, const float* cos, const float* sin, int64_t tokens,
                                int64_t heads, int64_t dim, int interleaved, int dtype);  // kvloom_latent_rotary

// The order of the entry points in `kernels` and of a layer's row in `weights`
// (kvloom/models/decoder_stack.py builds both).
enum Kernel { K_RMS_NORM, K_GEMM, K_ROTARY, K_WRITE_KV, K_ATTENTION, K_SILU, K_ALL_REDUCE, K_ADD_ROWS,
              K_RMS_NORM_SCALED, K_GELU_TANH, K_LAYER_NORM, K_GELU_TANH_PLAIN, K_GELU_ERF_PLAIN, K_CLAMP,
              K_RELU_PLAIN, K_RELU2_PLAIN, K_MAMBA_MIXER, K_SHORT_CONV, K_GEMM_GROUPED, K_MOE_ROUTE, K_MOE_COMBINE,
              K_SIGMOID_GATE, K_LATENT_ROTARY, K_LATENT_ATTENTION, K_ROUTER_LOGITS, K_MOE_ROUTE_F32, NUM_KERNELS };
// W_Q_NORM, W_K_NORM: Qwen3's and Gemma 3's per-head norms (0: the model has none).
// W_PRE_FF_NORM, W_POST_FF_NORM: Gemma 2 and 3's (0: none; then W_POST_NORM is the MLP's
// input norm, else the attention output's own). W_INPUT_NORM 0: OLMo 2's layer, its blocks'
// outputs normed (W_POST_NORM, W_POST_FF_NORM) and added, no norm before them. W_WINDOW and W_ROPE are numbers, not
// pointers: the layer's sliding window in keys (0: it attends to the whole context), and
// which rotary table turns q and k (ROPE_NONE: SmolLM3's NoPE layers; ROPE_LOCAL: Gemma
// 3's windowed layers').
// W_MIXER (a number, Mixer) says which block the layer has; W_KV_LAYER (a number) is the
// KV pool's layer an attention layer writes. A state layer's W_QKV and W_O are its in_proj
// and out_proj, and W_CONV_WEIGHT ... W_MIXER_NORM its own: the convolution's float32 weight
// [k, channels] and bias (0: none), its per-slot conv_state (bf16), and a Mamba2 mixer's
// ssm_state (float32), dt_bias, A_log and D (float32) and gated norm's weight.
// W_ROUTER (0: a dense MLP): a mixture-of-experts layer's router, packed; W_EXPERTS_GATE_UP and
// W_EXPERTS_DOWN every expert's packed gate/up and down weights, expert after expert (MoeShape's
// strides apart); its W_GATE_UP and W_DOWN then a shared expert's (0: none), every row's, added
// after the routed ones (Granite 4.0's), times the sigmoid of x @ W_SHARED_GATE where that is set
// (Qwen2-MoE's, packed [1, H]); W_ROUTER_BIAS its experts' float32 selection bias (LFM2-MoE's; 0: none).
// A latent-attention layer (W_MIXER MIXER_LATENT, DeepSeek's; LatentShape): W_QKV its query projection
// (q_proj, or q_b_proj after W_Q_A = q_a_proj and its norm W_Q_A_NORM; 0: none), W_KV_A the latent's
// projection (kv_a_proj_with_mqa) and W_KV_A_NORM its norm, W_HEADS_UK and W_HEADS_UV every head's
// up-projections packed for the grouped GEMM (LatentShape's strides apart), W_O o_proj.
// W_MLP_WIDTH (a number): the layer's MLP features where they differ from the walk's widest (0: the
// widest, Model::intermediate; DeepSeek's dense layers beside its shared experts).
enum Weight { W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_O, W_O_BIAS, W_POST_NORM, W_GATE_UP, W_GATE_UP_BIAS, W_DOWN,
              W_DOWN_BIAS, W_Q_NORM, W_K_NORM, W_WINDOW, W_ROPE, W_PRE_FF_NORM, W_POST_FF_NORM, W_INPUT_NORM_BIAS,
              W_POST_NORM_BIAS, W_MIXER, W_KV_LAYER, W_CONV_WEIGHT, W_CONV_BIAS, W_CONV_STATE, W_SSM_STATE,
              W_DT_BIAS, W_A_LOG, W_D, W_MIXER_NORM, W_ROUTER, W_EXPERTS_GATE_UP, W_EXPERTS_DOWN, W_ROUTER_BIAS,
              W_SHARED_GATE, W_Q_A, W_Q_A_NORM, W_KV_A, W_KV_A_NORM, W_HEADS_UK, W_HEADS_UV, W_MLP_WIDTH,
              NUM_WEIGHTS };
// MIXER_NONE: no block, only the MLP (NVIDIA Nemotron-H's MLP blocks that follow no other);
// a layer whose W_GATE_UP is 0 has no MLP (its block followed by no MLP block).
enum Mixer { MIXER_ATTENTION, MIXER_MAMBA, MIXER_SHORT_CONV, MIXER_NONE, MIXER_LATENT };
constexpr int MIXER_REFUSED = -3;  // a state layer's kernel refused the requests' spans or slots
constexpr int LATENT_REFUSED = -4;  // the latent attention kernel refused the call (its path or shape)
enum Rope { ROPE_NONE, ROPE_GLOBAL, ROPE_LOCAL };
enum Norm { NORM_LLAMA, NORM_SCALED_IN_FLOAT32, NORM_LAYER };  // NORM_LAYER: W_*_NORM_BIAS its biases
// ACT_*_PLAIN: the un-gated MLP (W_GATE_UP is fc1, [I, H]; W_DOWN fc2).
enum Activation { ACT_SILU, ACT_GELU_TANH, ACT_GELU_TANH_PLAIN, ACT_GELU_ERF_PLAIN, ACT_RELU_PLAIN,
                  ACT_RELU2_PLAIN };
// Attention and MLP side by side: added together, then into the stream ((A + M) + S: Phi,
// GPT-NeoX), or the attention's output into the stream first ((S + A) + M: StableLM).
enum Parallel { IN_TURN, BLOCKS_FIRST, STREAM_FIRST };
// A layer's four matmuls, in the order of the LoRA table's projections.
enum Projection { P_QKV, P_O, P_GATE_UP, P_DOWN, NUM_PROJECTIONS };
constexpr int PAIRED_KERNEL = 2;  // paged_attention.cpp's code for a bf16 cache in the paired layout

// Scratch elements (bf16) of a walk of `tokens` rows: normed, qkv, q rows, attention
// output, gate_up, the activation and a parallel layer's MLP output.
// A hybrid's state layers take mixer_width more per row (StateLayers::scratch_width) and 16 to
// align a Mamba2 mixer's float32 rows.
// A mixture-of-experts model's layers take moe_width more per row (MoeShape::scratch_width)
// and 32 to align their 64-bit arrays; a latent-attention model's, latent_width (LatentShape::scratch_width).
inline int64_t scratch_elements(int64_t tokens, int64_t hidden_size, int64_t q_size, int64_t kv_size,
                                int64_t intermediate, int64_t mixer_width, int64_t moe_width, int64_t latent_width) {
  return tokens * (2 * hidden_size + (q_size + 2 * kv_size) + 2 * q_size + 3 * intermediate + mixer_width +
                   moe_width + latent_width) +
         (mixer_width > 0 ? 16 : 0) + (moe_width > 0 ? 32 : 0);
}

// A latent-attention model's layers (DeepSeek's MLA, one shape for all; models/deepseek.py's
// LatentAttention is the module path): `heads` query heads of nope + rope dimensions, a latent of
// rank + rope numbers per token (the pool's entry: the normed latent, then the rotated shared key
// part), each head's value `v` wide; q_rank > 0 where the query goes through q_a_proj and its norm
// first. interleaved: the rotary's pairs adjacent (de-interleaved as it turns them); products:
// latent_attention.cpp's Products; uk_stride, uv_stride: bf16 elements from one head's packed
// up-projection to the next's; eps: the latent's and q_a's norms'.
struct LatentShape {
  int64_t heads, rank, rope, nope, v, q_rank, interleaved, products, uk_stride, uv_stride;
  float eps;

  int64_t dim() const { return rank + rope; }  // a latent, and a query vector in latent space
  int64_t q_width() const { return heads * (nope + rope); }
  // bf16 elements per row: the latent's projection, its part to norm and the norm's output, the
  // shared key part and its rotation; q_a's output and its norm; the query
  // projection; two head-major buffers (each head's rows for the grouped GEMM, in and out); the
  // rotary part gathered and turned; the query in latent space; the attention's output; the
  // heads' values, token-major.
  int64_t scratch_width() const {
    const int64_t head_major = heads * std::max({nope, rank, v});
    return dim() + 2 * rank + 2 * rope + 2 * q_rank + q_width() + 2 * head_major + 2 * heads * rope +
           heads * dim() + heads * rank + heads * v;
  }
};

// A mixture-of-experts model's routed experts (one shape for every such layer): kvloom::moe_route's
// rule (the top_k of a softmax, or of sigmoid scores, each plus the layer's selection bias if it
// has one; renormalised where norm, with eps added to the sum; times scaling; rounded to bf16
// where round_weights; DeepSeek's group-limited choice where group_rule is not 0: the top_k from the
// topk_groups best of num_groups groups, cpu_ops.cpp's GroupRule) and the experts' SwiGLU of inter
// features (or, where not gated, up alone through ReLU squared, and a shared expert likewise through
// the model's un-gated activation: Nemotron 3's). router_float32: the router's weight is float32 and
// its logits kvloom::router_logits' (DeepSeek's), else a packed bf16 GEMM's.
struct MoeShape {
  int64_t num_experts, top_k, inter;
  int64_t gate_up_stride, down_stride;  // bf16 elements from one expert's packed weight to the next's
  int64_t norm, round_weights, sigmoid, router_float32, num_groups, topk_groups, group_rule;
  int64_t gated;  // 1: SwiGLU experts (gate | up); 0: up alone through ReLU squared (Nemotron 3's)
  // The rank's experts [first_expert, first_expert + local_experts) under expert parallel (the packed
  // weights hold those alone; the others' pairs are left out, as models/moe.py's experts_grouped
  // leaves them); else 0 and num_experts.
  int64_t first_expert, local_experts;
  float scaling, eps;

  // Elements (bf16) per row: each of its top_k pairs' expert, row and place in the grouped
  // order (int64: 4 each), routing weight and pair weight (float32: 2 each); the router's
  // logits (room for float32); and each pair's input, gate/up, activation and output rows.
  int64_t scratch_width(int64_t hidden_size) const {
    return top_k * (3 * 4 + 2 * 2) + 2 * num_experts + top_k * (2 * hidden_size + 3 * inter);
  }
};

// A hybrid's state layers' sizes (one per model).
struct StateLayers {
  int64_t inter, conv_dim, heads, head_dim, d_state, groups, kernel;  // the Mamba2 mixers' (heads 0: none)
  int64_t short_kernel;  // LFM2's short convolutions' taps (0: none); their channels are the hidden size
  int64_t num_slots;
  float dt_lo, dt_hi, eps;

  int64_t in_width() const { return inter + conv_dim + heads; }  // a mixer's in_proj output
  // bf16 elements per row: a mixer's in_proj output, convolved xBC, norm output and scan
  // output (float32: two each); a short convolution's in_proj output (B, C, x), B * x and output.
  int64_t scratch_width(int64_t hidden_size) const {
    return std::max(heads > 0 ? in_width() + conv_dim + inter + 2 * inter : 0,
                    short_kernel > 0 ? 5 * hidden_size : 0);
  }
};

// Scratch elements (bf16) of LoRA's buffers for `tokens` rows: the gathered inputs, the
// shrunk rows (the widest shrink) and the deltas.
inline int64_t lora_scratch_elements(int64_t tokens, int64_t hidden_size, int64_t q_size, int64_t kv_size,
                                     int64_t intermediate, int64_t max_width) {
  const int64_t widest_in = std::max({hidden_size, q_size, intermediate});
  const int64_t widest_out = std::max({q_size + 2 * kv_size, hidden_size, 2 * intermediate});
  return tokens * (widest_in + max_width + widest_out);
}

template <class T>
T entry(const int64_t* kernels, Kernel which) { return reinterpret_cast<T>(kernels[which]); }
inline const uint16_t* weight(const int64_t* row, Weight which) {
  return reinterpret_cast<const uint16_t*>(row[which]);  // 0 (a missing bias) is nullptr
}

// What every walk of a call shares: the model and its cache.
struct Model {
  const int64_t* kernels;
  const int64_t* weights;
  int64_t num_layers;
  uint16_t* kv_caches;
  int64_t num_blocks, max_blocks, hidden_size, num_heads, num_kv_heads, head_dim, intermediate, block_size;
  int64_t rotary_dim;  // each head's dimensions the rotary turns (head_dim, or Phi-4's part): cos/sin's width
  float eps, scale, residual_scale;
  float softcap;       // the attention scores' cap (Gemma 2's; 0: none)
  int norm;            // Norm: how every RMSNorm scales
  float norm_offset;   // NORM_SCALED_IN_FLOAT32's offset (Gemma's 1, Helium's 0)
  int activation;      // Activation: the gated MLP's
  int qk_norm_whole;   // 1: W_Q_NORM and W_K_NORM norm each token's whole q and k (OLMo 2), 0: each head
  int parallel;        // Parallel: attention and MLP side by side, and the order of their adds
  float clip;          // OLMo 1's clip_qkv: q, k and v clamped to [-clip, clip] (0: none)
  int isa;
  int64_t* reduce;  // nullptr, or the tensor-parallel all-reduce's context
  int64_t kv_prefetch_bytes;  // of a layer's KV a walk fetches ahead (0: none)
  // LoRA (nullptr: none): [num_layers, NUM_PROJECTIONS, lora_slots, 2] packed shrink and
  // expand weights (0, 0 where the slot's adapter leaves that projection alone), and each
  // projection's shrink width (its parts x the largest rank).
  const int64_t* lora_weights;
  int64_t lora_slots;
  const int64_t* lora_widths;
  const StateLayers* states;  // nullptr: no state layer
  const MoeShape* moe;        // nullptr: no mixture-of-experts layer
  const LatentShape* latent;  // nullptr: no latent-attention layer

  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
  int64_t scratch(int64_t tokens) const {
    return scratch_elements(tokens, hidden_size, q_size(), kv_size(), intermediate,
                            states != nullptr ? states->scratch_width(hidden_size) : 0,
                            moe != nullptr ? moe->scratch_width(hidden_size) : 0,
                            latent != nullptr ? latent->scratch_width() : 0);
  }
  int64_t lora_scratch(int64_t tokens) const {
    if (lora_weights == nullptr) return 0;
    const int64_t widest = *std::max_element(lora_widths, lora_widths + NUM_PROJECTIONS);
    return lora_scratch_elements(tokens, hidden_size, q_size(), kv_size(), intermediate, widest);
  }
};

// Granite's residual multiplier on `count` bf16 values, in place (nothing to do at 1).
void scale_hidden(uint16_t* x, int64_t count, float s, int num_threads) {
  if (s == 1.0f) return;
#pragma omp parallel for schedule(static) num_threads(count > 65536 ? num_threads : 1)
  for (int64_t i = 0; i < count; ++i) kvloom_simd::from_float(kvloom_simd::to_float(x[i]) * s, x + i);
}

// One walk's rows: consecutive tokens of the batch and the sequences they belong to.
// query_start is relative to the walk's first token.
// A walk's requests as its state layers read them (one per sequence, in order).
struct Spans {
  const int64_t* starts;  // [n] each request's first row (relative to the walk's first), its row count, its slot
  const int64_t* lengths;
  const int64_t* slots;
  const int32_t* has_state;  // [n] 1: the chunk continues the slot's state
  int64_t n;
};

struct Rows {
  uint16_t* residual;
  uint16_t* hidden;
  uint16_t* scratch;
  const float* cos;
  const float* sin;
  const float* cos_local;  // Gemma 3's windowed layers' table (ROPE_LOCAL), nullptr where none
  const float* sin_local;
  const int64_t* slots;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* query_lens;
  int64_t num_seqs, tokens;
  const int32_t* lora_slots;  // each row's adapter slot, -1 the base model (with Model::lora_weights)
  uint16_t* lora_scratch;     // Model::lora_scratch(tokens) elements
  Spans spans;                // with Model::states
};

// The rows whose final state the caller reads (their last-layer work is all that is
// done; count < 0: every row). rows: ascending token indices (nullptr: rows 0 to
// count - 1); the sequences that own them, as the attention reads them: the kept rows
// are the last query_lens[s] rows of each such sequence (query_start relative to the
// kept rows).
struct Outputs {
  const int64_t* rows;
  int64_t count;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* query_lens;
  int64_t num_seqs;
};
constexpr Outputs EVERY_ROW{nullptr, -1, nullptr, nullptr, nullptr, nullptr, 0};

// One layer's KV blocks of a walk's sequences as a side stream (side_stream.h): a
// block's K (then its V) for every kv head is one span, up to the byte budget. The
// down projection of the layer before fetches the first part, the layer's own qkv
// projection the rest, in proportion to their weights (their steps).
class KvAhead {
 public:
  KvAhead(const Model& m, const Rows& r) : m_(m), r_(r) {}

  // Plans the fetch of `layer`'s KV (none past the last layer or without a budget).
  void plan(int64_t layer) {
    down_ = qkv_ = SideStream{nullptr, 0, 0, 0};
    if (m_.kv_prefetch_bytes <= 0 || layer >= m_.num_layers) return;
    const int64_t* w = m_.weights + layer * NUM_WEIGHTS;
    if (w[W_MIXER] != MIXER_ATTENTION) return;  // no KV to fetch
    const int64_t block_bytes = m_.block_size * m_.kv_size() * 2, span_lines = block_bytes / 64;
    const int64_t half_bytes = m_.num_blocks * block_bytes;  // K's (or V's) bytes in one layer
    const char* k_cache = reinterpret_cast<const char*>(m_.kv_caches) + w[W_KV_LAYER] * 2 * half_bytes;
    const int64_t budget_spans = (m_.kv_prefetch_bytes + block_bytes - 1) / block_bytes;
    spans_.clear();
    for (int64_t s = 0; s < r_.num_seqs && static_cast<int64_t>(spans_.size()) < budget_spans; ++s) {
      const int32_t* table = r_.block_tables + s * m_.max_blocks;
      for (int64_t b = 0; b < (r_.seq_lens[s] + m_.block_size - 1) / m_.block_size; ++b) {
        spans_.push_back(k_cache + table[b] * block_bytes);
        spans_.push_back(k_cache + half_bytes + table[b] * block_bytes);
      }
    }
    if (spans_.empty()) return;
    const int64_t lines = std::min<int64_t>(budget_spans, spans_.size()) * span_lines;
    spans_.push_back(spans_.front());  // the extra entry side_stream.h asks for
    const int64_t down = m_.intermediate * m_.hidden_size, qkv = (m_.q_size() + 2 * m_.kv_size()) * m_.hidden_size;
    const int64_t split = lines * down / (down + qkv);
    down_ = {spans_.data(), span_lines, 0, split};
    qkv_ = {spans_.data(), span_lines, split, lines};
  }
  const SideStream* down() const { return down_.last > down_.first ? &down_ : nullptr; }
  const SideStream* qkv() const { return qkv_.last > qkv_.first ? &qkv_ : nullptr; }

 private:
  const Model& m_;
  const Rows& r_;
  std::vector<const char*> spans_;
  SideStream down_{nullptr, 0, 0, 0}, qkv_{nullptr, 0, 0, 0};
};

// The layers over one walk's rows with `num_threads` threads in each kernel; the last
// layer's attention and everything after it only over `out`'s rows (all of them when
// out.count < 0), which end up first in r.residual and r.hidden.
int walk(const Model& m, const Rows& r, int num_threads, const Outputs& out = EVERY_ROW) {
  const auto llama_norm = entry<RmsNormFn>(m.kernels, K_RMS_NORM);
  const auto scaled_norm = entry<ScaledNormFn>(m.kernels, K_RMS_NORM_SCALED);
  const auto layer_norm = entry<LayerNormFn>(m.kernels, K_LAYER_NORM);
  const auto clamp = entry<ClampFn>(m.kernels, K_CLAMP);
  const auto gemm = entry<GemmFn>(m.kernels, K_GEMM);
  const auto rotary = entry<RotaryFn>(m.kernels, K_ROTARY);
  const auto write_kv = entry<WriteKvFn>(m.kernels, K_WRITE_KV);
  const auto attention = entry<AttentionFn>(m.kernels, K_ATTENTION);
  const Kernel activation_kernel = m.activation == ACT_GELU_TANH ? K_GELU_TANH
                                   : m.activation == ACT_GELU_TANH_PLAIN ? K_GELU_TANH_PLAIN
                                   : m.activation == ACT_GELU_ERF_PLAIN ? K_GELU_ERF_PLAIN
                                   : m.activation == ACT_RELU_PLAIN ? K_RELU_PLAIN
                                   : m.activation == ACT_RELU2_PLAIN ? K_RELU2_PLAIN : K_SILU;
  const auto activation = entry<SiluFn>(m.kernels, activation_kernel);
  const bool gated = m.activation == ACT_SILU || m.activation == ACT_GELU_TANH;
  const auto all_reduce = entry<AllReduceFn>(m.kernels, K_ALL_REDUCE);
  const auto add_rows = entry<AddRowsFn>(m.kernels, K_ADD_ROWS);

  // The model's norm: residual (nullptr: none) += x, then the norm of it into out (bias:
  // a LayerNorm's, read by NORM_LAYER alone).
  const auto rms_norm = [&](const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out_rows,
                            int64_t rows, int64_t n, const uint16_t* bias = nullptr) {
    if (m.norm == NORM_SCALED_IN_FLOAT32) scaled_norm(x, residual, w, out_rows, rows, n, m.eps, m.norm_offset);
    else if (m.norm == NORM_LAYER) layer_norm(x, residual, w, bias, out_rows, rows, n, m.eps);
    else llama_norm(x, residual, w, out_rows, rows, n, m.eps);
  };
  int64_t T = r.tokens;  // the rows each kernel computes: the kept ones in the last layer
  const int64_t H = m.hidden_size, I = m.intermediate;  // I: the widest MLP's features (the scratch's)
  const int64_t q_size = m.q_size(), kv_size = m.kv_size(), qkv_width = q_size + 2 * kv_size;
  uint16_t* normed = r.scratch;                // [T, H]
  uint16_t* qkv = normed + T * H;              // [T, q + 2 kv]
  uint16_t* q_rows = qkv + T * qkv_width;      // [T, q]
  uint16_t* attn = q_rows + T * q_size;        // [T, q]
  uint16_t* gate_up = attn + T * q_size;       // [T, 2 I]
  uint16_t* act = gate_up + T * 2 * I;         // [T, I]
  uint16_t* mlp_out = act + T * I;             // [T, H]: a parallel layer's MLP output
  // A latent-attention layer's (LatentShape::scratch_width, laid out in latent_block).
  uint16_t* latent_room = mlp_out + T * H;
  // A state layer's: its in_proj output, then (a Mamba2 mixer) the convolved xBC, the norm's
  // output and the scan's (float32, 32-byte aligned), or (a short convolution) B * x and its output.
  uint16_t* proj = latent_room + (m.latent != nullptr ? T * m.latent->scratch_width() : 0);
  // A mixture-of-experts layer's: past the state layers' room, 64-byte aligned (MoeShape::scratch_width).
  const int64_t mixer_width = m.states != nullptr ? m.states->scratch_width(H) : 0;
  char* const moe_room = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(proj + T * mixer_width + (mixer_width > 0 ? 16 : 0)) + 63) & ~uintptr_t{63});
  const auto grouped_gemm = entry<GroupedGemmFn>(m.kernels, K_GEMM_GROUPED);
  const auto moe_route = entry<MoeRouteFn>(m.kernels, K_MOE_ROUTE);
  const auto moe_combine = entry<MoeCombineFn>(m.kernels, K_MOE_COMBINE);
  const auto router_logits = entry<RouterLogitsFn>(m.kernels, K_ROUTER_LOGITS);
  const auto moe_route_f32 = entry<MoeRouteF32Fn>(m.kernels, K_MOE_ROUTE_F32);
  const auto silu = entry<SiluFn>(m.kernels, K_SILU);  // gated experts' activation, whatever the dense MLPs'
  const auto relu2 = entry<SiluFn>(m.kernels, K_RELU2_PLAIN);  // un-gated experts' (Nemotron 3's)
  const auto sigmoid_gate = entry<SigmoidGateFn>(m.kernels, K_SIGMOID_GATE);
  const auto mamba_mixer = entry<MambaMixerFn>(m.kernels, K_MAMBA_MIXER);
  const auto short_conv = entry<ShortConvFn>(m.kernels, K_SHORT_CONV);
  uint16_t* hidden = r.hidden;
  const int64_t half_cache = m.num_blocks * m.block_size * kv_size;  // K's (or V's) elements in one layer
  KvAhead ahead(m, r);
  ahead.plan(0);  // layer 0's own qkv projection fetches its share
  const Outputs all_rows{nullptr, T, r.block_tables, r.seq_lens, r.query_start, r.query_lens, r.num_seqs};
  // LoRA: each slot's rows, ascending; after the last layer's rows are narrowed to
  // `out`'s, each slot's kept rows at their new places.
  std::vector<std::vector<int64_t>> adapter_rows(m.lora_weights != nullptr ? m.lora_slots : 0);
  const auto group_rows = [&](const Outputs& kept) {
    for (std::vector<int64_t>& rows : adapter_rows) rows.clear();
    for (int64_t i = 0; i < kept.count && m.lora_weights != nullptr; ++i) {
      const int32_t slot = r.lora_slots[kept.rows != nullptr ? kept.rows[i] : i];
      if (slot >= 0) adapter_rows[slot].push_back(i);
    }
  };
  group_rows(all_rows);
  // Each of `heads` heads from column `offset` of every qkv row RMS-normed with `norm`,
  // over head_dim (or, qk_norm_whole, all `heads` of a row as one): the heads gathered into
  // one [T, heads * head_dim] block (attn's room, free until the attention), normed into
  // q_rows' room (free until the q rows are copied there), scattered back; rms_norm
  // computes a row on its own, so each head's bits are the module path's, which norms the
  // same rows gathered by reshape.
  const auto norm_heads = [&](uint16_t* rows, int64_t offset, int64_t heads, const uint16_t* norm) {
    const int64_t width = heads * m.head_dim, n = m.qk_norm_whole ? width : m.head_dim;
    for (int64_t t = 0; t < T; ++t) std::memcpy(attn + t * width, rows + t * qkv_width + offset, width * 2);
    rms_norm(attn, nullptr, norm, q_rows, T * width / n, n);
    for (int64_t t = 0; t < T; ++t) std::memcpy(rows + t * qkv_width + offset, q_rows + t * width, width * 2);
  };

  // A mixture-of-experts FFN over T rows of x into out ([T, H]), as models/moe.py's SparseMoE
  // computes it: the router's logits, kvloom::moe_route's top_k a row, the (row, choice) pairs
  // sorted by expert (then choice, then row: the module path's order), every expert's rows
  // through its gate/up and down weights in two grouped calls with the activation between,
  // and each row's weighted outputs added in ascending expert order. False: a GEMM refused.
  const auto moe_ffn = [&](const int64_t* w, const uint16_t* x, uint16_t* out) {
    const MoeShape& e = *m.moe;
    const int64_t E = e.num_experts, K = e.top_k, P = T * K, EI = e.inter;
    const int64_t L = e.local_experts, first = e.first_expert;  // the rank's experts
    const auto local = [&](int64_t expert) {  // its place among the rank's, or -1: another rank's
      const int64_t index = expert - first;
      return index >= 0 && index < L ? index : int64_t{-1};
    };
    int64_t* experts = reinterpret_cast<int64_t*>(moe_room);  // [T, K]
    int64_t* pair_row = experts + P;                          // [P]: each grouped pair's row
    int64_t* row_pairs = pair_row + P;                        // [T, K]: a row's pairs' places, ascending expert
    float* weights = reinterpret_cast<float*>(row_pairs + P);  // [T, K]
    float* pair_weights = weights + P;                          // [P]
    uint16_t* logits = reinterpret_cast<uint16_t*>(pair_weights + P);  // [T, E] (float32 where router_float32)
    uint16_t* rows = logits + 2 * T * E;                               // [P, H]
    uint16_t* up = rows + P * H;                                       // [P, 2 EI]
    uint16_t* between = up + P * 2 * EI;                               // [P, EI]
    uint16_t* y = between + P * EI;                                    // [P, H]
    const float* selection_bias = reinterpret_cast<const float*>(w[W_ROUTER_BIAS]);
    if (e.router_float32) {  // DeepSeek's: the float32 weight, float32 logits
      float* float_logits = reinterpret_cast<float*>(logits);
      router_logits(x, reinterpret_cast<const float*>(w[W_ROUTER]), float_logits, T, E, H);
      if (moe_route_f32(float_logits, selection_bias, weights, experts, T, E, K, e.sigmoid, e.norm, e.eps, e.scaling,
                        e.round_weights, e.num_groups, e.topk_groups, e.group_rule) != 0)
        return false;
    } else {
      if (gemm(x, weight(w, W_ROUTER), nullptr, logits, T, E, H, m.isa, num_threads, nullptr) != 0) return false;
      if (moe_route(logits, selection_bias, weights, experts, T, E, K, e.sigmoid, e.norm, e.eps, e.scaling,
                    e.round_weights, e.num_groups, e.topk_groups, e.group_rule) != 0)
        return false;
    }
    std::vector<int64_t> starts(L + 1, 0);
    for (int64_t i = 0; i < P; ++i)
      if (local(experts[i]) >= 0) ++starts[local(experts[i]) + 1];
    for (int64_t g = 0; g < L; ++g) starts[g + 1] += starts[g];
    const int64_t kept = starts[L];  // the pairs this rank computes (all of them without expert parallel)
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t j = 0; j < K; ++j)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t expert = local(experts[t * K + j]);
        if (expert < 0) {  // another rank's: no row here (moe_combine skips it)
          row_pairs[t * K + j] = -1;
          continue;
        }
        const int64_t p = next[expert]++;
        row_pairs[t * K + j] = p;
        pair_row[p] = t;
        pair_weights[p] = weights[t * K + j];
      }
    for (int64_t p = 0; p < kept; ++p) std::memcpy(rows + p * H, x + pair_row[p] * H, H * sizeof(uint16_t));
    if (kept > 0) {
      if (grouped_gemm(rows, weight(w, W_EXPERTS_GATE_UP), starts.data(), up, L, kept, (e.gated ? 2 : 1) * EI, H,
                       e.gate_up_stride, m.isa, num_threads) != 0)
        return false;
      (e.gated ? silu : relu2)(up, between, kept, EI);
      if (grouped_gemm(between, weight(w, W_EXPERTS_DOWN), starts.data(), y, L, kept, H, EI, e.down_stride, m.isa,
                       num_threads) != 0)
        return false;
    }
    for (int64_t t = 0; t < T; ++t)  // places grow with the expert: sorted places are ascending experts
      std::sort(row_pairs + t * K, row_pairs + (t + 1) * K);
    moe_combine(y, pair_weights, row_pairs, out, T, K, H);
    return true;
  };

  const auto latent_rotary = entry<LatentRotaryFn>(m.kernels, K_LATENT_ROTARY);
  const auto latent_attention = entry<LatentAttentionFn>(m.kernels, K_LATENT_ATTENTION);
  // DeepSeek's latent attention over T rows of `normed` into `hidden`, as models/deepseek.py's
  // LatentAttention.forward computes it, its kernels on its values:
  //   kv      = normed @ Wkv_a                      [T, rank + rope]
  //   latent  = [rms_norm(kv[:rank]) | latent_rotary(kv[rank:])]  into the pool at the rows' slots
  //   q       = (normed, or rms_norm(normed @ Wq_a)) @ Wq        [T, heads, nope + rope]
  //   query   = [q_nope @ W_uk (each head's, one grouped GEMM: heads as the groups) |
  //              latent_rotary(q_pe)]                             [T, heads, rank + rope]
  //   attn    = latent_attention(query)            [T, heads, rank]
  //   hidden  = (attn @ W_uv, each head's, one grouped GEMM) @ Wo   [T, H]
  // The grouped GEMM takes a group's rows together, so each head's rows are gathered head after
  // head (and its outputs scattered back), as the module path's transposes do. In the last layer
  // the rows `kept` names alone take the attention and what follows (every row's latent is
  // written first). Returns 0 (T == 0 after: no row is read), 1 + the layer where a GEMM refused,
  // or LATENT_REFUSED.
  const auto latent_block = [&](const int64_t* w, int64_t layer, const Outputs& kept) -> int {
    const LatentShape& a = *m.latent;
    const int64_t heads = a.heads, rank = a.rank, rope = a.rope, nope = a.nope, L = a.dim(), qw = a.q_width();
    const int64_t head_major = heads * std::max({nope, rank, a.v});
    uint16_t* kv = latent_room;                       // [T, L]
    uint16_t* c_kv = kv + T * L;                      // [T, rank]: the part normed
    uint16_t* c_normed = c_kv + T * rank;             // [T, rank]
    uint16_t* k_pe = c_normed + T * rank;             // [T, rope]: the key's rotary part
    uint16_t* k_turned = k_pe + T * rope;             // [T, rope]
    uint16_t* qa = k_turned + T * rope;              // [T, q_rank]
    uint16_t* qa_normed = qa + T * a.q_rank;          // [T, q_rank]
    uint16_t* q = qa_normed + T * a.q_rank;           // [T, heads (nope + rope)]
    uint16_t* by_head = q + T * qw;                   // [heads T, <= head_major / heads]: a grouped GEMM's rows
    uint16_t* by_head_out = by_head + T * head_major;  // its output
    uint16_t* q_pe = by_head_out + T * head_major;     // [T, heads, rope]
    uint16_t* q_turned = q_pe + T * heads * rope;      // [T, heads, rope]
    uint16_t* query = q_turned + T * heads * rope;     // [T, heads, L]
    uint16_t* attended = query + T * heads * L;        // [T, heads, rank]
    uint16_t* values = attended + T * heads * rank;    // [T, heads v]
    const int refused = static_cast<int>(layer) + 1;
    const auto project = [&](const uint16_t* x, Weight which, uint16_t* y, int64_t n, int64_t k) {
      return gemm(x, weight(w, which), nullptr, y, T, n, k, m.isa, num_threads, nullptr) == 0;
    };
    std::vector<int64_t> starts(heads + 1);
    const auto per_head = [&](Weight which, int64_t n, int64_t k, int64_t stride) {  // by_head -> by_head_out
      for (int64_t h = 0; h <= heads; ++h) starts[h] = h * T;
      return grouped_gemm(by_head, weight(w, which), starts.data(), by_head_out, heads, heads * T, n, k, stride,
                          m.isa, num_threads) == 0;
    };
    if (!project(normed, W_KV_A, kv, L, H)) return refused;
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(c_kv + t * rank, kv + t * L, rank * sizeof(uint16_t));
      std::memcpy(k_pe + t * rope, kv + t * L + rank, rope * sizeof(uint16_t));
    }
    latent_rotary(k_pe, k_turned, r.cos, r.sin, T, 1, rope, static_cast<int>(a.interleaved), 1);
    llama_norm(c_kv, nullptr, weight(w, W_KV_A_NORM), c_normed, T, rank, a.eps);
    uint16_t* pool = m.kv_caches + w[W_KV_LAYER] * m.num_blocks * m.block_size * L;  // [blocks, block_size, L]
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(pool + r.slots[t] * L, c_normed + t * rank, rank * sizeof(uint16_t));
      std::memcpy(pool + r.slots[t] * L + rank, k_turned + t * rope, rope * sizeof(uint16_t));
    }
    const uint16_t* q_in = normed;
    if (a.q_rank > 0) {
      if (!project(normed, W_Q_A, qa, a.q_rank, H)) return refused;
      llama_norm(qa, nullptr, weight(w, W_Q_A_NORM), qa_normed, T, a.q_rank, a.eps);
      q_in = qa_normed;
    }
    if (!project(q_in, W_QKV, q, qw, a.q_rank > 0 ? a.q_rank : H)) return refused;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const uint16_t* head = q + t * qw + h * (nope + rope);
        std::memcpy(by_head + (h * T + t) * nope, head, nope * sizeof(uint16_t));
        std::memcpy(q_pe + (t * heads + h) * rope, head + nope, rope * sizeof(uint16_t));
      }
    if (!per_head(W_HEADS_UK, rank, nope, a.uk_stride)) return refused;
    latent_rotary(q_pe, q_turned, r.cos, r.sin, T, heads, rope, static_cast<int>(a.interleaved), 1);
    // From the attention on, the rows computed: every row, or in the last layer the rows read,
    // their query vectors and stream moved to the front (ascending: moved no later than read).
    const Outputs& rows = layer + 1 == m.num_layers && kept.count >= 0 ? kept : all_rows;
    for (int64_t i = 0; i < rows.count; ++i) {
      const int64_t t = rows.rows != nullptr ? rows.rows[i] : i;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* vector = query + (i * heads + h) * L;
        std::memcpy(vector, by_head_out + (h * T + t) * rank, rank * sizeof(uint16_t));
        std::memcpy(vector + rank, q_turned + (t * heads + h) * rope, rope * sizeof(uint16_t));
      }
      if (t != i) std::memcpy(r.residual + i * H, r.residual + t * H, H * sizeof(uint16_t));
    }
    T = rows.count;
    if (T == 0) return 0;  // no row read: the latents are written, nothing more to compute
    if (latent_attention(query, attended, pool, rows.block_tables, m.max_blocks, rows.seq_lens, rows.query_start,
                         rows.query_lens, rows.num_seqs, heads, L, rank, m.block_size, m.scale, 1,
                         static_cast<int>(a.products), num_threads) != 0)
      return LATENT_REFUSED;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(by_head + (h * T + t) * rank, attended + (t * heads + h) * rank, rank * sizeof(uint16_t));
    if (!per_head(W_HEADS_UV, a.v, rank, a.uv_stride)) return refused;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(values + (t * heads + h) * a.v, by_head_out + (h * T + t) * a.v, a.v * sizeof(uint16_t));
    return gemm(values, weight(w, W_O), weight(w, W_O_BIAS), hidden, T, H, heads * a.v, m.isa, num_threads,
                nullptr) == 0 ? 0 : refused;
  };

  for (int64_t layer = 0; layer < m.num_layers; ++layer) {
    const int64_t* w = m.weights + layer * NUM_WEIGHTS;
    uint16_t* k_cache = m.kv_caches + w[W_KV_LAYER] * 2 * half_cache;
    uint16_t* v_cache = k_cache + half_cache;
    // A GEMM that refuses the path ends the walk: 1 + the layer (nothing after it runs).
    const auto matmul = [&](const uint16_t* x, Weight which, Weight bias, uint16_t* y, int64_t n, int64_t k,
                            const SideStream* side = nullptr) {
      return gemm(x, weight(w, which), weight(w, bias), y, T, n, k, m.isa, num_threads, side) == 0;
    };
    // LoRA: y[rows of slot s] += ((x A_s^T) B_s^T)[those rows], each slot in turn, as
    // LoRALinear.forward: a run of rows read and written in place, other rows gathered.
    const auto adapt = [&](Projection which, const uint16_t* x, int64_t k, uint16_t* y, int64_t n) {
      for (int64_t slot = 0; slot < static_cast<int64_t>(adapter_rows.size()); ++slot) {
        const std::vector<int64_t>& rows = adapter_rows[slot];
        const int64_t* pair = m.lora_weights + ((layer * NUM_PROJECTIONS + which) * m.lora_slots + slot) * 2;
        if (rows.empty() || pair[0] == 0) continue;
        const int64_t count = static_cast<int64_t>(rows.size()), width = m.lora_widths[which];
        const bool run = rows.back() - rows.front() + 1 == count;
        uint16_t* gathered = r.lora_scratch;
        uint16_t* shrunk = gathered + count * k;
        uint16_t* delta = shrunk + count * width;
        const uint16_t* in = x + rows.front() * k;
        if (!run) {
          for (int64_t i = 0; i < count; ++i) std::memcpy(gathered + i * k, x + rows[i] * k, k * sizeof(uint16_t));
          in = gathered;
        }
        if (gemm(in, reinterpret_cast<const uint16_t*>(pair[0]), nullptr, shrunk, count, width, k, m.isa,
                 num_threads, nullptr) != 0 ||
            gemm(shrunk, reinterpret_cast<const uint16_t*>(pair[1]), nullptr, delta, count, n, width, m.isa,
                 num_threads, nullptr) != 0)
          return false;
        if (run) add_rows(y + rows.front() * n, delta, nullptr, count, n);
        else add_rows(y, delta, rows.data(), count, n);
      }
      return true;
    };
    const int refused = static_cast<int>(layer) + 1;
    const bool mlp_only = w[W_MIXER] == MIXER_NONE;  // Nemotron-H's MLP block on its own
    // OLMo 2's layer: the stream goes in as it is
    const bool post_norms = weight(w, W_INPUT_NORM) == nullptr && !mlp_only;
    const uint16_t* attention_in = post_norms ? r.residual : normed;
    if (mlp_only) {  // no block: the layer before's output joins the stream at the MLP's norm
      if (layer + 1 == m.num_layers && out.count >= 0) {  // the rows read alone, moved to the front
        for (int64_t i = 0; i < out.count; ++i) {
          const int64_t t = out.rows != nullptr ? out.rows[i] : i;  // >= i (ascending)
          if (t == i) continue;
          if (layer > 0) std::memcpy(hidden + i * H, hidden + t * H, H * sizeof(uint16_t));
          std::memcpy(r.residual + i * H, r.residual + t * H, H * sizeof(uint16_t));
        }
        group_rows(out);
        T = out.count;
        if (T == 0) return 0;
      }
    } else {
      if (layer > 0) scale_hidden(hidden, T * H, m.residual_scale, num_threads);
      if (post_norms) {
        if (layer > 0) add_rows(r.residual, hidden, nullptr, T, H);
      } else {
        rms_norm(layer == 0 ? r.residual : hidden, layer == 0 ? nullptr : r.residual, weight(w, W_INPUT_NORM),
                 normed, T, H, weight(w, W_INPUT_NORM_BIAS));
      }
      if (w[W_MIXER] == MIXER_LATENT) {  // DeepSeek's latent attention
        if (m.latent == nullptr) return LATENT_REFUSED;  // no sizes given
        const int status = latent_block(w, layer, out);
        if (status != 0) return status;
        if (T == 0) return 0;
        if (m.reduce != nullptr) {  // the ranks' heads' partial sums of o_proj, as LatentAttention's all-reduce
          const int reduced = all_reduce(m.reduce, hidden, T * H);
          if (reduced != 0) return reduced;
        }
      } else if (w[W_MIXER] != MIXER_ATTENTION) {  // a state layer's block: every row (the states move on)
        if (m.states == nullptr) return MIXER_REFUSED;  // no sizes given
        const StateLayers& st = *m.states;
        const Spans& sp = r.spans;
        const bool mamba = w[W_MIXER] == MIXER_MAMBA;
        const int64_t in_width = mamba ? st.in_width() : 3 * H, width = mamba ? st.inter : H;
        uint16_t* between = proj + T * in_width;  // xBC, or B * x
        uint16_t* mixed = between + T * (mamba ? st.conv_dim : H);
        if (!matmul(attention_in, W_QKV, W_QKV_BIAS, proj, in_width, H)) return refused;
        const auto f32 = [&](Weight which) { return reinterpret_cast<const float*>(w[which]); };
        uint16_t* conv_state = reinterpret_cast<uint16_t*>(w[W_CONV_STATE]);
        if (mamba) {
          float* scan_out = reinterpret_cast<float*>(
              (reinterpret_cast<uintptr_t>(mixed + T * width) + 31) & ~uintptr_t{31});
          if (mamba_mixer(proj, f32(W_CONV_WEIGHT), f32(W_CONV_BIAS), conv_state,
                          reinterpret_cast<float*>(w[W_SSM_STATE]), f32(W_DT_BIAS), f32(W_A_LOG), f32(W_D),
                          weight(w, W_MIXER_NORM), sp.starts, sp.lengths, sp.slots, sp.has_state, between, scan_out,
                          mixed, sp.n, st.num_slots, T, st.inter, st.conv_dim, st.heads, st.head_dim, st.d_state,
                          st.groups, st.kernel, st.dt_lo, st.dt_hi, st.eps, num_threads) != 0)
            return MIXER_REFUSED;
        } else if (short_conv(proj, f32(W_CONV_WEIGHT), f32(W_CONV_BIAS), conv_state, sp.starts, sp.lengths, sp.slots,
                              sp.has_state, between, mixed, sp.n, st.num_slots, T, H, st.short_kernel,
                              num_threads) != 0) {
          return MIXER_REFUSED;
        }
        // The last layer: out_proj and the MLP for the rows read alone, moved to the front.
        if (layer + 1 == m.num_layers && out.count >= 0) {
          for (int64_t i = 0; i < out.count; ++i) {
            const int64_t t = out.rows != nullptr ? out.rows[i] : i;  // >= i (ascending)
            if (t == i) continue;
            std::memcpy(mixed + i * width, mixed + t * width, width * sizeof(uint16_t));
            std::memcpy(r.residual + i * H, r.residual + t * H, H * sizeof(uint16_t));
          }
          group_rows(out);
          T = out.count;
          if (T == 0) return 0;
        }
        ahead.plan(layer + 1);
        if (!matmul(mixed, W_O, W_O_BIAS, hidden, H, width)) return refused;
      } else {
        if (!matmul(attention_in, W_QKV, W_QKV_BIAS, qkv, qkv_width, H, ahead.qkv())) return refused;
        if (!adapt(P_QKV, attention_in, H, qkv, qkv_width)) return refused;
        if (m.clip > 0) clamp(qkv, T * qkv_width, m.clip);  // OLMo 1: after the projection (and its adapters)
        if (weight(w, W_Q_NORM) != nullptr) {  // Qwen3, Gemma 3: the module path's q_norm and k_norm, before the rotary
          norm_heads(qkv, 0, m.num_heads, weight(w, W_Q_NORM));
          norm_heads(qkv, q_size, m.num_kv_heads, weight(w, W_K_NORM));
        }
        if (w[W_ROPE] != ROPE_NONE) {
          const bool local = w[W_ROPE] == ROPE_LOCAL;
          rotary(qkv, qkv_width, local ? r.cos_local : r.cos, local ? r.sin_local : r.sin, T,
                 m.num_heads + m.num_kv_heads, m.head_dim, m.rotary_dim);
        }
        write_kv(qkv + q_size, qkv_width, qkv + q_size + kv_size, qkv_width, r.slots, T, k_cache, v_cache,
                 m.num_kv_heads, m.head_dim, m.block_size, num_threads);
        // From the attention on, the rows computed: every row, or in the last layer the rows
        // read (`out`), moved to the front of q_rows and of the residual.
        const Outputs& rows = layer + 1 == m.num_layers && out.count >= 0 ? out : all_rows;
        for (int64_t i = 0; i < rows.count; ++i) {
          const int64_t t = rows.rows != nullptr ? rows.rows[i] : i;  // >= i (ascending): moved no later than read
          std::memcpy(q_rows + i * q_size, qkv + t * qkv_width, q_size * sizeof(uint16_t));
          // The input norm has added the layer before's output in: `residual` is the stream.
          // (normed too where the MLP reads it: Phi's and StableLM's side by side.)
          if (t != i) std::memcpy(r.residual + i * H, r.residual + t * H, H * sizeof(uint16_t));
          if (t != i && m.parallel != IN_TURN) std::memcpy(normed + i * H, normed + t * H, H * sizeof(uint16_t));
        }
        if (&rows != &all_rows) group_rows(rows);
        T = rows.count;
        if (T == 0) return 0;  // no row read: the cache is written, nothing more to compute
        attention(q_rows, attn, k_cache, v_cache, rows.block_tables, m.max_blocks, rows.seq_lens, rows.query_start,
                  rows.query_lens, rows.num_seqs, m.num_heads, m.num_kv_heads, m.head_dim, m.block_size, m.scale,
                  w[W_WINDOW], m.softcap, num_threads, PAIRED_KERNEL);
        ahead.plan(layer + 1);
        if (!matmul(attn, W_O, W_O_BIAS, hidden, H, q_size) || !adapt(P_O, attn, q_size, hidden, H)) return refused;
        if (m.reduce != nullptr) {
          const int status = all_reduce(m.reduce, hidden, T * H);
          if (status != 0) return status;
        }
      }  // the attention's block
    }  // the layer's block
    // Nemotron-H's block without an MLP after it: its output joins the stream at the next layer's norm.
    const bool experts = w[W_ROUTER] != 0;  // a mixture-of-experts layer
    if (weight(w, W_GATE_UP) == nullptr && !experts) continue;
    if (!mlp_only || layer > 0) scale_hidden(hidden, T * H, m.residual_scale, num_threads);
    const uint16_t* mlp_in = normed;
    if (m.parallel != IN_TURN) {  // Phi's and StableLM's MLP reads `normed`, GPT-NeoX's its own norm of the stream
      if (weight(w, W_POST_NORM) != nullptr)
        rms_norm(r.residual, nullptr, weight(w, W_POST_NORM), normed, T, H, weight(w, W_POST_NORM_BIAS));
      if (m.parallel == STREAM_FIRST) add_rows(r.residual, hidden, nullptr, T, H);
    } else if (post_norms) {  // OLMo 2: the attention's output normed and added; the MLP reads the stream
      rms_norm(hidden, nullptr, weight(w, W_POST_NORM), hidden, T, H);
      add_rows(r.residual, hidden, nullptr, T, H);
      mlp_in = r.residual;
    } else if (weight(w, W_PRE_FF_NORM) != nullptr) {  // Gemma 2 and 3: the attention's output normed, then added
      rms_norm(hidden, nullptr, weight(w, W_POST_NORM), hidden, T, H);
      rms_norm(hidden, r.residual, weight(w, W_PRE_FF_NORM), normed, T, H);
    } else if (mlp_only && layer == 0) {  // the embeddings are the stream: nothing to add
      rms_norm(r.residual, nullptr, weight(w, W_POST_NORM), normed, T, H, weight(w, W_POST_NORM_BIAS));
    } else {
      rms_norm(hidden, r.residual, weight(w, W_POST_NORM), normed, T, H, weight(w, W_POST_NORM_BIAS));
    }
    const int64_t width = w[W_MLP_WIDTH] > 0 ? w[W_MLP_WIDTH] : I;  // this layer's MLP features
    if (experts) {  // the routed experts (in turn after the attention), then a shared one
      if (m.moe == nullptr || !moe_ffn(w, mlp_in, hidden)) return refused;
      if (weight(w, W_GATE_UP) != nullptr) {  // on every row, SwiGLU (or the model's un-gated MLP): routed + shared
        const bool shared_gated = m.moe->gated != 0;
        if (!matmul(mlp_in, W_GATE_UP, W_GATE_UP_BIAS, gate_up, (shared_gated ? 2 : 1) * width, H)) return refused;
        (shared_gated ? silu : activation)(gate_up, act, T, width);
        if (!matmul(act, W_DOWN, W_DOWN_BIAS, mlp_out, H, width)) return refused;
        if (weight(w, W_SHARED_GATE) != nullptr) {  // Qwen2-MoE: its logit a row into act's room (free now)
          if (gemm(mlp_in, weight(w, W_SHARED_GATE), nullptr, act, T, 1, H, m.isa, num_threads, nullptr) != 0)
            return refused;
          sigmoid_gate(mlp_out, act, T, H);
        }
        add_rows(hidden, mlp_out, nullptr, T, H);
      }
      if (m.reduce != nullptr) {  // the ranks' partial sums of the experts' features, as SparseMoE's all-reduce
        const int status = all_reduce(m.reduce, hidden, T * H);
        if (status != 0) return status;
      }
      if (weight(w, W_POST_FF_NORM) != nullptr) rms_norm(hidden, nullptr, weight(w, W_POST_FF_NORM), hidden, T, H);
      continue;
    }
    const int64_t up_width = gated ? 2 * width : width;
    if (!matmul(mlp_in, W_GATE_UP, W_GATE_UP_BIAS, gate_up, up_width, H) ||
        !adapt(P_GATE_UP, mlp_in, H, gate_up, up_width))
      return refused;
    activation(gate_up, act, T, width);
    uint16_t* down_out = m.parallel == BLOCKS_FIRST ? mlp_out : hidden;
    if (!matmul(act, W_DOWN, W_DOWN_BIAS, down_out, H, width, ahead.down()) ||
        !adapt(P_DOWN, act, width, down_out, H))
      return refused;
    if (m.parallel == BLOCKS_FIRST) add_rows(hidden, mlp_out, nullptr, T, H);  // attention's output + the MLP's
    if (m.reduce != nullptr) {
      const int status = all_reduce(m.reduce, hidden, T * H);
      if (status != 0) return status;
    }
    if (weight(w, W_POST_FF_NORM) != nullptr) rms_norm(hidden, nullptr, weight(w, W_POST_FF_NORM), hidden, T, H);
  }
  return 0;
}

// Two walks: sequences [0, split) and [split, num_seqs), num_threads / 2 threads each.
int split_walks(const Model& m, const Rows& all, int64_t split, int num_threads) {
  const int64_t first_tokens = all.query_start[split];
  std::vector<int32_t> second_start(all.query_start + split, all.query_start + all.num_seqs);
  for (int32_t& start : second_start) start -= static_cast<int32_t>(first_tokens);
  // The state layers' spans, one per sequence: the second walk's from its first row.
  const Spans& spans = all.spans;
  const bool spanned = spans.n > 0;
  std::vector<int64_t> second_span_start(spanned ? spans.starts + split : nullptr,
                                         spanned ? spans.starts + spans.n : nullptr);
  for (int64_t& start : second_span_start) start -= first_tokens;
  const Spans first_spans{spans.starts, spans.lengths, spans.slots, spans.has_state, spanned ? split : 0};
  const Spans second_spans{second_span_start.data(), spanned ? spans.lengths + split : nullptr,
                           spanned ? spans.slots + split : nullptr, spanned ? spans.has_state + split : nullptr,
                           spanned ? spans.n - split : 0};
  const Rows halves[2] = {
      {all.residual, all.hidden, all.scratch, all.cos, all.sin, all.cos_local, all.sin_local, all.slots,
       all.block_tables, all.seq_lens, all.query_start, all.query_lens, split, first_tokens, all.lora_slots,
       all.lora_scratch, first_spans},
      {all.residual + first_tokens * m.hidden_size, all.hidden + first_tokens * m.hidden_size,
       all.scratch + m.scratch(first_tokens), all.cos + first_tokens * m.rotary_dim, all.sin + first_tokens * m.rotary_dim,
       all.cos_local == nullptr ? nullptr : all.cos_local + first_tokens * m.rotary_dim,
       all.sin_local == nullptr ? nullptr : all.sin_local + first_tokens * m.rotary_dim, all.slots + first_tokens, all.block_tables + split * m.max_blocks, all.seq_lens + split,
       second_start.data(), all.query_lens + split, all.num_seqs - split, all.tokens - first_tokens,
       all.lora_slots == nullptr ? nullptr : all.lora_slots + first_tokens,
       all.lora_scratch == nullptr ? nullptr : all.lora_scratch + m.lora_scratch(first_tokens), second_spans}};
  int status[2] = {0, 0};
#pragma omp parallel num_threads(2)
  {
    // The kernels' own parallel regions are nested in this one: a walk's threads are
    // the ones its kernels are given (the element-wise ops take the default count).
    omp_set_num_threads(num_threads / 2);
    // Both halves whatever the team the runtime grants (one thread walks them in turn).
    for (int index = omp_get_thread_num(); index < 2; index += omp_get_num_threads())
      status[index] = walk(m, halves[index], num_threads / 2);
  }
  return status[0] != 0 ? status[0] : status[1];
}

}  // namespace

extern "C" {

// Scratch elements (bf16) a call needs for `tokens` rows (two walks take their rows' share each).
// mixer_width: a hybrid's Mamba2 mixers' elements per row (kvloom_decoder_stack_mixer_width), else 0.
// moe_width: a mixture-of-experts model's elements per row (kvloom_decoder_stack_moe_width), else 0.
// latent_width: a latent-attention model's elements per row (kvloom_decoder_stack_latent_width), else 0.
int64_t kvloom_decoder_stack_scratch(int64_t tokens, int64_t hidden_size, int64_t q_size, int64_t kv_size,
                                     int64_t intermediate, int64_t mixer_width, int64_t moe_width,
                                     int64_t latent_width) {
  return scratch_elements(tokens, hidden_size, q_size, kv_size, intermediate, mixer_width, moe_width, latent_width);
}

// A latent-attention model's scratch per row: its heads, latent (rank + rope), query heads' non-rotary
// part, value heads and q_a's rank (0: none).
int64_t kvloom_decoder_stack_latent_width(int64_t heads, int64_t rank, int64_t rope, int64_t nope, int64_t v,
                                          int64_t q_rank) {
  LatentShape shape{};
  shape.heads = heads;
  shape.rank = rank;
  shape.rope = rope;
  shape.nope = nope;
  shape.v = v;
  shape.q_rank = q_rank;
  return shape.scratch_width();
}

// A mixture-of-experts model's scratch per row: its routed experts' count, top_k and features.
int64_t kvloom_decoder_stack_moe_width(int64_t num_experts, int64_t top_k, int64_t inter, int64_t hidden_size) {
  MoeShape shape{};
  shape.num_experts = num_experts;
  shape.top_k = top_k;
  shape.inter = inter;
  return shape.scratch_width(hidden_size);
}

// A hybrid's state layers' scratch per row: its Mamba2 mixers' sizes (heads 0: none), and
// short_kernel > 0 where it has LFM2's short convolutions (of hidden_size channels).
int64_t kvloom_decoder_stack_mixer_width(int64_t inter, int64_t conv_dim, int64_t heads, int64_t hidden_size,
                                         int64_t short_kernel) {
  StateLayers sizes{};
  sizes.inter = inter;
  sizes.conv_dim = conv_dim;
  sizes.heads = heads;
  sizes.short_kernel = short_kernel;
  return sizes.scratch_width(hidden_size);
}

// LoRA's scratch elements (bf16) for `tokens` rows whose widest shrink is `max_width`.
int64_t kvloom_decoder_stack_lora_scratch(int64_t tokens, int64_t hidden_size, int64_t q_size, int64_t kv_size,
                                          int64_t intermediate, int64_t max_width) {
  return lora_scratch_elements(tokens, hidden_size, q_size, kv_size, intermediate, max_width);
}

// kernels: [NUM_KERNELS] entry points; weights: [num_layers, NUM_WEIGHTS] data pointers
// (packed GEMM weights, bf16 norm weights and biases, 0 for no bias). residual: [tokens,
// hidden_size] (the embeddings in; the stream before the last `hidden` out); hidden:
// [tokens, hidden_size] out. kv_caches: [num_layers, 2, num_blocks, block_size, kv heads,
// head_dim] bf16 in the paired layout. reduce: nullptr, or the all-reduce's context
// (kernels[K_ALL_REDUCE] then sums `hidden` over the tensor-parallel ranks). cos_local,
// sin_local: the ROPE_LOCAL layers' rotary table, [tokens, rotary_dim] as cos and sin
// (nullptr where no layer has one). softcap: the attention scores' (0: none); norm, its
// norm_offset and activation: a Norm and an Activation; qk_norm_whole: 1 where the q and k
// norms span each token's whole q and k (OLMo 2's), 0 each head; parallel: 1 where attention
// and MLP are added side by side (Phi, GPT-NeoX); clip: OLMo 1's clip_qkv (0: none). split_seqs:
// 0 for one walk, else where the second walk's sequences begin (0 < split_seqs <
// num_seqs; an even num_threads of at least 2; no reduce). Returns 0, 1 + the layer
// whose GEMM refused `isa` (nothing after it ran in that walk), or the all-reduce's
// failure (-1 timed out, -2 a rank died). kv_prefetch_bytes: of each layer's KV a walk
// fetches ahead during its matmuls (0: none; the result is the same bit for bit).
// num_out_rows >= 0 (one walk, no reduce): only those rows (out_rows, ascending) get the
// last layer's attention and what follows; they are left first in `residual` and
// `hidden`, the rest of both undefined. out_block_tables [num_out_seqs, max_blocks],
// out_seq_lens, out_query_start, out_query_lens [num_out_seqs]: their sequences, each
// asking for its last out_query_lens[s] rows. num_out_rows < 0: every row.
// lora_weights: nullptr, or [num_layers, 4, lora_slots, 2] packed shrink and expand
// weights of each layer's projections (qkv, o, gate_up, down) and adapter slot (0, 0: none),
// lora_widths [4] the projections' shrink widths, lora_rows [tokens] each row's slot (-1:
// none), lora_scratch kvloom_decoder_stack_lora_scratch(tokens, ...) elements; every row
// computed then (num_out_rows < 0).
// state_sizes: nullptr (no state layer), or [inter, conv_dim, heads, head_dim, d_state, groups,
// conv kernel] of every Mamba2 mixer (heads 0: none), LFM2's short convolutions' taps (0:
// none) and the state slots; state_limits [dt_lo, dt_hi, the gated norm's eps] (a mixer's);
// and the step's requests as the state layers read them: span_starts, span_lengths,
// span_slots [num_spans] int64, span_has_state [num_spans] int32 (split walks: one a sequence,
// in order; returns MIXER_REFUSED, -3, where a kernel refuses them).
// moe_sizes: nullptr (no mixture-of-experts layer), or [num_experts, top_k, inter, gate_up_stride,
// down_stride, norm, round_weights, sigmoid, router_float32, num_groups, topk_groups, group_rule, gated,
// first_expert, local_experts] of every such layer's routed experts (MoeShape),
// moe_scaling their routing weights' factor and moe_eps the renormalising sum's guard; a layer
// whose router GEMM, routing or experts' GEMM refuses returns 1 + the layer.
// latent_sizes: nullptr (no latent-attention layer), or [heads, rank, rope, nope, v, q_rank,
// interleaved, products, uk_stride, uv_stride] (LatentShape), latent_eps its norms'; kv_caches is
// then the latent pool [num_layers, 1, num_blocks, block_size, 1, rank + rope] (token-major) and
// `scale` the attention's; returns LATENT_REFUSED, -4, where the latent attention kernel refuses.
int kvloom_decoder_stack(const int64_t* kernels, const int64_t* weights, int64_t num_layers, uint16_t* residual,
                         uint16_t* hidden, uint16_t* scratch, uint16_t* kv_caches, int64_t num_blocks,
                         const float* cos, const float* sin, const float* cos_local, const float* sin_local,
                         const int64_t* slots, const int32_t* block_tables,
                         int64_t max_blocks, const int32_t* seq_lens, const int32_t* query_start,
                         const int32_t* query_lens, int64_t num_seqs, int64_t tokens, int64_t hidden_size,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
                         int64_t intermediate, int64_t block_size, float eps, float scale, float residual_scale,
                         float softcap, int norm, float norm_offset, int activation, int qk_norm_whole,
                         int parallel, float clip, int isa,
                         int num_threads,
                         int64_t* reduce, int64_t split_seqs, int64_t kv_prefetch_bytes, const int64_t* out_rows,
                         int64_t num_out_rows, const int32_t* out_block_tables, const int32_t* out_seq_lens,
                         const int32_t* out_query_start, const int32_t* out_query_lens, int64_t num_out_seqs,
                         const int64_t* lora_weights, int64_t lora_slots, const int64_t* lora_widths,
                         const int32_t* lora_rows, uint16_t* lora_scratch, const int64_t* state_sizes,
                         const float* state_limits, const int64_t* span_starts, const int64_t* span_lengths,
                         const int64_t* span_slots, const int32_t* span_has_state, int64_t num_spans,
                         const int64_t* moe_sizes, float moe_scaling, float moe_eps, const int64_t* latent_sizes,
                         float latent_eps) {
  LatentShape latent{};
  if (latent_sizes != nullptr)
    latent = LatentShape{latent_sizes[0], latent_sizes[1], latent_sizes[2], latent_sizes[3], latent_sizes[4],
                         latent_sizes[5], latent_sizes[6], latent_sizes[7], latent_sizes[8], latent_sizes[9],
                         latent_eps};
  MoeShape moe{};
  if (moe_sizes != nullptr)
    moe = MoeShape{moe_sizes[0],  moe_sizes[1],  moe_sizes[2],  moe_sizes[3],  moe_sizes[4],  moe_sizes[5],
                   moe_sizes[6],  moe_sizes[7],  moe_sizes[8],  moe_sizes[9],  moe_sizes[10], moe_sizes[11],
                   moe_sizes[12], moe_sizes[13], moe_sizes[14], moe_scaling,   moe_eps};
  StateLayers states{};
  if (state_sizes != nullptr) {
    // Split walks take each sequence's span with it: one span a sequence, in order.
    if (split_seqs > 0 && num_spans != num_seqs) return MIXER_REFUSED;
    states = StateLayers{state_sizes[0], state_sizes[1], state_sizes[2], state_sizes[3], state_sizes[4],
                         state_sizes[5], state_sizes[6], state_sizes[7], state_sizes[8], state_limits[0],
                         state_limits[1], state_limits[2]};
  }
  const Spans spans{span_starts, span_lengths, span_slots, span_has_state, state_sizes != nullptr ? num_spans : 0};
  const Model model{kernels,      weights,    num_layers, kv_caches,    num_blocks,   max_blocks,
                    hidden_size,  num_heads,  num_kv_heads, head_dim,   intermediate, block_size,
                    rotary_dim,   eps,        scale,      residual_scale, softcap,  norm,         norm_offset,
                    activation,   qk_norm_whole, parallel, clip, isa, reduce, kv_prefetch_bytes,
                    lora_weights, lora_slots, lora_widths, state_sizes != nullptr ? &states : nullptr,
                    moe_sizes != nullptr ? &moe : nullptr, latent_sizes != nullptr ? &latent : nullptr};
  const Rows rows{residual,     hidden,   scratch,     cos,        sin,      cos_local, sin_local, slots,
                  block_tables, seq_lens, query_start, query_lens, num_seqs, tokens,
                  lora_rows,    lora_scratch, spans};
  if (split_seqs > 0) return split_walks(model, rows, split_seqs, num_threads);
  const Outputs out{out_rows, num_out_rows, out_block_tables, out_seq_lens, out_query_start, out_query_lens,
                    num_out_seqs};
  return walk(model, rows, num_threads, out);
}

}  // extern "C"
