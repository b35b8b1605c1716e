#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
uint16_t real_fpclass(const float* v, int imm);
uint16_t emu_fpclass(const float* v, int imm);
int main() {
  std::mt19937 g(1);
  const uint32_t specials[] = {0, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0xff812345u,
                               1, 0x807fffffu, 0x00400000u, 0x3f800000u, 0xbf800000u, 0x7f7fffffu, 0xff7fffffu, 0x00800000u};
  long bad = 0, total = 0;
  for (int round = 0; round < 2000; ++round) {
    uint32_t b[16];
    for (int j = 0; j < 16; ++j) b[j] = round == 0 ? specials[j] : (g() % 4 == 0 ? specials[g() % 16] : (uint32_t)g());
    float v[16]; std::memcpy(v, b, 64);
    for (int imm = 0; imm < 256; ++imm) { ++total; if (real_fpclass(v, imm) != emu_fpclass(v, imm)) ++bad; }
  }
  printf("mismatches %ld of %ld\n", bad, total);
}
