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

#include "simd.h"

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
void kvloom_ssm_scan(float* state, const int64_t* slots, const int32_t* has_state, const int64_t* starts,
                     const int64_t* lengths, const float* x, const float* dt, const float* A, const float* B,
                     const float* C, const float* D, float* y, int64_t n, int64_t heads, int64_t head_dim,
                     int64_t d_state, int num_threads) {
  auto scan_pair = [&](int64_t pair) {
    const int64_t i = pair / heads, h = pair % heads;
    float* s = state + (slots[i] * heads + h) * head_dim * d_state;
    if (has_state[i] == 0)
      for (int64_t e = 0; e < head_dim * d_state; ++e) s[e] = 0.0f;
    const float a = A[h], skip = D[h];
    for (int64_t t = starts[i]; t < starts[i] + lengths[i]; ++t) {
      const int64_t row_of_t = t * heads + h;
      const float step = dt[row_of_t];
      const float decay = std::exp(step * a);
      const float* b = B + row_of_t * d_state;
      const float* c = C + row_of_t * d_state;
      const float* xr = x + row_of_t * head_dim;
      float* yr = y + row_of_t * head_dim;
      for (int64_t p = 0; p < head_dim; ++p) {
        float* row = s + p * d_state;
        const float xp = xr[p];
        float acc = 0.0f;
        for (int64_t k = 0; k < d_state; ++k) {
          const float v = row[k] * decay + (step * b[k]) * xp;
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

}  // extern "C"

// Mamba2's depthwise causal convolution over a flat batch, before its activation: each
// request's channels convolved over its stored last k - 1 inputs (zeros where it starts
// from a zero state) followed by its chunk's tokens, and its slot's stored inputs left as
// the last k - 1 of that sequence. Replaces the reference's gather, mask, concatenation,
// window gather, product, sum and scatter (models/ssm_ops.causal_conv) by one pass; the
// sum over the k taps is in float32 in tap order, the bias added after, the result
// rounded to the activations' dtype (the reference's order, up to fma contraction).
//
// xbc, out: [tokens, channels] (T: float or bf16); weight_t: [k, channels] float32;
// bias: [channels] float32 or nullptr; conv_state: [slots, channels, k - 1] (T);
// starts, lengths, slots: [n] int64; has_state: [n] int32.
template <typename T>
static void causal_conv(const T* xbc, const float* weight_t, const float* bias, T* conv_state,
                        const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                        const int32_t* has_state, T* out, int64_t n, int64_t channels, int64_t k,
                        int num_threads) {
  using kvloom_simd::from_float;
  using kvloom_simd::to_float;
  const int64_t tail = k - 1;
  // Work items: (request, a block of 64 channels); each writes only its own outputs and
  // its own slot's channels, so any split gives the same bits.
  constexpr int64_t BLOCK = 64;
  const int64_t blocks = (channels + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(n * blocks > 1 ? num_threads : 1)
  for (int64_t item = 0; item < n * blocks; ++item) {
    const int64_t i = item / blocks, c0 = item % blocks * BLOCK, width = std::min(channels - c0, BLOCK);
    T* stored = conv_state + (slots[i] * channels + c0) * tail;
    const T* tokens = xbc + starts[i] * channels + c0;
    const int64_t length = lengths[i];
    const bool fresh = has_state[i] == 0;
    // The stored inputs of this block, oldest first, as float ([tail][BLOCK]; zeros if fresh).
    float old[16][BLOCK];
    for (int64_t m = 0; m < tail; ++m)
      for (int64_t c = 0; c < width; ++c) old[m][c] = fresh ? 0.0f : to_float(stored[c * tail + m]);
    for (int64_t t = 0; t < length; ++t) {
      float acc[BLOCK] = {};
      for (int64_t w = 0; w < k; ++w) {  // taps in order: position t - tail + w of the sequence
        const int64_t j = t - tail + w;
        const float* tap = weight_t + w * channels + c0;
        if (j >= 0) {
          const T* row = tokens + j * channels;
          for (int64_t c = 0; c < width; ++c) acc[c] += to_float(row[c]) * tap[c];
        } else {
          const float* row = old[tail + j];
          for (int64_t c = 0; c < width; ++c) acc[c] += row[c] * tap[c];
        }
      }
      T* dst = out + (starts[i] + t) * channels + c0;
      for (int64_t c = 0; c < width; ++c) from_float(bias ? acc[c] + bias[c0 + c] : acc[c], dst + c);
    }
    // The new stored inputs: the last k - 1 of the sequence (a short chunk's come partly
    // from the old ones, which ``old`` holds).
    for (int64_t m = 0; m < tail; ++m) {
      const int64_t j = length - tail + m;
      for (int64_t c = 0; c < width; ++c) {
        const float v = j >= 0 ? to_float(tokens[j * channels + c]) : old[tail + j][c];
        from_float(v, stored + c * tail + m);
      }
    }
  }
}

extern "C" {

void kvloom_causal_conv_f32(const float* xbc, const float* weight_t, const float* bias, float* conv_state,
                            const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                            const int32_t* has_state, float* out, int64_t n, int64_t channels, int64_t k,
                            int num_threads) {
  causal_conv(xbc, weight_t, bias, conv_state, starts, lengths, slots, has_state, out, n, channels, k, num_threads);
}

void kvloom_causal_conv_bf16(const uint16_t* xbc, const float* weight_t, const float* bias, uint16_t* conv_state,
                             const int64_t* starts, const int64_t* lengths, const int64_t* slots,
                             const int32_t* has_state, uint16_t* out, int64_t n, int64_t channels, int64_t k,
                             int num_threads) {
  causal_conv(xbc, weight_t, bias, conv_state, starts, lengths, slots, has_state, out, n, channels, k, num_threads);
}

}  // extern "C"
