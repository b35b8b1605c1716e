// The paired KV layout's shared pieces: what every path of paired-layout attention
// (paged_attention.cpp: AVX-512, vdpbf16ps, AMX; paired_avx2.h: AVX2) reads and keeps.
//
// Layout (bf16 storage, block_size a multiple of 16, head_dim 32/64/128/256). Within one
// block, per kv head (h), in 32-bit words that each hold two bf16:
//   K: [h][head_dim / 2][block_size]  word (p, t) = (k[t][2p], k[t][2p + 1])
//   V: [h][block_size / 2][head_dim]  word (j, d) = (v[2j][d], v[2j + 1][d])
// So 16 consecutive keys of one dim pair are 16 consecutive words: a query's scores for
// 16 keys come out in 16 lanes of pair products against the broadcast query pair (no
// horizontal sums), and each load serves every query vector of a group. A token pair's
// V row is head_dim words, weighted by the broadcast pair of probabilities. The layout
// is written by write_paired (paged_attention.cpp), called by CPUPagedBackend.write_kv.
//
// The pair product, as Intel documents one vdpbf16ps lane: acc + a.hi * b.hi, rounded,
// then + a.lo * b.lo, rounded (hi: the bf16 in a word's upper half). A product of two
// bf16 is exact in float32, so each step is one FMA; the vector paths without
// AVX512-BF16 do exactly that (save vdpbf16ps's flushing of denormals).
//
// Invariant: every slot holds finite values (the pool is zero-filled and only ever
// receives model K/V), so a masked-out key's zero probability times its V is zero.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvloom_paired {

constexpr int64_t PREFETCH_BLOCKS = 2;  // how far ahead in the block table to prefetch

// One sequence's keys for one kv head: what every group of query vectors reads.
struct KeySource {
  const int32_t* table;  // the sequence's block table
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  int64_t block_stride;  // elements per block (all kv heads)
  int64_t head_offset;   // elements from a block's start to this kv head's K (or V)
  int64_t block_size;
  float scale;           // softmax scale, applied to the scores
  int64_t window = 0;    // a sliding window: a vector sees its last `window` keys (0: all)
  float softcap = 0.0f;  // Gemma 2's logit softcapping of the scaled scores (0: none)

  // Elements from the cache's start to block b's K (or V) of this kv head.
  int64_t block_offset(int64_t b) const { return table[b] * block_stride + head_offset; }
  // The first key a vector that sees keys [0, limit) attends under the window.
  int64_t first_key(int64_t limit) const { return window > 0 ? std::max<int64_t>(0, limit - window) : 0; }
};

// Sliding windows keep every path's bits whatever the batch: a vector's keys are walked
// in tiles of 16 at absolute positions, and a tile wholly before its first key is either
// skipped (where no vector of the group sees it) or walked with every lane masked, which
// adds exact zeros (weight 0 times a finite V); so its result does not depend on the
// group it rides in, nor on how its sequence was cut into steps.

// Gemma 2's attention logit softcapping: each scaled score s -> cap * tanh(s / cap), in
// place (cap > 0); a score's own arithmetic, whatever path or group computed it.
inline void soft_cap(float* scores, int64_t n, float cap) {
  for (int64_t t = 0; t < n; ++t) scores[t] = cap * std::tanh(scores[t] / cap);
}

// Block b + PREFETCH_BLOCKS of a walk's K and V, asked for while block b computes (the
// blocks are scattered in the pool, so the hardware cannot guess them), a K line and a
// V line per step of the walk's inner loops rather than all at once when a block is
// reached: a burst of 64 prefetches fills the core's few miss buffers and then leaves
// memory idle while the block computes; fed a line at a time, the next blocks stream in
// behind the arithmetic (decode at batch 64, 30 layers: AVX2 on Milan 27.7 -> 20.2 ms,
// AVX512-BF16 on AMD EPYC model 17 26.5-33.1 -> 25.2-28.1 ms; docs/benchmarks.md).
// Invariant: every queued block is requested in full, oldest first (a full queue
// drains its oldest at once).
struct LineFeed {
  // Into L2 (prefetcht2; locality 1), not L1: on AMD EPYC model 17, decode at batch 64
  // and context 300 (30 layers) 26.8 -> 22.0 ms, the KV read at 16.5 -> 20.1 GB/s
  // (docs/results/issue17/attention_stream.py). An L1 prefetch holds one of the L1's
  // few miss buffers until its line arrives; the L2 has several times as many.
  __attribute__((always_inline)) static inline void fetch(const char* line) { __builtin_prefetch(line, 0, 1); }
  static constexpr int SLOTS = 4;  // blocks queued at most (a walk step adds 1-2)
  const char* k[SLOTS];
  const char* v[SLOTS];
  int64_t bytes = 0;  // of one block's K (and of its V)
  int head = 0, queued = 0;
  int64_t offset = 0;  // the next line of the oldest block

  __attribute__((always_inline)) inline void add(const KeySource& src, int64_t b, int64_t num_blocks) {
    if (b + PREFETCH_BLOCKS >= num_blocks) return;
    while (queued == SLOTS) step();
    const int64_t at = src.block_offset(b + PREFETCH_BLOCKS);
    const int slot = (head + queued++) % SLOTS;
    k[slot] = reinterpret_cast<const char*>(src.k_cache + at);
    v[slot] = reinterpret_cast<const char*>(src.v_cache + at);
  }
  // A walk's first blocks (from `begin`), whose lines add() never asks for, all at
  // once at the walk's start: they are needed at once anyway.
  __attribute__((always_inline)) inline void prime(const KeySource& src, int64_t begin, int64_t num_blocks) {
    for (int64_t b = begin; b < std::min(num_blocks, begin + PREFETCH_BLOCKS); ++b) {
      const char* kb = reinterpret_cast<const char*>(src.k_cache + src.block_offset(b));
      const char* vb = reinterpret_cast<const char*>(src.v_cache + src.block_offset(b));
      for (int64_t at = 0; at < bytes; at += 64) fetch(kb + at), fetch(vb + at);
    }
  }
  // Always inlined: GCC 12 counts a prefetch as no side effect, so a function holding
  // only prefetches is "pure", and every call to it was deleted (no prefetch at all in
  // the paired kernels' assembly until this attribute).
  __attribute__((always_inline)) inline void step() {
    if (queued == 0) return;
    fetch(k[head] + offset);
    fetch(v[head] + offset);
    offset += 64;
    if (offset >= bytes) offset = 0, head = (head + 1) % SLOTS, --queued;
  }
};

// The flash-attention state of one query vector, stored between two block ranges of
// its keys (see Cascade in paged_attention.cpp): what every path keeps while it walks.
struct alignas(64) PairedState {
  float acc[256];  // head_dim floats used
  float sum[16];   // per-lane partial sums
  float row_max;
};

// Where a group's walk over the blocks starts and ends. A split walk (blocks [0, b)
// with `suspend`, then [b, end) with `resume` from the stored states) does the same
// arithmetic in the same order as one walk, so its results are bit-identical.
struct BlockRange {
  int64_t begin = 0;
  int64_t end = -1;                      // -1: up to the keys the vectors see
  PairedState* const* resume = nullptr;  // start from these states instead of zero
  PairedState* const* suspend = nullptr; // store the states here instead of the outputs
};

}  // namespace kvloom_paired
