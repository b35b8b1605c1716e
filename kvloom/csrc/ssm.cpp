// Mamba2's decode step on a CPU: one recurrent step of the selective scan for every
// request of a batch, each request's SSM state updated in place in its state slot.
//
// The pure-PyTorch path (models/ssm_ops.py: gather the slots' states, zero the fresh
// ones, decay, add the input's outer product, contract with C, scatter back) moves the
// state, [heads, head_dim, d_state] float32 per request and layer (295 KB at Granite
// 4.0's and Bamba's common shapes), through memory about ten times; this kernel reads
// and writes it once. Its numbers are the reference's up to float32 rounding: the decay
// and the input may be fused into one fma, and y's sum over d_state is taken in the
// compiler's vector order (tests/kernels/test_ssm_kernels.py holds it to the reference).
// Each (request, head) is one thread's whole and sums in one fixed order, so a request's
// result does not depend on the batch it came in.
#include <cmath>
#include <cstdint>
#include <omp.h>

extern "C" {

// state: [slots, heads, head_dim, d_state] float32, request i's at row slots[i];
// has_state: [n] int32 (0: the request starts from a zero state, its slot's old contents
// unread); x: [n, heads, head_dim]; dt: [n, heads] (after softplus); A, D: [heads];
// B, C: [n, heads, d_state] (groups already repeated per head); y: [n, heads, head_dim].
// h' = exp(dt A) h + (dt B) x, y = h' . C + D x.
void kvloom_ssm_decode(float* state, const int64_t* slots, const int32_t* has_state, const float* x,
                       const float* dt, const float* A, const float* B, const float* C, const float* D, float* y,
                       int64_t n, int64_t heads, int64_t head_dim, int64_t d_state, int num_threads) {
  const int64_t pairs = n * heads;
#pragma omp parallel for schedule(static) num_threads(pairs > 1 ? num_threads : 1)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t i = pair / heads, h = pair % heads;
    float* s = state + (slots[i] * heads + h) * head_dim * d_state;
    const float step = dt[pair];
    const float decay = std::exp(step * A[h]);
    const float* b = B + pair * d_state;
    const float* c = C + pair * d_state;
    const float* xr = x + pair * head_dim;
    float* yr = y + pair * head_dim;
    const bool fresh = has_state[i] == 0;
    for (int64_t p = 0; p < head_dim; ++p) {
      float* row = s + p * d_state;
      const float xp = xr[p];
      float acc = 0.0f;
      if (fresh) {
        for (int64_t k = 0; k < d_state; ++k) {
          const float v = (step * b[k]) * xp;
          row[k] = v;
          acc += v * c[k];
        }
      } else {
        for (int64_t k = 0; k < d_state; ++k) {
          const float v = row[k] * decay + (step * b[k]) * xp;
          row[k] = v;
          acc += v * c[k];
        }
      }
      yr[p] = acc + xp * D[h];
    }
  }
}

}  // extern "C"
