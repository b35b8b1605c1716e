// Mamba2's mixer on a CPU: the selective scan of any batch (prompts' chunks and decodes
// alike, each request's SSM state updated in place in its state slot) and the causal
// convolution of any batch (below).
//
// The pure-PyTorch path (models/ssm_ops.py) gathers a decode's states from their slots,
// zeroes the fresh ones, decays them, adds the input's outer product, contracts with C
// and scatters them back: the state, [heads, head_dim, d_state] float32 per request and
// layer (295 KB at Granite 4.0's and Bamba's common shapes), goes through memory about
// ten times; a prompt goes through the chunked (SSD) algorithm's masked products. The scan
// here reads and writes each state once. Its numbers are the sequential reference's up to
// float32 rounding: the decay and the input may be fused into one fma, and y's sum over
// d_state is taken in the compiler's vector order (tests/kernels/test_ssm_kernels.py
// holds it to the reference). Each (request, head) is one thread's whole and sums in one
// fixed order, so a request's result does not depend on the batch it came in.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <omp.h>
#include <vector>

#include "simd.h"

namespace {

using kvloom_simd::from_float;
using kvloom_simd::round_to;
using kvloom_simd::to_float;

// The requests' slots and spans checked before anything is read or written (they are data,
// which the Python checks would need several torch ops a call to see): 0 where every slot
// lies in [0, num_slots) and every span in [0, tokens); 1: a slot outside; 2: a span outside.
int64_t check_requests(const int64_t* slots, const int64_t* starts, const int64_t* lengths, int64_t n,
                       int64_t num_slots, int64_t tokens) {
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= num_slots) return 1;
  for (int64_t i = 0; i < n; ++i)
    if (starts[i] < 0 || lengths[i] < 0 || starts[i] + lengths[i] > tokens) return 2;
  return 0;
}

// The scan of every (request, head) pair, token by token, reading each token's x, B, C and
// dt from rows of any layout: x at x[t * x_stride + h * head_dim], B and C at
// [t * bc_stride + g * d_state] for the head's group g = h / (heads / groups), dt at
// dt[t * dt_stride + h] (with dt_bias: softplus(dt + dt_bias) clamped to [dt_lo, dt_hi], as
// transformers' mixer takes it; without: dt as it is). y: [tokens, heads * head_dim] float.
template <typename T>
void scan_pairs(float* state, const int64_t* slots, const int32_t* has_state, const int64_t* starts,
                const int64_t* lengths, const T* x, int64_t x_stride, const T* B, const T* C, int64_t bc_stride,
                int64_t groups, const T* dt, int64_t dt_stride, const float* dt_bias, float dt_lo, float dt_hi,
                const float* A, const float* D, float* y, int64_t n, int64_t heads, int64_t head_dim,
                int64_t d_state, int num_threads) {
  const int64_t heads_per_group = heads / groups;
  auto scan_pair = [&](int64_t pair) {
    const int64_t i = pair / heads, h = pair % heads, g = h / heads_per_group;
    float* s = state + (slots[i] * heads + h) * head_dim * d_state;
    if (has_state[i] == 0)
      for (int64_t e = 0; e < head_dim * d_state; ++e) s[e] = 0.0f;
    const float a = A[h], skip = D[h];
    float b[512], c[512], xs[512];  // this token's B, C and x as float (d_state, head_dim <= 512)
    for (int64_t t = starts[i]; t < starts[i] + lengths[i]; ++t) {
      float step = to_float(dt[t * dt_stride + h]);
      if (dt_bias) {
        step += dt_bias[h];
        step = step > 20.0f ? step : std::log1p(std::exp(step));  // softplus, torch's threshold
        step = std::min(std::max(step, dt_lo), dt_hi);
      }
      const float decay = std::exp(step * a);
      for (int64_t k = 0; k < d_state; ++k) {
        b[k] = step * to_float(B[t * bc_stride + g * d_state + k]);
        c[k] = to_float(C[t * bc_stride + g * d_state + k]);
      }
      for (int64_t p = 0; p < head_dim; ++p) xs[p] = to_float(x[t * x_stride + h * head_dim + p]);
      float* yr = y + (t * heads + h) * head_dim;
      for (int64_t p = 0; p < head_dim; ++p) {
        float* row = s + p * d_state;
        const float xp = xs[p];
        float acc = 0.0f;
        for (int64_t k = 0; k < d_state; ++k) {
          const float v = row[k] * decay + b[k] * xp;
          row[k] = v;
          acc += v * c[k];
        }
        yr[p] = acc + xp * skip;
      }
    }
  };
  const int64_t pairs = n * heads;
  const int threads = pairs > 1 ? num_threads : 1;
  // Chunks of one length (a decode step) split statically, each thread a contiguous run of
  // slots' states for the prefetchers (dynamic hand-out measured 1.5x slower at 64
  // decodes); chunks of mixed lengths are handed out as threads free up.
  bool uniform = true;
  for (int64_t i = 1; i < n; ++i) uniform = uniform && lengths[i] == lengths[0];
  if (uniform) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t pair = 0; pair < pairs; ++pair) scan_pair(pair);
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t pair = 0; pair < pairs; ++pair) scan_pair(pair);
  }
}

}  // namespace

extern "C" {

// The selective scan of n requests' chunks, request i's lengths[i] tokens from row
// starts[i] of the flat batch (a decode's chunk is one token), each from its slot's state
// (zeros where has_state[i] is 0: the slot's old contents are not read), which it leaves
// there. state: [slots, heads, head_dim, d_state] float32, request i's at row slots[i];
// x: [tokens, heads, head_dim]; dt: [tokens, heads] (after softplus); A, D: [heads];
// B, C: [tokens, heads, d_state] (groups already repeated per head); y: [tokens, heads,
// head_dim]. Token by token: h' = exp(dt A) h + (dt B) x, y = h' . C + D x.
//
// One (request, head) is one thread's whole, its state (head_dim x d_state floats, 16 KB
// at the common 64 x 64) staying in L1 across the chunk's tokens: on a CPU this beats the
// chunked (SSD) form's masked products by an order of magnitude, and it is the reference's
// own recurrence. How the pairs are split between the threads moves no bit: a pair's
// arithmetic is the same whichever thread runs it.
int64_t kvloom_ssm_scan(float* state, const int64_t* slots, const int32_t* has_state, const int64_t* starts,
                        const int64_t* lengths, const float* x, const float* dt, const float* A, const float* B,
                        const float* C, const float* D, float* y, int64_t n, int64_t num_slots, int64_t tokens,
                        int64_t heads, int64_t head_dim, int64_t d_state, int num_threads) {
  if (const int64_t status = check_requests(slots, starts, lengths, n, num_slots, tokens)) return status;
  scan_pairs(state, slots, has_state, starts, lengths, x, heads * head_dim, B, C, heads * d_state, heads, dt, heads,
             nullptr, 0.0f, 0.0f, A, D, y, n, heads, head_dim, d_state, num_threads);
  return 0;
}

}  // extern "C"

// The convolution's last step for one token's channels: acc (+ bias) rounded to T, and with
// silu its silu, rounded again, into dst (16 lanes at a time on AVX-512; the same numbers
// as the scalar rule up to exp's last bit).
template <typename T>
inline void finish_rows(const float* acc, const float* bias, bool silu, T* dst, int64_t width) {
  using kvloom_simd::from_float;
  using kvloom_simd::round_to;
  int64_t c = 0;
#ifdef KVLOOM_AVX512
  using namespace kvloom_simd;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; c < width; c += 16) {
    __m512 v = load16(acc + c, width - c);
    if (bias) v = _mm512_add_ps(v, load16(bias + c, width - c));
    v = round16(v, dst);
    if (silu) v = _mm512_div_ps(v, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
    store16(dst + c, v, width - c);
  }
#endif
  for (; c < width; ++c) {
    float v = round_to(bias ? acc[c] + bias[c] : acc[c], dst);
    if (silu) v = v / (1.0f + std::exp(-v));
    from_float(v, dst + c);
  }
}

// Mamba2's depthwise causal convolution over a flat batch, before its activation: each
// request's channels convolved over its stored last k - 1 inputs (zeros where it starts
// from a zero state) followed by its chunk's tokens, and its slot's stored inputs left as
// the last k - 1 of that sequence. Replaces the reference's gather, mask, concatenation,
// window gather, product, sum and scatter (models/ssm_ops.causal_conv) by one pass; the
// sum over the k taps is in float32 in tap order, the bias added after, the result
// rounded to the activations' dtype (the reference's order, up to fma contraction).
//
// xbc, out: [tokens, channels] (T: float or bf16); weight_t: [k, channels] float32;
// bias: [channels] float32 or nullptr; conv_state: [slots, k - 1, channels] (T, oldest first);
// starts, lengths, slots: [n] int64; has_state: [n] int32.
//
// in_stride: the elements between two tokens' rows of xbc (channels where it is its own
// tensor; the mixer's fused kernel reads it from the in_proj output's columns). silu: the
// output is silu of the rounded convolution, rounded again (F.silu after the reference).
template <typename T>
static void causal_conv(const T* xbc, int64_t in_stride, const float* weight_t, const float* bias, T* conv_state,
                        const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                        const int32_t* has_state, T* out, int64_t n, int64_t channels, int64_t k, bool silu,
                        int num_threads) {
  using kvloom_simd::from_float;
  using kvloom_simd::round_to;
  using kvloom_simd::to_float;
  const int64_t tail = k - 1;
  // Work items: (request, a block of 64 channels); each writes only its own outputs and
  // its own slot's channels, so any split gives the same bits.
  constexpr int64_t BLOCK = 64;
  const int64_t blocks = (channels + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(n * blocks > 1 ? num_threads : 1)
  for (int64_t item = 0; item < n * blocks; ++item) {
    const int64_t i = item / blocks, c0 = item % blocks * BLOCK, width = std::min(channels - c0, BLOCK);
    T* stored = conv_state + slots[i] * tail * channels + c0;  // [tail, channels], oldest first
    const T* tokens = xbc + starts[i] * in_stride + c0;
    const int64_t length = lengths[i];
    const bool fresh = has_state[i] == 0;
    // The stored inputs of this block, oldest first, as float ([tail][BLOCK]; zeros if fresh).
    float old[16][BLOCK];
    for (int64_t m = 0; m < tail; ++m)
      for (int64_t c = 0; c < width; ++c) old[m][c] = fresh ? 0.0f : to_float(stored[m * channels + c]);
    for (int64_t t = 0; t < length; ++t) {
      float acc[BLOCK] = {};
      for (int64_t w = 0; w < k; ++w) {  // taps in order: position t - tail + w of the sequence
        const int64_t j = t - tail + w;
        const float* tap = weight_t + w * channels + c0;
        if (j >= 0) {
          const T* row = tokens + j * in_stride;
          for (int64_t c = 0; c < width; ++c) acc[c] += to_float(row[c]) * tap[c];
        } else {
          const float* row = old[tail + j];
          for (int64_t c = 0; c < width; ++c) acc[c] += row[c] * tap[c];
        }
      }
      T* dst = out + (starts[i] + t) * channels + c0;
      finish_rows(acc, bias ? bias + c0 : nullptr, silu, dst, width);
    }
    // The new stored inputs: the last k - 1 of the sequence (a short chunk's come partly
    // from the old ones, which ``old`` holds).
    for (int64_t m = 0; m < tail; ++m) {
      const int64_t j = length - tail + m;
      for (int64_t c = 0; c < width; ++c) {
        const float v = j >= 0 ? to_float(tokens[j * in_stride + c]) : old[tail + j][c];
        from_float(v, stored + m * channels + c);
      }
    }
  }
}

// The convolution as its own op: the requests checked first (check_requests' status).
template <typename T>
int64_t checked_causal_conv(const T* xbc, const float* weight_t, const float* bias, T* conv_state,
                            const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                            const int32_t* has_state, T* out, int64_t n, int64_t num_slots, int64_t tokens,
                            int64_t channels, int64_t k, int num_threads) {
  if (const int64_t status = check_requests(slots, starts, lengths, n, num_slots, tokens)) return status;
  causal_conv(xbc, channels, weight_t, bias, conv_state, starts, lengths, slots, has_state, out, n, channels, k, false,
              num_threads);
  return 0;
}

extern "C" {

int64_t kvloom_causal_conv_f32(const float* xbc, const float* weight_t, const float* bias, float* conv_state,
                               const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                               const int32_t* has_state, float* out, int64_t n, int64_t num_slots, int64_t tokens,
                               int64_t channels, int64_t k, int num_threads) {
  return checked_causal_conv(xbc, weight_t, bias, conv_state, starts, lengths, slots, has_state, out, n, num_slots,
                             tokens, channels, k, num_threads);
}

int64_t kvloom_causal_conv_bf16(const uint16_t* xbc, const float* weight_t, const float* bias, uint16_t* conv_state,
                                const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                                const int32_t* has_state, uint16_t* out, int64_t n, int64_t num_slots, int64_t tokens,
                                int64_t channels, int64_t k, int num_threads) {
  return checked_causal_conv(xbc, weight_t, bias, conv_state, starts, lengths, slots, has_state, out, n, num_slots,
                             tokens, channels, k, num_threads);
}

}  // extern "C"

// ---- LFM2's gated short convolution between its projections, in one call -------------
namespace {

// proj: [tokens, 3 * channels] (T), the in_proj output: B, C, x. bx = B * x (rounded to T,
// as torch's product of two T tensors), convolved as causal_conv (no activation) into out,
// then out = C * out (rounded): models/short_conv.ShortConv.forward between in_proj and
// out_proj (its reference), each element's roundings the reference's. bx: [tokens, channels]
// scratch.
template <typename T>
int64_t short_conv(const T* proj, const float* weight_t, const float* bias, T* conv_state, const int64_t* starts,
                   const int64_t* lengths, const int64_t* slots, const int32_t* has_state, T* bx, T* out, int64_t n,
                   int64_t num_slots, int64_t tokens, int64_t channels, int64_t k, int num_threads) {
  if (const int64_t status = check_requests(slots, starts, lengths, n, num_slots, tokens)) return status;
  const int64_t stride = 3 * channels;
#pragma omp parallel for schedule(static) num_threads(tokens > 1 ? num_threads : 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* row = proj + t * stride;
    for (int64_t c = 0; c < channels; ++c)
      from_float(to_float(row[c]) * to_float(row[2 * channels + c]), bx + t * channels + c);
  }
  causal_conv(bx, channels, weight_t, bias, conv_state, starts, lengths, slots, has_state, out, n, channels, k, false,
              num_threads);
#pragma omp parallel for schedule(static) num_threads(tokens > 1 ? num_threads : 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* gate = proj + t * stride + channels;
    T* o = out + t * channels;
    for (int64_t c = 0; c < channels; ++c) from_float(to_float(gate[c]) * to_float(o[c]), o + c);
  }
  return 0;
}

}  // namespace

extern "C" {

int64_t kvloom_short_conv_f32(const float* proj, const float* weight_t, const float* bias, float* conv_state,
                              const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                              const int32_t* has_state, float* bx, float* out, int64_t n, int64_t num_slots,
                              int64_t tokens, int64_t channels, int64_t k, int num_threads) {
  return short_conv(proj, weight_t, bias, conv_state, starts, lengths, slots, has_state, bx, out, n, num_slots, tokens,
                    channels, k, num_threads);
}

int64_t kvloom_short_conv_bf16(const uint16_t* proj, const float* weight_t, const float* bias, uint16_t* conv_state,
                               const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                               const int32_t* has_state, uint16_t* bx, uint16_t* out, int64_t n, int64_t num_slots,
                               int64_t tokens, int64_t channels, int64_t k, int num_threads) {
  return short_conv(proj, weight_t, bias, conv_state, starts, lengths, slots, has_state, bx, out, n, num_slots, tokens,
                    channels, k, num_threads);
}

}  // extern "C"

// ---- the mixer between its two projections, in one call ----------------------------------
namespace {

// The gated RMSNorm after the scan, by groups of group_size features: y rounded to T, times
// silu(z) in float32, normalised over its group, rounded to T, times weight (T), rounded
// (transformers' MambaRMSNormGated on a T model, as models/mamba2.gated_rms_norm).
template <typename T>
void gated_norm(const float* y, const T* z, int64_t z_stride, const T* weight, T* out, int64_t tokens,
                int64_t inter, int64_t group_size, float eps, int num_threads) {
  const int64_t groups = inter / group_size;
#pragma omp parallel num_threads(tokens * groups > 1 ? num_threads : 1)
  {
    std::vector<float> gated(group_size);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < tokens * groups; ++item) {
      const int64_t t = item / groups, g0 = item % groups * group_size;
      const float* yr = y + t * inter + g0;
      const T* zr = z + t * z_stride + g0;
      T* o = out + t * inter + g0;
      float sum_sq = 0.0f;
#ifdef KVLOOM_AVX512
      using namespace kvloom_simd;
      const __m512 one = _mm512_set1_ps(1.0f);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t j = 0; j < group_size; j += 16) {
        const int64_t count = group_size - j;
        const __m512 zf = load16(zr + j, count);
        const __m512 silu = _mm512_div_ps(zf, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), zf))));
        const __m512 v = _mm512_mul_ps(round16(load16(yr + j, count), o), silu);
        store16(gated.data() + j, v, count);
        sums = _mm512_fmadd_ps(v, v, sums);
      }
      sum_sq = _mm512_reduce_add_ps(sums);
      const __m512 inv16 = _mm512_set1_ps(1.0f / std::sqrt(sum_sq / static_cast<float>(group_size) + eps));
      for (int64_t j = 0; j < group_size; j += 16) {
        const int64_t count = group_size - j;
        const __m512 normed = round16(_mm512_mul_ps(load16(gated.data() + j, count), inv16), o);
        store16(o + j, _mm512_mul_ps(load16(weight + g0 + j, count), normed), count);
      }
#else
      for (int64_t j = 0; j < group_size; ++j) {
        const float zf = to_float(zr[j]);
        const float v = round_to(yr[j], o) * (zf / (1.0f + std::exp(-zf)));
        gated[j] = v;
        sum_sq += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(group_size) + eps);
      for (int64_t j = 0; j < group_size; ++j)
        from_float(to_float(weight[g0 + j]) * round_to(gated[j] * inv, o), o + j);
#endif
    }
  }
}

// proj: [tokens, inter + conv_dim + heads] (T), the in_proj output: the gate z, then xBC,
// then dt. The convolution (and silu) of xBC into xbc ([tokens, conv_dim], T, scratch), the
// scan of x, B, C and softplus(dt + dt_bias) into y ([tokens, inter], float32, scratch), the
// gated norm into out ([tokens, inter], T): what models/mamba2.Mamba2Mixer.forward does
// between in_proj and out_proj, in three passes instead of some forty torch ops.
template <typename T>
int64_t mamba_mixer(const T* proj, const float* weight_t, const float* conv_bias, T* conv_state, float* ssm_state,
                 const float* dt_bias, const float* A_log, const float* D, const T* norm_weight,
                 const int64_t* starts, const int64_t* lengths, const int64_t* slots, const int32_t* has_state,
                 T* xbc, float* y, T* out, int64_t n, int64_t num_slots, int64_t tokens, int64_t inter,
                 int64_t conv_dim, int64_t heads, int64_t head_dim, int64_t d_state, int64_t groups, int64_t k,
                 float dt_lo, float dt_hi, float eps, int num_threads) {
  if (const int64_t status = check_requests(slots, starts, lengths, n, num_slots, tokens)) return status;
  const int64_t stride = inter + conv_dim + heads;
  causal_conv(proj + inter, stride, weight_t, conv_bias, conv_state, starts, lengths, slots, has_state, xbc, n,
              conv_dim, k, true, num_threads);
  std::vector<float> A(heads);
  for (int64_t h = 0; h < heads; ++h) A[h] = -std::exp(A_log[h]);
  scan_pairs(ssm_state, slots, has_state, starts, lengths, xbc, conv_dim, xbc + inter, xbc + inter + groups * d_state,
             conv_dim, groups, proj + inter + conv_dim, stride, dt_bias, dt_lo, dt_hi, A.data(), D, y, n, heads,
             head_dim, d_state, num_threads);
  gated_norm(y, proj, stride, norm_weight, out, tokens, inter, inter / groups, eps, num_threads);
  return 0;
}

}  // namespace

extern "C" {

int64_t kvloom_mamba_mixer_f32(const float* proj, const float* weight_t, const float* conv_bias, float* conv_state,
                               float* ssm_state, const float* dt_bias, const float* A_log, const float* D,
                               const float* norm_weight, const int64_t* starts, const int64_t* lengths,
                               const int64_t* slots, const int32_t* has_state, float* xbc, float* y, float* out,
                               int64_t n, int64_t num_slots, int64_t tokens, int64_t inter, int64_t conv_dim,
                               int64_t heads, int64_t head_dim, int64_t d_state, int64_t groups, int64_t k,
                               float dt_lo, float dt_hi, float eps, int num_threads) {
  return mamba_mixer(proj, weight_t, conv_bias, conv_state, ssm_state, dt_bias, A_log, D, norm_weight, starts, lengths,
                     slots, has_state, xbc, y, out, n, num_slots, tokens, inter, conv_dim, heads, head_dim, d_state,
                     groups, k, dt_lo, dt_hi, eps, num_threads);
}

int64_t kvloom_mamba_mixer_bf16(const uint16_t* proj, const float* weight_t, const float* conv_bias,
                                uint16_t* conv_state, float* ssm_state, const float* dt_bias, const float* A_log,
                                const float* D, const uint16_t* norm_weight, const int64_t* starts,
                                const int64_t* lengths, const int64_t* slots, const int32_t* has_state, uint16_t* xbc,
                                float* y, uint16_t* out, int64_t n, int64_t num_slots, int64_t tokens, int64_t inter,
                                int64_t conv_dim, int64_t heads, int64_t head_dim, int64_t d_state, int64_t groups,
                                int64_t k, float dt_lo, float dt_hi, float eps, int num_threads) {
  return mamba_mixer(proj, weight_t, conv_bias, conv_state, ssm_state, dt_bias, A_log, D, norm_weight, starts, lengths,
                     slots, has_state, xbc, y, out, n, num_slots, tokens, inter, conv_dim, heads, head_dim, d_state,
                     groups, k, dt_lo, dt_hi, eps, num_threads);
}

}  // extern "C"
