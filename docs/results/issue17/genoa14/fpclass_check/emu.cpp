#include "kvloom_emu512.h"
uint16_t emu_fpclass(const float* v, int imm) { return _mm512_fpclass_ps_mask(simde_mm512_loadu_ps(v), imm); }
