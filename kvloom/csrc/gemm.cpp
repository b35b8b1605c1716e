// Batch-invariant bf16 matmul for CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with
// W prepacked once.
//
// Invariant (the reason this file exists): every output element y[m, n] is one
// float32 accumulator that walks K in one fixed order, whatever M is, wherever row m
// sits in the call, and however the work is tiled or split between threads. So a
// row's result never depends on what else shares the call: a request's tokens do not
// change with the batch, the chunk size, cache hits or preemption. oneDNN picks its
// kernel (and so its reduction order over K) by the number of rows, which breaks this
// (docs/benchmarks.md has the measurements).
//
// Packed weight: N padded to a multiple of 16 and K to a multiple of 32 with zeros, as
// column blocks of 16: block j is [K_pad / 2][16] 32-bit words, word (p, c) =
// (W[16 j + c][2 p], W[16 j + c][2 p + 1]). One block row is one 512-bit register of 16
// column lanes times a k pair (what vdpbf16ps takes), and 16 block rows are one AMX B
// tile (16 rows of 64 bytes), so every path reads the same packed bytes.
//
// Paths (chosen at run time, never by the compiler's flags; each is invariant alone,
// and they differ from each other only in rounding):
//   ISA_AMX          AMX tiles (tdpbf16ps), 32 x 32 outputs per step
//   ISA_AVX512_BF16  vdpbf16ps: 16 lanes += pair products, 6 rows x 64 columns a tile
//   ISA_AVX512       bf16 -> float32 and fma, k by k, 4 rows x 64 columns
//   ISA_AVX2         the same on 8 lanes: x widened once per call; for passes of many
//                    rows the weight too, a block at a time (6 rows x 16 columns);
//                    else split where used (4 rows x 16 columns; 2 x 32 for the last rows)
// kvloom_gemm_bf16_side (the decoder stack's entry point) also fetches a side stream of
// the caller's lines into L2 as its tiles compute (side_stream.h), on the AVX512-BF16
// and AMX paths; a fetch changes no arithmetic.
// Plain C ABI, called through ctypes (kvloom/kernels/gemm.py registers it as a
// PyTorch op with a schema).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

#include "amx.h"
#include "side_stream.h"
#include "simd.h"
#include "work_shares.h"

namespace {

using kvloom_simd::unrolled;  // accumulators indexed by constants: they stay in registers
using kvloom_side::SideStream;

enum Isa : int { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3, ISA_AMX = 4 };

constexpr int64_t COLS = 16;     // columns per packed block
constexpr int64_t K_ALIGN = 32;  // K is padded to this: one AMX tile's depth
constexpr int64_t WORDS_PER_ROW = COLS;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

struct Problem {
  const uint16_t* x;       // [m, k] bf16, rows contiguous, row stride k
  const uint32_t* packed;  // the packed weight (see the top of the file)
  const uint16_t* bias;    // [n] bf16 or nullptr
  uint16_t* y;             // [m, n] bf16, row stride n
  int64_t m, n, k;
  int64_t block_words;     // words per packed block: K_pad / 2 * 16
  const uint32_t* block(int64_t j) const { return packed + j * block_words; }
};

inline uint32_t load_pair(const uint16_t* src) {  // two bf16 from a 2-byte aligned address
  uint32_t word;
  std::memcpy(&word, src, sizeof(word));
  return word;
}
#define KVLOOM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define KVLOOM_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define KVLOOM_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define KVLOOM_TARGET_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// The weight lines a tile fetches ahead, into L2, for the tiles after it: one 64-byte
// line per k step (a packed block row is one line) over its first steps, until `end`.
// In a step the weights stream from memory (30 layers do not fit in cache); fetched
// here they arrive while the tile computes instead of stalling the first tile that
// reads them (the hardware prefetcher stops between tiles, which read no weight while
// they sit in L1). A tile runs its k steps as two loops, the fetching ones and the
// rest, so the steps after its slice pay nothing. A prefetch changes no arithmetic.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines() const { return (end - next) / 64; }
  void fetch() {  // the next line; the caller keeps to lines()
    _mm_prefetch(next, _MM_HINT_T1);
    next += 64;
  }
  // Lines per step for `steps` steps to fetch the whole slice (at least one).
  int64_t per_step(int64_t steps) const { return std::max<int64_t>(1, (lines() + steps - 1) / std::max<int64_t>(steps, 1)); }
  // step(0), step(1), ..., step(steps - 1) in order, the first lines() of them each
  // after fetching a line: two loops, so the steps past the slice pay no check.
  template <class Step>
  KVLOOM_TARGET_AVX2 __attribute__((always_inline)) void walk(int64_t steps, const Step& step) {
    int64_t k = 0;
    for (const int64_t fetching = std::min(steps, lines()); k < fetching; ++k) {
      fetch();
      step(k);
    }
    for (; k < steps; ++k) step(k);
  }
};

// A tile's part of a side stream (side_stream.h): `left` lines from `line` on, crossing
// from span to span; fetched two a step (fetch() once per line) into L2 as the weights are.
struct SideCursor {
  const char* line = nullptr;
  const char* span_end = nullptr;
  const char* const* next_span = nullptr;
  int64_t span_bytes = 0;
  int64_t left = 0;
  static SideCursor lines(const SideStream& s, int64_t from, int64_t to) {
    SideCursor c;
    if (to <= from) return c;
    const int64_t span = from / s.span_lines;
    c.span_bytes = s.span_lines * 64;
    c.line = s.spans[span] + from % s.span_lines * 64;
    c.span_end = s.spans[span] + c.span_bytes;
    c.next_span = s.spans + span + 1;
    c.left = to - from;
    return c;
  }
  __attribute__((always_inline)) inline void fetch() {
    _mm_prefetch(line, _MM_HINT_T1);
    line += 64;
    if (line == span_end) {  // the stream's extra entry makes this safe past its last line
      line = *next_span++;
      span_end = line + span_bytes;
    }
  }
};

const SideCursor NO_SIDE{};  // a tile's side cursor where the call has no side stream

// Where the tiles of one thread fetch ahead: its blocks are [first, last), walked in
// panels, and the calls over one panel share the next panel's lines (call i of n
// fetches slice i of them).
struct AheadPlan {
  const Problem& p;
  int64_t last;
  // The bytes of blocks [j, j_end), clipped to the thread's range.
  std::pair<const char*, const char*> span(int64_t j, int64_t j_end) const {
    return {reinterpret_cast<const char*>(p.block(std::min(j, last))),
            reinterpret_cast<const char*>(p.block(std::min(j_end, last)))};
  }
  Ahead slice(std::pair<const char*, const char*> next, int64_t i, int64_t n) const {
    const int64_t lines = (next.second - next.first) / 64;
    return Ahead{next.first + lines * i / n * 64, next.first + lines * (i + 1) / n * 64};
  }
};

// The threads' shares of a call's work (work_shares.h): share s is thread s's column
// blocks [first(s), first(s + 1)), in panels of `width` blocks, for every pass in
// order, each (pass, panel) as `groups` units of row tiles. Where a unit falls, and
// what its tiles fetch ahead: the owner its next panel, a thief the panel before (its
// next steal).
struct PanelShares {
  int64_t blocks, threads, width, passes, groups;
  int64_t first(int s) const { return blocks * s / threads; }
  int64_t panels(int s) const { return (first(s + 1) - first(s) + width - 1) / width; }
  int64_t size(int s) const { return passes * panels(s) * groups; }

  struct Place {
    int64_t first, last;  // the share's blocks
    int64_t pass;         // the pass's index
    int64_t j0, panel;    // the panel's first block and its width (the share's last may be narrower)
    int64_t group;        // which units of the (pass, panel) row tiles
  };
  Place place(const kvloom_work::Unit& unit) const {
    const int64_t f = first(unit.share), l = first(unit.share + 1), per_pass = panels(unit.share) * groups;
    const int64_t j0 = f + unit.index % per_pass / groups * width;
    return {f, l, unit.index / per_pass, j0, std::min(width, l - j0), unit.index % groups};
  }
  std::pair<const char*, const char*> ahead(const AheadPlan& plan, const Place& at, bool stolen) const {
    return stolen ? plan.span(std::max(at.first, at.j0 - width), at.j0)
                  : plan.span(at.j0 + at.panel, at.j0 + at.panel + width);
  }
};

// Calls step(q, pair_of_row) for the k pairs q = 0, 1, ... in order, where
// pair_of_row(r) is (x[r][2q], x[r][2q + 1]) and, for an odd K, the last pair is
// (x[r][K - 1], 0) (the packed weight's padding is zero there too). The first
// steps each fetch ahead.per_step(K / 2) lines, so that a panel's tiles fetch the whole
// next panel between them (one line a step left 3/4 of it to the hardware at up to 6
// rows, one tile a panel; paced, out of cache on AMD EPYC model 17 at 2-12 rows 3-8%
// faster over two runs, docs/results/issue17/genoa/gemm_even_tiles.txt): Ahead::walk's
// two loops, spelled out because walk carries the AVX2 target and this runs inside the
// AVX-512 tiles.
//
// The fetching steps take a compile-time count of lines each (fetch_steps): with the count
// a variable, its loop held two more integers than the others, and GCC 12 then parked
// integers in vector registers and reloaded two of the four weight registers from the
// stack for every row of every step. Out of cache, 30 layers + head, 1-64 rows 2-6%
// faster on AMD EPYC model 17 (docs/results/issue17/genoa3/gemm_fetch_steps.txt).
// Steps q = from .. end - 1, each fetching LINES lines from `line` on (0: none).
template <int LINES, class Step>
__attribute__((always_inline)) inline void fetch_steps(const uint16_t* x, int64_t k, const char* line,
                                                       int64_t from, int64_t end, Step& step) {
  for (int64_t q = from; q < end; ++q, line += 64 * LINES) {
    for (int i = 0; i < LINES; ++i) _mm_prefetch(line + 64 * i, _MM_HINT_T1);
    step(q, [=](int r) { return load_pair(x + r * k + 2 * q); });
  }
}
// fetch_steps whose steps also fetch two lines of a side stream each; returns where
// the weight lines stopped.
template <int LINES, class Step>
__attribute__((always_inline)) inline const char* fetch_steps_side(const uint16_t* x, int64_t k, const char* line,
                                                                   int64_t from, int64_t end, SideCursor& side,
                                                                   Step& step) {
  for (int64_t q = from; q < end; ++q, line += 64 * LINES) {
    for (int i = 0; i < LINES; ++i) _mm_prefetch(line + 64 * i, _MM_HINT_T1);
    side.fetch();
    side.fetch();
    step(q, [=](int r) { return load_pair(x + r * k + 2 * q); });
  }
  return line;
}
constexpr int64_t MAX_LINES_PER_STEP = 4;  // a tile that is a panel's only one fetches 4 a step

template <class Step>
inline void for_each_pair(const uint16_t* x, int64_t k, Ahead ahead, Step&& step) {
  const int64_t full = k / 2;
  const int64_t per_step = std::min(MAX_LINES_PER_STEP, ahead.per_step(full));
  const int64_t fetching = std::min(full, ahead.lines() / per_step);
  switch (per_step) {
    case 1: fetch_steps<1>(x, k, ahead.next, 0, fetching, step); break;
    case 2: fetch_steps<2>(x, k, ahead.next, 0, fetching, step); break;
    case 3: fetch_steps<3>(x, k, ahead.next, 0, fetching, step); break;
    default: fetch_steps<4>(x, k, ahead.next, 0, fetching, step); break;
  }
  fetch_steps<0>(x, k, nullptr, fetching, full, step);
  if (k & 1) step(full, [=](int r) { return static_cast<uint32_t>(x[r * k + k - 1]); });
}

// for_each_pair with a side stream: the same steps in the same order, the first
// ceil(side.left / 2) of them also fetching two side lines each (lines past two a step
// are left unfetched). Three stretches: both kinds of fetch, then whichever kind has
// steps left, then none.
template <class Step>
inline void for_each_pair_side(const uint16_t* x, int64_t k, Ahead ahead, const SideCursor& from, Step&& step) {
  SideCursor side = from;  // advanced by the fetching steps
  const int64_t full = k / 2;
  const int64_t per_step = std::min(MAX_LINES_PER_STEP, ahead.per_step(full));
  const int64_t fetching = std::min(full, ahead.lines() / per_step);
  const int64_t side_steps = std::min(full, (side.left + 1) / 2);
  const int64_t both = std::min(fetching, side_steps);
  const char* line = ahead.next;
  switch (per_step) {
    case 1: line = fetch_steps_side<1>(x, k, line, 0, both, side, step); break;
    case 2: line = fetch_steps_side<2>(x, k, line, 0, both, side, step); break;
    case 3: line = fetch_steps_side<3>(x, k, line, 0, both, side, step); break;
    default: line = fetch_steps_side<4>(x, k, line, 0, both, side, step); break;
  }
  switch (fetching > both ? per_step : 0) {
    case 0: fetch_steps_side<0>(x, k, nullptr, both, side_steps, side, step); break;
    case 1: fetch_steps<1>(x, k, line, both, fetching, step); break;
    case 2: fetch_steps<2>(x, k, line, both, fetching, step); break;
    case 3: fetch_steps<3>(x, k, line, both, fetching, step); break;
    default: fetch_steps<4>(x, k, line, both, fetching, step); break;
  }
  fetch_steps<0>(x, k, nullptr, std::max(fetching, side_steps), full, step);
  if (k & 1) step(full, [=](int r) { return static_cast<uint32_t>(x[r * k + k - 1]); });
}

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t float_to_bf16(float x) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The one epilogue of every path: add the bias in float32, round once to bf16.
inline void store_row(const Problem& p, int64_t row, int64_t col0, const float* acc, int64_t count) {
  uint16_t* dst = p.y + row * p.n + col0;
  for (int64_t c = 0; c < count; ++c)
    dst[c] = float_to_bf16(p.bias ? acc[c] + bf16_to_float(p.bias[col0 + c]) : acc[c]);
}

// A call with K = 0: every output is an empty sum, 0 + its bias (the paths' pacing divides
// by K's steps, so no path runs it).
inline void store_empty_sums(const Problem& p) {
  const float zeros[COLS] = {};
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t j = 0; j < p.n; j += COLS) store_row(p, r, j, zeros, std::min<int64_t>(COLS, p.n - j));
}

// ---- vector paths ---------------------------------------------------------------
// A tile is ROWS rows x BLOCKS column blocks of accumulators; Path::tile<ROWS, BLOCKS>
// computes it over the whole K, then stores it. The driver below picks ROWS and BLOCKS
// only by where the tile sits (tails), which changes no accumulator's arithmetic.

// A copy of the accumulators for the store: the tile's own array never has its address
// taken, so GCC 12 keeps it in registers. Handed to store_tile_512 itself (which is not
// inlined), it was kept in memory too, with every k step storing each accumulator to
// the stack (tiles of 1-3 rows: 4-12 stores a step).
template <int N>
struct Accumulators { __m512 v[N]; };
template <int N>
KVLOOM_TARGET_AVX512 inline Accumulators<N> escape(const __m512 (&acc)[N]) {
  Accumulators<N> copy;
  for (int i = 0; i < N; ++i) copy.v[i] = acc[i];
  return copy;
}

// 16 float32 lanes rounded to bf16 as store_row rounds them (to nearest even on the bits,
// NaN -> 0x7fc0), so no path rounds differently. The vector and AMX tiles run only on CPUs
// with AVX-512, where this library is built with it (-march=native): there simd.h's
// bf16_pack does it in one vcvtneps2bf16 where the CPU has AVX512-BF16 (NaN and denormal
// lanes take the bit rule). The #else only keeps the file compiling for CPUs without AVX-512.
KVLOOM_TARGET_AVX512 inline __m256i round_lanes_512(__m512 sum) {
#ifdef KVLOOM_AVX512
  return kvloom_simd::bf16_pack(sum);
#else
  const __m512i bits = _mm512_castps_si512(sum);
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
  rounded = _mm512_mask_mov_epi32(_mm512_srli_epi32(rounded, 16), _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}

// The live columns of block j (those below n), and its bias as float32 (zeros without one).
KVLOOM_TARGET_AVX512 inline __mmask16 live_columns(const Problem& p, int64_t col0) {
  return static_cast<__mmask16>(p.n - col0 >= COLS ? 0xffff : (1u << (p.n - col0)) - 1);
}
KVLOOM_TARGET_AVX512 inline __m512 bias_lanes(const Problem& p, int64_t col0, __mmask16 live) {
  if (!p.bias) return _mm512_setzero_ps();
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p.bias + col0)), 16));
}
// store_row on 16 lanes at once: the same float32 bias add (none without a bias: adding
// zero would turn -0 into +0) and round_lanes_512's rounding.
KVLOOM_TARGET_AVX512 inline void store_lanes(const Problem& p, int64_t row, int64_t col0, __m512 acc, __m512 bias,
                                             __mmask16 live) {
  const __m512 sum = p.bias ? _mm512_add_ps(acc, bias) : acc;
  _mm256_mask_storeu_epi16(p.y + row * p.n + col0, live, round_lanes_512(sum));
}

template <int ROWS, int BLOCKS>
KVLOOM_TARGET_AVX512 inline void store_tile_512(const Problem& p, int64_t m0, int64_t j0,
                                                const Accumulators<ROWS * BLOCKS>& acc) {
  unrolled<BLOCKS>([&](auto b) KVLOOM_TARGET_AVX512 {
    const int64_t col0 = (j0 + b) * COLS;
    const __mmask16 live = live_columns(p, col0);
    const __m512 bias = bias_lanes(p, col0, live);
    unrolled<ROWS>([&](auto r) KVLOOM_TARGET_AVX512 { store_lanes(p, m0 + r, col0, acc.v[r * BLOCKS + b], bias, live); });
  });
}

// Accumulator (r, b) is acc[r * B + b].
struct PathAvx512Bf16 {
  static constexpr int ROWS = 6, BLOCKS = 4;  // 24 accumulators + 4 weight registers + 1
  static constexpr bool SIDE_STREAM = true;  // tiles that fetch a side stream too (tile<R, B, true>)
  static constexpr bool EVEN_ROWS = true;  // a pass's rows shared out evenly from three tiles on (tile_start)
  static void begin_thread() {}  // what a thread sets up before its first tile of a call (AMX: the tiles)
  static void end_thread() {}
  // flatten: the side tiles' extra loops otherwise leave the per-row lambdas out of
  // line, and the accumulators in memory (3x slower).
  template <int R, int B, bool SIDE>
  KVLOOM_TARGET_AVX512_BF16 __attribute__((flatten)) static void tile(const Problem& p, int64_t m0, int64_t j0,
                                                                      Ahead ahead, const SideCursor& side) {
    __m512 acc[R * B];
    unrolled<R * B>([&](auto i) KVLOOM_TARGET_AVX512_BF16 { acc[i] = _mm512_setzero_ps(); });
    const uint32_t* w[B];
    for (int b = 0; b < B; ++b) w[b] = p.block(j0 + b);
    const auto step = [&](int64_t q, auto pair_of_row) KVLOOM_TARGET_AVX512_BF16 {
      __m512bh weights[B];
      unrolled<B>([&](auto b) KVLOOM_TARGET_AVX512_BF16 {
        weights[b] = (__m512bh)_mm512_loadu_si512(w[b] + q * WORDS_PER_ROW);
      });
      unrolled<R>([&](auto r) KVLOOM_TARGET_AVX512_BF16 {
        const __m512bh inputs = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of_row(r)));
        unrolled<B>([&](auto b) KVLOOM_TARGET_AVX512_BF16 {
          acc[r * B + b] = _mm512_dpbf16_ps(acc[r * B + b], inputs, weights[b]);
        });
      });
    };
    if constexpr (SIDE) for_each_pair_side(p.x + m0 * p.k, p.k, ahead, side, step);
    else for_each_pair(p.x + m0 * p.k, p.k, ahead, step);
    store_tile_512<R, B>(p, m0, j0, escape(acc));
  }
};

struct PathAvx512 {
  static constexpr int ROWS = 4, BLOCKS = 4;  // 16 accumulators + 8 weight registers + 2
  static constexpr bool SIDE_STREAM = false;
  static constexpr bool EVEN_ROWS = true;
  static void begin_thread() {}
  static void end_thread() {}
  template <int R, int B, bool SIDE>
  KVLOOM_TARGET_AVX512 static void tile(const Problem& p, int64_t m0, int64_t j0, Ahead ahead, const SideCursor&) {
    static_assert(!SIDE, "this path fetches no side stream");
    __m512 acc[R * B];
    unrolled<R * B>([&](auto i) KVLOOM_TARGET_AVX512 { acc[i] = _mm512_setzero_ps(); });
    const uint32_t* w[B];
    for (int b = 0; b < B; ++b) w[b] = p.block(j0 + b);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for_each_pair(p.x + m0 * p.k, p.k, ahead, [&](int64_t q, auto pair_of_row) KVLOOM_TARGET_AVX512 {
      __m512 even[B], odd[B];  // W[.][2q] and W[.][2q + 1] as float32
      unrolled<B>([&](auto b) KVLOOM_TARGET_AVX512 {
        const __m512i words = _mm512_loadu_si512(w[b] + q * WORDS_PER_ROW);
        even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
        odd[b] = _mm512_castsi512_ps(_mm512_and_si512(words, high));
      });
      unrolled<R>([&](auto r) KVLOOM_TARGET_AVX512 {
        const uint32_t pair = pair_of_row(r);
        const __m512 x_even = _mm512_set1_ps(bf16_to_float(static_cast<uint16_t>(pair)));
        const __m512 x_odd = _mm512_set1_ps(bf16_to_float(static_cast<uint16_t>(pair >> 16)));
        unrolled<B>([&](auto b) KVLOOM_TARGET_AVX512 {
          acc[r * B + b] = _mm512_fmadd_ps(x_even, even[b], acc[r * B + b]);  // k = 2q, then 2q + 1
          acc[r * B + b] = _mm512_fmadd_ps(x_odd, odd[b], acc[r * B + b]);
        });
      });
    });
    store_tile_512<R, B>(p, m0, j0, escape(acc));
  }
};

// Tile functions of every (rows, blocks) up to the path's maximum, indexed [rows - 1][blocks - 1].
// side[][]: the same tiles fetching a side stream too, where the path has them (else null).
// The side cursor by reference: built by value for each call it cost a store-forwarding
// stall a tile (its 40 bytes written as two halves on the stack, read back whole).
using TileFn = void (*)(const Problem&, int64_t, int64_t, Ahead, const SideCursor&);
template <class Path, bool SIDE, int R, int B>
TileFn tile_fn() { return &Path::template tile<R, B, SIDE>; }
template <class Path, bool SIDE, int R, int... B>
void fill_row(TileFn* row, std::integer_sequence<int, B...>) { ((row[B] = tile_fn<Path, SIDE, R, B + 1>()), ...); }
template <class Path, bool SIDE, int... R>
void fill_table(TileFn (*table)[Path::BLOCKS], std::integer_sequence<int, R...>) {
  (fill_row<Path, SIDE, R + 1>(table[R], std::make_integer_sequence<int, Path::BLOCKS>()), ...);
}
template <class Path>
struct TileTable {
  TileFn at[Path::ROWS][Path::BLOCKS];
  TileFn side[Path::ROWS][Path::BLOCKS] = {};
  TileTable() {
    fill_table<Path, false>(at, std::make_integer_sequence<int, Path::ROWS>());
    if constexpr (Path::SIDE_STREAM) fill_table<Path, true>(side, std::make_integer_sequence<int, Path::ROWS>());
  }
};

// Input rows per pass over the weight: as many as keep their part of x in L2
// (about 256 KiB), so a panel is reused by every row tile of the pass; decode-sized
// calls are one pass, and the weight streams from memory once.
constexpr int64_t X_BYTES_PER_PASS = 256 * 1024;

// Where row tile i of a pass's `calls` starts (i = calls: the pass's end). From three
// tiles on, the rows are shared out evenly (20 rows: 5 + 5 + 5 + 5, not 6 + 6 + 6 + 2):
// out of cache on AMD EPYC model 17, 30 layers + head where the last tile would have 2
// rows (14, 20, 26, 32, 38) 2-13% faster over three runs, elsewhere within the noise
// (docs/results/issue17/genoa/gemm_even_tiles.txt); two tiles keep the full one first
// (7 rows: 6 + 1 ran 1 ms faster than 4 + 3). Which tile computes a row changes no bit.
// A path whose tiles have a fixed row count (AMX: 16 or 32 rows whatever the tile holds)
// keeps full tiles and one short last one (even = false).
inline int64_t tile_start(int64_t pass, int64_t pass_end, int64_t i, int64_t calls, int64_t rows_max, bool even) {
  if (calls < 3 || !even) return std::min(pass_end, pass + i * rows_max);
  return pass + (pass_end - pass) * i / calls;
}

// Splits the column blocks into one contiguous range per thread (each thread streams
// its own part of the weight) and, within a range, walks panels of BLOCKS blocks, each
// against every row tile of the pass while the panel sits in L2. A thread's share of
// the work is its (pass, panel, pair of row tiles) units in that order; one that
// finishes first takes units from the back of the other's share (work_shares.h). Units
// of two row tiles, not whole panels: a thread waits at the end for at most one unit,
// and a panel against 64 rows at K = 1536 is ~60 us of work.
constexpr int64_t TILES_PER_UNIT = 2;

// One call's plan: its passes of rows and the threads' shares of its (pass, panel,
// pair of row tiles) units.
template <class Path>
struct VectorPlan {
  int64_t pass_rows;
  PanelShares layout;
  VectorPlan(const Problem& p, int threads) : pass_rows(0), layout{} {
    const int64_t blocks = (p.n + COLS - 1) / COLS;
    pass_rows = std::max<int64_t>(1, X_BYTES_PER_PASS / (2 * std::max<int64_t>(p.k, 1)) / Path::ROWS) * Path::ROWS;
    const int64_t passes = (p.m + pass_rows - 1) / pass_rows;
    // Units per (pass, panel): the first pass's row tiles in pairs (a shorter last pass
    // leaves its last units empty).
    const int64_t groups = ((std::min(p.m, pass_rows) + Path::ROWS - 1) / Path::ROWS + TILES_PER_UNIT - 1) /
                           TILES_PER_UNIT;
    layout = PanelShares{blocks, threads, Path::BLOCKS, passes, groups};
  }
  static int threads_for(const Problem& p, int num_threads) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, (p.n + COLS - 1) / COLS)));
  }

  // The tiles of `unit` (of share unit.share), the ones from `side_from` on fetching side
  // lines [side_from, side_to) of `side` spread over them (side_to <= side_from: none).
  void run(const TileTable<Path>& table, const Problem& p, const kvloom_work::Unit& unit, const SideStream* side,
           int64_t side_from, int64_t side_to) const {
    const PanelShares::Place at = layout.place(unit);
    const int64_t pass = at.pass * pass_rows, pass_end = std::min(p.m, pass + pass_rows);
    const int64_t calls = (pass_end - pass + Path::ROWS - 1) / Path::ROWS;  // row tiles per panel
    const AheadPlan plan{p, at.last};
    const auto next = layout.ahead(plan, at, unit.stolen);  // sliced over the panel's row tiles
    const int64_t first = at.group * TILES_PER_UNIT, end = std::min(calls, (at.group + 1) * TILES_PER_UNIT);
    for (int64_t i = first; i < end; ++i) {
      const int64_t m0 = tile_start(pass, pass_end, i, calls, Path::ROWS, Path::EVEN_ROWS);
      const int64_t rows = tile_start(pass, pass_end, i + 1, calls, Path::ROWS, Path::EVEN_ROWS) - m0;
      if (side_to > side_from) {
        const int64_t t = i - first, n = end - first, lines = side_to - side_from;
        table.side[rows - 1][at.panel - 1](p, m0, at.j0, plan.slice(next, i, calls),
                                           SideCursor::lines(*side, side->first + side_from + lines * t / n,
                                                             side->first + side_from + lines * (t + 1) / n));
      } else {
        table.at[rows - 1][at.panel - 1](p, m0, at.j0, plan.slice(next, i, calls), NO_SIDE);
      }
    }
  }
};

// With a side stream (a path whose SIDE_STREAM is true), unit u of the call's U units
// (numbered share by share) fetches its lines [first + L u / U, first + L (u + 1) / U),
// whichever thread runs it, split evenly over its row tiles: every line once, spread
// over the call's work.
template <class Path>
void run_vector(const Problem& p, int num_threads, const SideStream* side = nullptr) {
  static const TileTable<Path> table;  // built once per path (thread-safe static init)
  const int threads = VectorPlan<Path>::threads_for(p, num_threads);
  const VectorPlan<Path> plan(p, threads);
  kvloom_work::WorkShares shares(threads, [&](int s) { return plan.layout.size(s); });
  const int64_t side_lines = side != nullptr && Path::SIDE_STREAM ? side->last - side->first : 0;
  std::vector<int64_t> units_before;  // with a side stream: the units of the shares before share s
  if (side_lines > 0) {
    units_before.assign(threads + 1, 0);
    for (int s = 0; s < threads; ++s) units_before[s + 1] = units_before[s] + plan.layout.size(s);
  }
#pragma omp parallel num_threads(threads)
  {
    Path::begin_thread();
    kvloom_work::Unit unit;
    while (shares.next(omp_get_thread_num(), unit)) {
      int64_t from = 0, to = 0;  // this unit's side lines
      if (side_lines > 0) {
        const int64_t u = units_before[unit.share] + unit.index, units = units_before[threads];
        from = side_lines * u / units, to = side_lines * (u + 1) / units;
      }
      plan.run(table, p, unit, side, from, to);
    }
    Path::end_thread();
  }
}

// Many calls of one weight shape in one parallel region (a mixture-of-experts layer's
// experts: each its own rows and weight). Every call is planned as one thread's share
// (all its column blocks, panel by panel); the calls' units, one after another, are
// split into one contiguous run per thread, so each thread streams its own run of
// weights, and a thread that finishes first takes units from the back of the other's
// run. Against a call per expert (a parallel region each, both threads on every
// expert's few columns) this keeps the threads on separate weights and pays one
// barrier. A unit's tiles are the same as in its own call: no bit changes.
template <class Path>
void run_vector_grouped(const Problem* problems, int64_t count, int num_threads) {
  static const TileTable<Path> table;
  std::vector<VectorPlan<Path>> plans;
  std::vector<int64_t> units_before(1, 0);  // units of the calls before call g
  plans.reserve(count);
  for (int64_t g = 0; g < count; ++g) {
    plans.emplace_back(problems[g], 1);
    units_before.push_back(units_before.back() + plans.back().layout.size(0));
  }
  const int64_t units = units_before.back();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, units)));
  auto share_start = [&](int s) { return units * s / threads; };
  kvloom_work::WorkShares shares(threads, [&](int s) { return share_start(s + 1) - share_start(s); });
#pragma omp parallel num_threads(threads)
  {
    Path::begin_thread();
    kvloom_work::Unit unit;
    while (shares.next(omp_get_thread_num(), unit)) {
      const int64_t u = share_start(unit.share) + unit.index;
      const int64_t g = std::upper_bound(units_before.begin(), units_before.end(), u) - units_before.begin() - 1;
      plans[g].run(table, problems[g], kvloom_work::Unit{0, u - units_before[g], unit.stolen}, nullptr, 0, 0);
    }
    Path::end_thread();
  }
}

// ---- AVX2 -----------------------------------------------------------------------
// AVX2 has no bf16 arithmetic and no broadcast from a bf16 half-word, so this path
// widens both operands to float32 where that pays, and then is a plain float32 kernel.
// x is widened once per call (rows padded to an even K with a zero, as the packed
// weight is), so a broadcast is a plain load. The weight is widened one 16-column
// block at a time into a per-thread [K][16] float copy when a pass has enough rows to
// reuse it (WIDEN_MIN_ROWS); with fewer rows (decode), the tiles split each loaded
// word into its even and odd k instead. Either way every output is one accumulator
// walking k = 0, 1, 2, ... with one fma per k (the order of the AVX-512 FMA path), so
// which tile served a row never changes its bits.
struct Avx2Inputs {
  const float* x;  // x widened: [m][stride]
  int64_t stride;  // K rounded up to even
};

// The store of one row's 16 columns of block j (two 8-lane halves).
KVLOOM_TARGET_AVX2 inline void avx2_store(const Problem& p, int64_t row, int64_t j, __m256 lo, __m256 hi) {
  alignas(32) float lanes[COLS];
  _mm256_store_ps(lanes, lo);
  _mm256_store_ps(lanes + 8, hi);
  store_row(p, row, j * COLS, lanes, std::min<int64_t>(COLS, p.n - j * COLS));
}

// Rows m0 .. m0 + R of blocks j0 .. j0 + B, from the packed words, each split into its
// even and odd k where it is used. Two register plans, both 14 of the 16 registers:
//   tall (R = 3-4 rows, one block): the block's two 8-column halves are split once
//     per k pair (4 registers) and serve every row, each row's two broadcasts loaded
//     in turn: 8 accumulators at 4 rows, half the splits per fma of the wide plan;
//   wide (R = 1-2 rows, B = 2 blocks): every row's broadcasts held (4 registers) and
//     each 8-column quarter split in turn: 8 accumulators at 2 rows, where the tall
//     plan would have only 4 chains to hide the fma latency with.
// acc[r * C + quarter], 8 columns a quarter.
template <int R, int B>
KVLOOM_TARGET_AVX2 void avx2_tile_packed(const Problem& p, const Avx2Inputs& in, int64_t m0, int64_t j0, Ahead ahead) {
  constexpr int C = 2 * B;  // 8-column quarters
  constexpr bool tall = B == 1 && R >= 3;
  const int64_t stride = in.stride;
  const float* x = in.x + m0 * stride;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[R * C];
  unrolled<R * C>([&](auto i) KVLOOM_TARGET_AVX2 { acc[i] = _mm256_setzero_ps(); });
  const auto split = [&](int64_t q, int c, __m256& even, __m256& odd) KVLOOM_TARGET_AVX2 {
    const __m256i words = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p.block(j0 + c / 2) + q * WORDS_PER_ROW + 8 * (c % 2)));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(words, high));
  };
  const auto pair = [&](int64_t q) __attribute__((always_inline)) KVLOOM_TARGET_AVX2 {  // k = 2q, then 2q + 1
    if constexpr (tall) {
      __m256 even[C], odd[C];
      unrolled<C>([&](auto c) KVLOOM_TARGET_AVX2 { split(q, c, even[c], odd[c]); });
      unrolled<R>([&](auto r) KVLOOM_TARGET_AVX2 {
        const __m256 x_even = _mm256_broadcast_ss(x + r * stride + 2 * q);
        const __m256 x_odd = _mm256_broadcast_ss(x + r * stride + 2 * q + 1);
        unrolled<C>([&](auto c) KVLOOM_TARGET_AVX2 {
          acc[r * C + c] = _mm256_fmadd_ps(x_odd, odd[c], _mm256_fmadd_ps(x_even, even[c], acc[r * C + c]));
        });
      });
    } else {
      __m256 x_even[R], x_odd[R];
      unrolled<R>([&](auto r) KVLOOM_TARGET_AVX2 {
        x_even[r] = _mm256_broadcast_ss(x + r * stride + 2 * q);
        x_odd[r] = _mm256_broadcast_ss(x + r * stride + 2 * q + 1);
      });
      unrolled<C>([&](auto c) KVLOOM_TARGET_AVX2 {
        __m256 even, odd;
        split(q, c, even, odd);
        unrolled<R>([&](auto r) KVLOOM_TARGET_AVX2 {
          acc[r * C + c] = _mm256_fmadd_ps(x_odd[r], odd, _mm256_fmadd_ps(x_even[r], even, acc[r * C + c]));
        });
      });
    }
  };
  ahead.walk(stride / 2, pair);  // every accumulator walks q = 0, 1, ... in order
  unrolled<R * B>([&](auto i) KVLOOM_TARGET_AVX2 {
    constexpr int r = i / B, b = i % B;
    avx2_store(p, m0 + r, j0 + b, acc[r * C + 2 * b], acc[r * C + 2 * b + 1]);
  });
}

// Block j as [K][16] float32 (k rows of the block's 16 columns).
KVLOOM_TARGET_AVX2 void avx2_widen_block(const Problem& p, int64_t j, int64_t k_even, float* out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint32_t* w = p.block(j);
  for (int64_t q = 0; q < k_even / 2; ++q)
    for (int h = 0; h < 2; ++h) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * WORDS_PER_ROW + 8 * h));
      _mm256_store_ps(out + (2 * q) * COLS + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
      _mm256_store_ps(out + (2 * q + 1) * COLS + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(words, high)));
    }
}

// Rows m0 .. m0 + R of block j from its widened copy: at 6 rows, 12 accumulators
// (acc[2r], acc[2r + 1]: enough to hide the fma latency), 2 weight registers and a
// broadcast.
template <int R>
KVLOOM_TARGET_AVX2 void avx2_tile_widened(const Problem& p, const Avx2Inputs& in, const float* wf, int64_t m0,
                                          int64_t j, Ahead ahead) {
  const int64_t stride = in.stride;
  const float* x = in.x + m0 * stride;
  __m256 acc[2 * R];
  unrolled<2 * R>([&](auto i) KVLOOM_TARGET_AVX2 { acc[i] = _mm256_setzero_ps(); });
  const auto step = [&](int64_t k) __attribute__((always_inline)) KVLOOM_TARGET_AVX2 {
    const __m256 lo = _mm256_load_ps(wf + k * COLS), hi = _mm256_load_ps(wf + k * COLS + 8);
    unrolled<R>([&](auto r) KVLOOM_TARGET_AVX2 {
      const __m256 v = _mm256_broadcast_ss(x + r * stride + k);
      acc[2 * r] = _mm256_fmadd_ps(v, lo, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(v, hi, acc[2 * r + 1]);
    });
  };
  ahead.walk(stride, step);  // k = 0, 1, ... in order
  unrolled<R>([&](auto r) KVLOOM_TARGET_AVX2 { avx2_store(p, m0 + r, j, acc[2 * r], acc[2 * r + 1]); });
}

constexpr int AVX2_TALL_ROWS = 4, AVX2_PACKED_BLOCKS = 2, AVX2_WIDE_ROWS = 6;
constexpr int64_t WIDEN_MIN_ROWS = 24;  // a widened block pays for itself from about here (measured)

void run_avx2(const Problem& p, int num_threads) {
  using PackedFn = void (*)(const Problem&, const Avx2Inputs&, int64_t, int64_t, Ahead);
  using WideFn = void (*)(const Problem&, const Avx2Inputs&, const float*, int64_t, int64_t, Ahead);
  static const WideFn wide[6] = {avx2_tile_widened<1>, avx2_tile_widened<2>, avx2_tile_widened<3>,
                                 avx2_tile_widened<4>, avx2_tile_widened<5>, avx2_tile_widened<6>};
  // packed[rows - 1][blocks - 1] for a panel's last 1-2 rows; tall[rows - 3] for 3-4 rows of one block
  static const PackedFn packed[2][2] = {{avx2_tile_packed<1, 1>, avx2_tile_packed<1, 2>},
                                        {avx2_tile_packed<2, 1>, avx2_tile_packed<2, 2>}};
  static const PackedFn tall[2] = {avx2_tile_packed<3, 1>, avx2_tile_packed<4, 1>};
  static thread_local std::vector<float> widened_x;  // the calling thread's, reused across calls
  const int64_t stride = round_up(p.k, 2);
  if (widened_x.size() < static_cast<size_t>(p.m * stride)) widened_x.resize(p.m * stride);
  float* const xf = widened_x.data();  // the workers reach the caller's buffer through this
  const Avx2Inputs in{xf, stride};
  const int64_t blocks = (p.n + COLS - 1) / COLS;
  const int64_t pass_rows = std::max<int64_t>(1, X_BYTES_PER_PASS / (4 * stride) / AVX2_WIDE_ROWS) * AVX2_WIDE_ROWS;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
  // Shares as run_vector's, a unit a whole (pass, panel) of two blocks.
  const PanelShares layout{blocks, threads, AVX2_PACKED_BLOCKS, (p.m + pass_rows - 1) / pass_rows, 1};
  kvloom_work::WorkShares shares(threads, [&](int s) { return layout.size(s); });
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.m; ++r) {
      for (int64_t c = 0; c < p.k; ++c) xf[r * stride + c] = bf16_to_float(p.x[r * p.k + c]);
      if (p.k & 1) xf[r * stride + p.k] = 0.0f;
    }  // the loop's implicit barrier: every row is widened before any tile reads it
    static thread_local std::vector<float> wf;  // this thread's widened block, kept across calls (no allocation per call)
    kvloom_work::Unit unit;
    while (shares.next(omp_get_thread_num(), unit)) {
      const PanelShares::Place at = layout.place(unit);
      const int64_t pass = at.pass * pass_rows, pass_end = std::min(p.m, pass + pass_rows);
      const int64_t j0 = at.j0, panel = at.panel;
      const AheadPlan plan{p, at.last};
      const auto next = layout.ahead(plan, at, unit.stolen);
      if (pass_end - pass >= WIDEN_MIN_ROWS) {  // each block widened once for the pass's rows
        if (wf.size() < static_cast<size_t>(stride * COLS + 8)) wf.resize(stride * COLS + 8);
        float* const block = wf.data() + (8 - reinterpret_cast<uintptr_t>(wf.data()) / 4 % 8) % 8;  // 32-byte aligned
        const int64_t calls = (pass_end - pass + AVX2_WIDE_ROWS - 1) / AVX2_WIDE_ROWS * panel;
        for (int64_t b = 0, i = 0; b < panel; ++b) {
          avx2_widen_block(p, j0 + b, stride, block);
          for (int64_t m0 = pass; m0 < pass_end; m0 += AVX2_WIDE_ROWS, ++i)
            wide[std::min<int64_t>(AVX2_WIDE_ROWS, pass_end - m0) - 1](p, in, block, m0, j0 + b,
                                                                       plan.slice(next, i, calls));
        }
      } else {
        // The calls per panel, as the loop below makes them: a tall tile per block for
        // every 4 rows while 3 or more are left, then one packed tile for the last 1-2.
        const int64_t tall_groups = (pass_end - pass + 1) / AVX2_TALL_ROWS;
        const int64_t calls = tall_groups * panel + ((pass_end - pass - tall_groups * AVX2_TALL_ROWS) > 0 ? 1 : 0);
        int64_t m0 = pass, i = 0;
        for (; pass_end - m0 >= 3; m0 += AVX2_TALL_ROWS) {
          const int rows = static_cast<int>(std::min<int64_t>(AVX2_TALL_ROWS, pass_end - m0));
          for (int64_t b = 0; b < panel; ++b) tall[rows - 3](p, in, m0, j0 + b, plan.slice(next, i++, calls));
        }
        if (m0 < pass_end) packed[pass_end - m0 - 1][panel - 1](p, in, m0, j0, plan.slice(next, i, calls));
      }
    }
  }
}

// ---- AMX ------------------------------------------------------------------------
// Tiles: 0-3 accumulators (16 rows x 16 float32), 4-5 inputs (16 rows x 32 bf16),
// 6-7 weights (16 k pairs x 16 columns: 16 rows of a packed block). A step computes
// up to 32 rows x 32 columns over the whole K.
constexpr int64_t AMX_ROWS = 16;

KVLOOM_TARGET_AMX void amx_configure() {
  kvloom_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) config.set(t, AMX_ROWS, 64);
  _tile_loadconfig(&config);
}

// Rows [row0, row0 + count) of an accumulator tile for column block j, stored to
// `scratch`: rounded into y a row (16 float32 lanes) at a time, as the vector paths store
// theirs. It was store_row's scalar loop: by instruction count more work than the tile's
// products at K = 576 (256 roundings of ~8 instructions against 18 tdpbf16ps); not yet
// timed on an AMX machine.
KVLOOM_TARGET_AMX inline void amx_store(const Problem& p, const float* scratch, int64_t row0, int64_t count,
                                        int64_t j) {
  const int64_t col0 = j * COLS;
  const __mmask16 live = live_columns(p, col0);
  const __m512 bias = bias_lanes(p, col0, live);
  for (int64_t r = 0; r < count; ++r) store_lanes(p, row0 + r, col0, _mm512_load_ps(scratch + r * COLS), bias, live);
}

// The side lines an AMX chunk (K_ALIGN / 2 k pairs) fetches at most: two a k pair, the
// vector tiles' pace. Not timed on an AMX machine.
constexpr int64_t MAX_SIDE_LINES_PER_CHUNK = K_ALIGN;

// Rows [m0, m0 + rows) and blocks j0 .. j0 + COL_TILES of y from x's rows (x_stride apart;
// the tiles read 16 or 32 of them, whatever rows holds), fetching `ahead`'s lines over its
// K chunks as the vector tiles do over their k steps, and `from`'s side lines spread
// evenly over the chunks (lines past MAX_SIDE_LINES_PER_CHUNK a chunk are left unfetched,
// as the vector tiles leave those past two a step).
template <int ROW_TILES, int COL_TILES>
KVLOOM_TARGET_AMX void amx_step(const Problem& p, const uint16_t* x, int64_t x_stride, int64_t m0, int64_t rows,
                                int64_t j0, Ahead ahead, const SideCursor& from) {
  const int64_t chunks = round_up(p.k, K_ALIGN) / K_ALIGN;
  const int64_t x_bytes = x_stride * 2;
  const int64_t per_chunk = ahead.per_step(chunks);
  SideCursor side = from;  // advanced by the chunks' fetches
  const int64_t side_per_chunk = std::min(MAX_SIDE_LINES_PER_CHUNK, (side.left + chunks - 1) / chunks);
  int64_t side_left = std::min(side.left, side_per_chunk * chunks);
  _tile_zero(0);
  if (COL_TILES > 1) _tile_zero(1);
  if (ROW_TILES > 1) _tile_zero(2);
  if (ROW_TILES > 1 && COL_TILES > 1) _tile_zero(3);
  const uint32_t* w0 = p.block(j0);
  const uint32_t* w1 = COL_TILES > 1 ? p.block(j0 + 1) : w0;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t i = 0; i < per_chunk && ahead.lines() > 0; ++i) ahead.fetch();
    for (int64_t i = 0; i < side_per_chunk && side_left > 0; ++i, --side_left) side.fetch();
    _tile_loadd(4, x + c * K_ALIGN, x_bytes);
    if (ROW_TILES > 1) _tile_loadd(5, x + AMX_ROWS * x_stride + c * K_ALIGN, x_bytes);
    _tile_loadd(6, w0 + c * AMX_ROWS * WORDS_PER_ROW, 64);
    if (COL_TILES > 1) _tile_loadd(7, w1 + c * AMX_ROWS * WORDS_PER_ROW, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (COL_TILES > 1) _tile_dpbf16ps(1, 4, 7);
    if (ROW_TILES > 1) _tile_dpbf16ps(2, 5, 6);
    if (ROW_TILES > 1 && COL_TILES > 1) _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float scratch[AMX_ROWS * COLS];
  const int64_t first = std::min(rows, AMX_ROWS), second = rows - first;
  _tile_stored(0, scratch, 64);
  amx_store(p, scratch, m0, first, j0);
  if (COL_TILES > 1) { _tile_stored(1, scratch, 64); amx_store(p, scratch, m0, first, j0 + 1); }
  if (ROW_TILES > 1) { _tile_stored(2, scratch, 64); amx_store(p, scratch, m0 + AMX_ROWS, second, j0); }
  if (ROW_TILES > 1 && COL_TILES > 1) { _tile_stored(3, scratch, 64); amx_store(p, scratch, m0 + AMX_ROWS, second, j0 + 1); }
}

// The AMX tiles as run_vector's path, so they share its work (each thread its own column
// blocks, panels against a pass's row tiles while the panel sits in L2, the next panel
// fetched ahead, units taken from the other thread's share at the end, a side stream's
// lines fetched over the units). A tile is up to 32 rows (two AMX row tiles) by one or
// two blocks. Its AMX tiles read 16 or 32 rows: those past the tile's own come straight
// from x where they exist and K needs no padding (computed, not stored); otherwise the
// tile's rows are copied, zero-padded, into the thread's buffer, so nothing is read past
// x's end.
struct PathAmx {
  static constexpr int ROWS = 2 * AMX_ROWS, BLOCKS = 2;
  static constexpr bool SIDE_STREAM = true;
  static constexpr bool EVEN_ROWS = false;  // an AMX tile costs 16 or 32 rows whatever it holds
  KVLOOM_TARGET_AMX static void begin_thread() { amx_configure(); }
  KVLOOM_TARGET_AMX static void end_thread() { _tile_release(); }
  template <int R, int B, bool SIDE>
  KVLOOM_TARGET_AMX static void tile(const Problem& p, int64_t m0, int64_t j0, Ahead ahead, const SideCursor& side) {
    constexpr int ROW_TILES = R > AMX_ROWS ? 2 : 1;
    const int64_t k_pad = round_up(p.k, K_ALIGN);
    const uint16_t* x = p.x + m0 * p.k;
    int64_t stride = p.k;
    if (p.k != k_pad || m0 + ROW_TILES * AMX_ROWS > p.m) {
      static thread_local std::vector<uint16_t> padded;  // reused across calls
      padded.assign(ROW_TILES * AMX_ROWS * k_pad, 0);
      for (int r = 0; r < R; ++r) std::memcpy(&padded[r * k_pad], p.x + (m0 + r) * p.k, p.k * sizeof(uint16_t));
      x = padded.data();
      stride = k_pad;
    }
    amx_step<ROW_TILES, B>(p, x, stride, m0, R, j0, ahead, side);  // NO_SIDE in the plain tiles
  }
};

// ---- CPU features ---------------------------------------------------------------
uint64_t xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

int detect_isa() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE) || !(c & bit_FMA)) return ISA_NONE;
  const uint64_t os = xcr0();
  if ((os & 0x6) != 0x6) return ISA_NONE;  // the OS saves SSE and AVX state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & bit_AVX2)) return ISA_NONE;
  const unsigned leaf7_edx = d;
  const bool avx512 = (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL) && (b & bit_AVX512DQ)
                      && (os & 0xe0) == 0xe0;  // opmask and upper ZMM state
  if (!avx512) return ISA_AVX2;
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  if (!(a & (1u << 5))) return ISA_AVX512;  // AVX512_BF16
  const bool amx = (leaf7_edx & (1u << 24)) && (leaf7_edx & (1u << 22));  // AMX-TILE, AMX-BF16
  return amx && kvloom_amx::permitted() ? ISA_AMX : ISA_AVX512_BF16;
}

}  // namespace

extern "C" {

// The best path this CPU (and OS) runs; asks Linux for AMX state the first time.
int kvloom_gemm_best_isa() {
  static const int best = detect_isa();
  return best;
}

// bf16 elements a packed [n, k] weight takes (see the layout at the top).
int64_t kvloom_gemm_packed_elements(int64_t n, int64_t k) { return round_up(n, COLS) * round_up(k, K_ALIGN); }

// weight: [n, k] bf16 row-major -> packed (kvloom_gemm_packed_elements(n, k) bf16, zero padding).
void kvloom_gemm_pack(const uint16_t* weight, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t k_pad = round_up(k, K_ALIGN), blocks = round_up(n, COLS) / COLS;
  std::memset(packed, 0, kvloom_gemm_packed_elements(n, k) * sizeof(uint16_t));
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t c = 0; c < COLS && j * COLS + c < n; ++c) {
      const uint16_t* src = weight + (j * COLS + c) * k;
      uint16_t* block = packed + j * k_pad * COLS;
      for (int64_t kk = 0; kk < k; ++kk) block[(kk / 2) * 2 * COLS + 2 * c + (kk & 1)] = src[kk];
    }
}

// kvloom_gemm_bf16 that also fetches `side`'s lines (side_stream.h; nullptr: none) into
// L2 while it computes, on the AVX512-BF16 and AMX paths; the others ignore it. The
// same result bit for bit.
int kvloom_gemm_bf16_side(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y, int64_t m,
                          int64_t n, int64_t k, int isa, int num_threads, const SideStream* side) {
  if (isa <= ISA_NONE || isa > kvloom_gemm_best_isa()) return -1;
  const Problem p{x, reinterpret_cast<const uint32_t*>(packed), bias, y, m, n, k, round_up(k, K_ALIGN) / 2 * COLS};
  if (m == 0 || n == 0) return 0;
  if (k == 0) {  // empty sums (the paths' pacing divides by K's steps): each output is 0 + its bias
    store_empty_sums(p);
    return 0;
  }
  switch (isa) {
    case ISA_AMX: run_vector<PathAmx>(p, num_threads, side); break;
    case ISA_AVX512_BF16: run_vector<PathAvx512Bf16>(p, num_threads, side); break;
    case ISA_AVX512: run_vector<PathAvx512>(p, num_threads); break;
    default: run_avx2(p, num_threads); break;
  }
  return 0;
}

// A grouped matmul: for each group g, rows [starts[g], starts[g + 1]) of y[m, n] =
// those rows of x[m, k] @ W_g^T, where W_g is the packed weight at packed + g *
// weight_stride (bf16 elements); a group without rows reads nothing. Every row's
// result is the one kvloom_gemm_bf16 gives it with W_g. Returns 0, -1 when isa is not
// one this CPU runs, -2 when starts does not rise from 0 to m (nothing written).
int kvloom_gemm_grouped_bf16(const uint16_t* x, const uint16_t* packed, const int64_t* starts, uint16_t* y,
                             int64_t groups, int64_t m, int64_t n, int64_t k, int64_t weight_stride, int isa,
                             int num_threads) {
  if (isa <= ISA_NONE || isa > kvloom_gemm_best_isa()) return -1;
  if (starts[0] != 0 || starts[groups] != m) return -2;
  for (int64_t g = 0; g < groups; ++g)
    if (starts[g + 1] < starts[g]) return -2;
  if (m == 0 || n == 0) return 0;
  std::vector<Problem> problems;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = starts[g + 1] - starts[g];
    if (rows == 0) continue;
    problems.push_back(Problem{x + starts[g] * k, reinterpret_cast<const uint32_t*>(packed + g * weight_stride),
                               nullptr, y + starts[g] * n, rows, n, k, round_up(k, K_ALIGN) / 2 * COLS});
  }
  if (k == 0) {
    for (const Problem& p : problems) store_empty_sums(p);
    return 0;
  }
  const int64_t count = static_cast<int64_t>(problems.size());
  switch (isa) {
    case ISA_AMX: run_vector_grouped<PathAmx>(problems.data(), count, num_threads); break;
    case ISA_AVX512_BF16: run_vector_grouped<PathAvx512Bf16>(problems.data(), count, num_threads); break;
    case ISA_AVX512: run_vector_grouped<PathAvx512>(problems.data(), count, num_threads); break;
    default:  // AVX2 widens x per call: one call a group
      for (const Problem& p : problems) run_avx2(p, num_threads);
      break;
  }
  return 0;
}

// y[m, n] = x[m, k] @ W^T (+ bias) on `isa` (at most kvloom_gemm_best_isa()). Returns 0,
// or -1 when isa is not one this CPU runs (nothing written).
int kvloom_gemm_bf16(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y, int64_t m,
                     int64_t n, int64_t k, int isa, int num_threads) {
  return kvloom_gemm_bf16_side(x, packed, bias, y, m, n, k, isa, num_threads, nullptr);
}

}  // extern "C"
