#include <immintrin.h>
#include <utility>
#include <cstdint>
template <int IMM> uint16_t one(const float* v) { return _mm512_fpclass_ps_mask(_mm512_loadu_ps(v), IMM); }
template <int... I> uint16_t dispatch(const float* v, int imm, std::integer_sequence<int, I...>) {
  uint16_t r = 0; ((imm == I ? (r = one<I>(v), 0) : 0), ...); return r; }
uint16_t real_fpclass(const float* v, int imm) { return dispatch(v, imm, std::make_integer_sequence<int, 256>()); }
