// Paired-layout attention on AVX2 + FMA (Zen 1-3, Haswell to Alder Lake: no AVX-512).
//
// The AVX-512 FMA path (PairsFma in paged_attention.cpp) on 8-lane registers: a
// 16-key sub-tile is two halves of 8 lanes, and every lane does that path's operations
// in its order (pair products hi then lo, the scale, the running max, exp through
// exp8, per-lane partial sums, probabilities rounded to bf16, V's pair products, the
// final reduction in _mm512_reduce_add_ps's order). With 16 vector registers instead
// of 32 the accumulators cannot stay in registers: they live in an L1-resident array,
// and the V update walks a few 8-dim slices of them at a time for all vectors of the
// group, so each loaded and split V word still serves every vector.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "paired.h"
#include "simd.h"

#ifdef KVLOOM_AVX2
namespace kvloom_paired {
namespace {  // paged_attention.cpp's own: not exported from its library, called directly (no PLT)

constexpr int AVX2_GROUP = 4;  // query vectors per walk: 8 QK^T and PV chains at 4 (registers: see below)

// The two bf16 of 8 words as floats: hi (the upper halves), lo (the lower ones).
struct Split8 {
  __m256 hi, lo;
  explicit Split8(const uint32_t* words) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
    hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // acc + hi * b_hi, then + lo * b_lo: the pair product (paired.h), b broadcast.
  __m256 dot(__m256 acc, __m256 b_lo, __m256 b_hi) const {
    return _mm256_fmadd_ps(lo, b_lo, _mm256_fmadd_ps(hi, b_hi, acc));
  }
};

inline float horizontal_max(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtss_f32(m);
}

// One 16-key sub-tile of a walk: its K words (pair p of key t at k[p * block_size + t]),
// its 8 V token pairs (pair j, dim d at v[j * D + d]) and its first key's position.
struct SubTile {
  const uint32_t* k;
  const uint32_t* v;
  int64_t base;
};

// G query vectors (same kv head; the same sequence, or sequences whose block tables
// agree over the range) against the keys, flash-attention style. limit[g] is the
// number of keys vector g sees. A vector's arithmetic does not depend on the others in
// its group, nor on G.
//
// Registers. An accumulator's two fmas per dim pair (hi, then lo) depend on each other,
// and two fma pipes of 4 cycles' latency (Zen 3; Skylake-era cores alike) need 8
// independent chains to stay busy, so each loop holds 8-12 accumulators: QK^T runs
// TILES sub-tiles at once (2 x TILES x G chains), PV runs SLICES 8-dim slices of each row
// at once (SLICES x G). Where the split words and the broadcasts fit beside them (G = 4:
// 8 + 4 + 2) each word is split first and each broadcast then used twice; at G = 3 the
// 12 accumulators leave room for one split word and one broadcast pair, so the loops
// split a word and broadcast for every vector in turn (more broadcast loads, which the
// load ports take, for 12 chains instead of 6: decode at G = 3 ran 27% faster).
// None of this reorders a vector's own operations: its bits are the AVX-512 FMA path's
// whatever TILES and SLICES are.
template <int D, int G>
void attend_group_avx2(const KeySource& src, const uint16_t* const* q, const int64_t* limit,
                       uint16_t* const* out, const BlockRange& range) {
  using namespace kvloom_simd;
  constexpr int P = D / 2;                                               // dim pairs
  constexpr int S = D / 8;                                               // 8-dim slices of a row
  constexpr int TILES = G <= 3 ? 2 : 1;                                  // sub-tiles per QK^T pass
  constexpr int SLICES = std::min(S, G == 1 ? 8 : G <= 3 ? 4 : 2);       // slices per PV pass
  alignas(32) float acc[G][D];
  alignas(32) float sums[G][16];             // per-lane partial sums, reduced once at the end
  alignas(32) float query[G][D];             // query[g][2p], [2p + 1]: the pair's lo and hi
  alignas(32) float scores[TILES][G][16];    // the sub-tiles' scaled scores
  alignas(32) float weights[G][16];          // one sub-tile's probabilities, rounded to bf16
  float row_max[G];
  int64_t max_limit = 0, min_first = INT64_MAX, first_key[G];
  for (int g = 0; g < G; ++g) {
    first_key[g] = src.first_key(limit[g]);
    min_first = std::min(min_first, first_key[g]);
    if (range.resume) {
      const PairedState& st = *range.resume[g];
      std::memcpy(acc[g], st.acc, sizeof(acc[g]));
      std::memcpy(sums[g], st.sum, sizeof(sums[g]));
      row_max[g] = st.row_max;
    } else {
      std::fill(acc[g], acc[g] + D, 0.0f);
      std::fill(sums[g], sums[g] + 16, 0.0f);
      row_max[g] = -INFINITY;
    }
    for (int s = 0; s < S; ++s) _mm256_store_ps(query[g] + 8 * s, to_float8(q[g] + 8 * s));
    max_limit = std::max(max_limit, limit[g]);
  }
  const __m256 scale = _mm256_set1_ps(src.scale);
  const int64_t block_size = src.block_size;
  const int64_t num_blocks = range.end >= 0 ? range.end : (max_limit + block_size - 1) / block_size;
  // A step per dim pair of QK^T and per token pair of PV: at G = 3 and blocks of 16, a
  // pass over two sub-tiles takes 64 steps and queues two blocks of 32 + 32 lines, so
  // the feed keeps pace (two lines a step was slower, 22.5 vs 20.1 ms; so were feeding
  // 1, 3, 4 or 6 blocks ahead, 21.5-23.3 ms).
  // The first sub-tile: the range's, or the first that holds any vector's first key.
  const int64_t first_tile = std::max(range.begin * (block_size / 16), min_first / 16);
  LineFeed feed;
  feed.bytes = block_size * D * 2;
  feed.prime(src, first_tile * 16 / block_size, num_blocks);

  // QK^T of N sub-tiles: 2N 8-key halves, each split once and used by every vector.
  const auto qk = [&](const SubTile* tiles, auto n) {
    constexpr int N = decltype(n)::value;
    __m256 s[2 * N][G];
    unrolled<2 * N * G>([&](auto i) { s[i / G][i % G] = _mm256_setzero_ps(); });
    for (int p = 0; p < P; ++p) {
      feed.step();
      if constexpr (N == 1) {  // both halves split first, each broadcast then used twice
        const Split8 keys[2] = {Split8(tiles[0].k + p * block_size), Split8(tiles[0].k + p * block_size + 8)};
        unrolled<G>([&](auto g) {
          const __m256 q_lo = _mm256_broadcast_ss(&query[g][2 * p]), q_hi = _mm256_broadcast_ss(&query[g][2 * p + 1]);
          s[0][g] = keys[0].dot(s[0][g], q_lo, q_hi);
          s[1][g] = keys[1].dot(s[1][g], q_lo, q_hi);
        });
      } else {
        unrolled<2 * N>([&](auto h) {
          const Split8 keys(tiles[h / 2].k + p * block_size + 8 * (h % 2));
          unrolled<G>([&](auto g) {
            s[h][g] = keys.dot(s[h][g], _mm256_broadcast_ss(&query[g][2 * p]), _mm256_broadcast_ss(&query[g][2 * p + 1]));
          });
        });
      }
    }
    unrolled<2 * N * G>([&](auto i) {
      constexpr int h = i / G, g = i % G;
      _mm256_store_ps(scores[h / 2][g] + 8 * (h % 2), _mm256_mul_ps(s[h][g], scale));
    });
  };

  // Online softmax over one sub-tile's live keys, then its PV.
  const auto softmax_pv = [&](const SubTile& tile, const float (*tile_scores)[16]) {
    for (int g = 0; g < G; ++g) {
      const int64_t count = limit[g] - tile.base, skip = first_key[g] - tile.base;  // live: [skip, count)
      __m256 e_lo = _mm256_setzero_ps(), e_hi = _mm256_setzero_ps();
      if (count > 0 && skip < 16) {
        __m256 live_lo = live8(count, 0), live_hi = live8(count, 8);
        if (skip > 0) {  // the sub-tile holding the window's first key (one a walk): keys before it dead
          live_lo = _mm256_andnot_ps(live8(skip, 0), live_lo);
          live_hi = _mm256_andnot_ps(live8(skip, 8), live_hi);
        }
        const __m256 s_lo = _mm256_load_ps(tile_scores[g]), s_hi = _mm256_load_ps(tile_scores[g] + 8);
        const __m256 old_max = _mm256_set1_ps(row_max[g]);
        const __m256 above = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(s_lo, old_max, _CMP_GT_OQ), live_lo),
                                          _mm256_and_ps(_mm256_cmp_ps(s_hi, old_max, _CMP_GT_OQ), live_hi));
        if (_mm256_movemask_ps(above)) {  // a live score passes the running max: rescale
          const __m256 none = _mm256_set1_ps(-INFINITY);
          const float new_max = std::max(row_max[g], horizontal_max(_mm256_max_ps(
              _mm256_blendv_ps(none, s_lo, live_lo), _mm256_blendv_ps(none, s_hi, live_hi))));
          const __m256 correction = _mm256_set1_ps(std::exp(row_max[g] - new_max));
          for (int s = 0; s < S; ++s)
            _mm256_store_ps(acc[g] + 8 * s, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * s), correction));
          for (int s = 0; s < 2; ++s)
            _mm256_store_ps(sums[g] + 8 * s, _mm256_mul_ps(_mm256_load_ps(sums[g] + 8 * s), correction));
          row_max[g] = new_max;
        }
        const __m256 shift = _mm256_set1_ps(row_max[g]);
        e_lo = _mm256_and_ps(exp8(_mm256_sub_ps(s_lo, shift)), live_lo);
        e_hi = _mm256_and_ps(exp8(_mm256_sub_ps(s_hi, shift)), live_hi);
        _mm256_store_ps(sums[g], _mm256_add_ps(_mm256_load_ps(sums[g]), e_lo));
        _mm256_store_ps(sums[g] + 8, _mm256_add_ps(_mm256_load_ps(sums[g] + 8), e_hi));
      }
      _mm256_store_ps(weights[g], _mm256_castsi256_ps(bf16_bits8(e_lo)));
      _mm256_store_ps(weights[g] + 8, _mm256_castsi256_ps(bf16_bits8(e_hi)));
    }
    for (int s0 = 0; s0 < S; s0 += SLICES) {  // PV: 8 token pairs, SLICES 8-dim slices at a time
      __m256 a[SLICES][G];
      unrolled<SLICES * G>([&](auto i) { a[i / G][i % G] = _mm256_load_ps(acc[i % G] + 8 * (s0 + i / G)); });
      for (int j = 0; j < 8; ++j) {
        feed.step();
        if constexpr (SLICES == 2) {  // both slices split first, each broadcast then used twice
          const Split8 values[2] = {Split8(tile.v + j * D + 8 * s0), Split8(tile.v + j * D + 8 * s0 + 8)};
          unrolled<G>([&](auto g) {
            const __m256 w_lo = _mm256_broadcast_ss(&weights[g][2 * j]), w_hi = _mm256_broadcast_ss(&weights[g][2 * j + 1]);
            a[0][g] = values[0].dot(a[0][g], w_lo, w_hi);
            a[1][g] = values[1].dot(a[1][g], w_lo, w_hi);
          });
        } else {
          unrolled<SLICES>([&](auto s) {
            const Split8 values(tile.v + j * D + 8 * (s0 + s));
            unrolled<G>([&](auto g) {
              a[s][g] = values.dot(a[s][g], _mm256_broadcast_ss(&weights[g][2 * j]), _mm256_broadcast_ss(&weights[g][2 * j + 1]));
            });
          });
        }
      }
      unrolled<SLICES * G>([&](auto i) { _mm256_store_ps(acc[i % G] + 8 * (s0 + i / G), a[i / G][i % G]); });
    }
  };

  // The sub-tiles in order, TILES at a time (across a block boundary too), up to the
  // last one any vector sees: sub-tile t0 / 16 of block b is next.
  int64_t b = first_tile * 16 / block_size, t0 = first_tile * 16 % block_size;
  const auto keys_left = [&] { return b < num_blocks && b * block_size + t0 < max_limit; };
  while (keys_left()) {
    SubTile tiles[TILES];
    int n = 0;
    for (; n < TILES && keys_left(); ++n) {
      if (t0 == 0) feed.add(src, b, num_blocks);
      const int64_t offset = src.block_offset(b);
      tiles[n] = {reinterpret_cast<const uint32_t*>(src.k_cache + offset) + t0,
                  reinterpret_cast<const uint32_t*>(src.v_cache + offset) + t0 / 2 * D, b * block_size + t0};
      t0 += 16;
      if (t0 == block_size) t0 = 0, ++b;
    }
    if (n == TILES) {
      qk(tiles, std::integral_constant<int, TILES>());
    } else {
      qk(tiles, std::integral_constant<int, 1>());
    }
    if (src.softcap > 0)
      for (int i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) soft_cap(scores[i][g], 16, src.softcap);
    for (int i = 0; i < n; ++i) softmax_pv(tiles[i], scores[i]);
  }
  for (int g = 0; g < G; ++g) {
    if (range.suspend) {
      PairedState& st = *range.suspend[g];
      std::memcpy(st.acc, acc[g], sizeof(acc[g]));
      std::memcpy(st.sum, sums[g], sizeof(sums[g]));
      st.row_max = row_max[g];
      continue;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / reduce_add16(_mm256_load_ps(sums[g]), _mm256_load_ps(sums[g] + 8)));
    for (int s = 0; s < S; ++s) store8(out[g] + 8 * s, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * s), inv));
  }
}

template <int D>
void attend_group_avx2_dispatch(const KeySource& src, int64_t count, const uint16_t* const* q,
                                const int64_t* limit, uint16_t* const* out, const BlockRange& range) {
  switch (count) {
    case 1: return attend_group_avx2<D, 1>(src, q, limit, out, range);
    case 2: return attend_group_avx2<D, 2>(src, q, limit, out, range);
    case 3: return attend_group_avx2<D, 3>(src, q, limit, out, range);
    case 4: return attend_group_avx2<D, 4>(src, q, limit, out, range);
    default: std::abort();  // callers never pass more than AVX2_GROUP
  }
}

inline void attend_group_avx2(int64_t head_dim, const KeySource& src, int64_t count, const uint16_t* const* q,
                              const int64_t* limit, uint16_t* const* out, const BlockRange& range) {
  switch (head_dim) {
    case 64: return attend_group_avx2_dispatch<64>(src, count, q, limit, out, range);
    case 128: return attend_group_avx2_dispatch<128>(src, count, q, limit, out, range);
    case 32: return attend_group_avx2_dispatch<32>(src, count, q, limit, out, range);
    case 256: return attend_group_avx2_dispatch<256>(src, count, q, limit, out, range);
    default: std::abort();  // paired_supported was checked
  }
}

}  // namespace
}  // namespace kvloom_paired
#endif
