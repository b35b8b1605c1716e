// Latent attention for CPUs (DeepSeek's multi-head latent attention, absorbed form),
// reading the pool of latents straight through the block table.
//
// A token's cache entry is one vector of `dim` numbers, [c_kv (value_dim) | k_pe], shared
// by every head. A head's query comes in latent space (the model mapped it there through
// the head's key up-projection): its score against key t is scale * (q . latent_t), and
// its output, still in latent space, is the softmax-weighted sum of the keys' first
// value_dim numbers (attention/mla_ref.py is the PyTorch oracle). One KV "head": every
// query vector of a sequence (its rows x heads) reads the same keys. So a work item takes
// up to MAX_VECTORS of them, and each tile of 16 keys is made ready once (widened to
// float32, or laid out as bf16 pairs) and serves all of them from L1; the PyTorch
// backends gathered every request's latents into a padded tensor and ran two batched
// matmuls over it.
//
// Two paths, the caller's choice (one per process: they agree to rounding, not bit for bit):
//   float32 products (FloatPath, every CPU): the keys widened to float32, fmas;
//   bf16 products (Bf16Path, bf16 caches on AVX512-BF16): vdpbf16ps on the cache's bits.
//
// Invariant (batch invariance, the exactness promise): each output vector (one head of
// one query token) is computed by the same operations in the same order whatever else
// the call holds, so a token gets the same bits alone or batched, whole or chunked:
//   its keys come in tiles [16u, 16u + 16) of absolute positions, u = 0, 1, ..., up to
//     its own position (a query sees the keys at or before it);
//   a key's score: 16 float32 lanes, lane l taking the products of its share of q and k
//     (float32: q[16c + l] * k[16c + l] for c = 0, 1, ..., a product, then fmas; bf16: the
//     pairs (32c + 2l, 32c + 2l + 1), a vdpbf16ps each), the lanes summed in one fixed
//     tree, times scale;
//   per tile: the running max over its live scores; where it moves, the accumulator and
//     the 16-lane sum multiplied by exp(old - new); e = exp(score - max); sum += e; then
//     acc += e_t * value_t for its live keys t in order (float32: an fma a key; bf16: e
//     rounded to bf16, a vdpbf16ps a pair of keys);
//   at the end acc times 1 / (the sum's lanes in a fixed tree), rounded once.
// Which item, thread or group of vectors computes it never enters. The float32 path's
// vectors are AVX-512, AVX2 or scalar as the build has them (-march=native), each with
// its own fixed order.
//
// Built without -ffast-math (kvloom/native.py's EXACT_SOURCES): the compiler keeps the
// order of the sums written here (it may fuse a product into the sum it feeds: one fixed
// choice per build, the same for every vector).
//
// Also here: kvloom_latent_rotary, the rotary part of DeepSeek's queries and keys in
// float32 as transformers computes it, bit for bit (rotate_rows). Plain C ABI, called through ctypes (kvloom/kernels/latent_attention.py
// registers it as the PyTorch op kvloom::latent_attention).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "simd.h"

namespace {

using kvloom_simd::from_float;  // float32 or bf16 out, rounded to nearest even
using kvloom_simd::to_float;    // float32 or bf16 in
using kvloom_simd::unrolled;

constexpr int64_t KEYS = 16;          // keys per tile (lanes of a score vector)
constexpr int64_t MAX_ROWS = 16;      // query rows per work item
constexpr int64_t MAX_VECTORS = 128;  // query vectors (rows x heads) per work item

// ---- 16 float32 lanes, on each path -------------------------------------------------
#if defined(KVLOOM_AVX512)
struct V16 {
  __m512 v;
};
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 splat(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 load(const uint16_t* p) {  // 16 bf16, widened
  return {_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}
inline void store(float* p, V16 x) { _mm512_storeu_ps(p, x.v); }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
inline V16 exp(V16 x) { return {kvloom_simd::exp16(x.v)}; }
inline V16 first_lanes(V16 x, int64_t live, float fill) {  // lanes >= live become fill
  return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), kvloom_simd::lanes(live), x.v)};
}
inline float max_lane(V16 x) { return _mm512_reduce_max_ps(x.v); }
inline float sum_lanes(V16 x) { return _mm512_reduce_add_ps(x.v); }
inline V16 sums_of(const V16* parts) {  // lane j: the sum of parts[j]'s lanes
  __m512 raw[KEYS];
  for (int j = 0; j < KEYS; ++j) raw[j] = parts[j].v;
  return {kvloom_simd::sum16(raw)};
}
constexpr int PV_CHUNKS = 8;  // value chunks held in registers across a tile's keys
constexpr int KEY_GROUP = 16;  // keys whose score chains run side by side
#elif defined(KVLOOM_AVX2)
struct V16 {
  __m256 lo, hi;
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load(const uint16_t* p) { return {kvloom_simd::to_float8(p), kvloom_simd::to_float8(p + 8)}; }
inline void store(float* p, V16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 exp(V16 x) { return {kvloom_simd::exp8(x.lo), kvloom_simd::exp8(x.hi)}; }
inline V16 first_lanes(V16 x, int64_t live, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, x.lo, kvloom_simd::live8(live, 0)), _mm256_blendv_ps(f, x.hi, kvloom_simd::live8(live, 8))};
}
inline float max_lane(V16 x) {
  alignas(32) float lanes[16];
  store(lanes, x);
  return *std::max_element(lanes, lanes + 16);
}
inline float sum_lanes(V16 x) { return kvloom_simd::reduce_add16(x.lo, x.hi); }
inline V16 sums_of(const V16* parts) {
  alignas(32) float sums[KEYS];
  for (int j = 0; j < KEYS; ++j) sums[j] = sum_lanes(parts[j]);
  return load(sums);
}
constexpr int PV_CHUNKS = 4;  // two registers a chunk: 8 of the 16
constexpr int KEY_GROUP = 4;
#else
struct V16 {
  float l[16];
};
inline V16 zero() { return {}; }
inline V16 splat(float x) {
  V16 r;
  for (float& lane : r.l) lane = x;
  return r;
}
inline V16 load(const float* p) {
  V16 r;
  std::memcpy(r.l, p, sizeof(r.l));
  return r;
}
inline V16 load(const uint16_t* p) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.l[i] = kvloom_simd::to_float(p[i]);
  return r;
}
inline void store(float* p, V16 x) { std::memcpy(p, x.l, sizeof(x.l)); }
inline V16 mul(V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.l[i] *= b.l[i];
  return a;
}
inline V16 add(V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.l[i] += b.l[i];
  return a;
}
inline V16 fma(V16 a, V16 b, V16 c) {
  for (int i = 0; i < 16; ++i) c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
inline V16 exp(V16 x) {
  for (float& lane : x.l) lane = std::exp(lane);
  return x;
}
inline V16 first_lanes(V16 x, int64_t live, float fill) {
  for (int64_t i = std::max<int64_t>(live, 0); i < 16; ++i) x.l[i] = fill;
  return x;
}
inline float max_lane(V16 x) { return *std::max_element(x.l, x.l + 16); }
inline float sum_lanes(V16 x) {  // halves, quarters, pairs: the vector paths' tree
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) x.l[i] += x.l[i + width];
  return x.l[0];
}
inline V16 sums_of(const V16* parts) {
  V16 r;
  for (int j = 0; j < KEYS; ++j) r.l[j] = sum_lanes(parts[j]);
  return r;
}
constexpr int PV_CHUNKS = 1;
constexpr int KEY_GROUP = 1;
#endif

inline V16 sub(V16 a, float b) { return add(a, splat(-b)); }  // exact: a - b is a + (-b)

// ---- the call ---------------------------------------------------------------------
struct Call {
  const void* q;          // [tokens, heads, dim]
  void* out;              // [tokens, heads, value_dim]
  const void* cache;      // [blocks, block_size, dim]
  const int32_t* block_tables;  // [seqs, max_blocks]
  int64_t max_blocks;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* query_lens;
  int64_t num_seqs, heads, dim, value_dim, block_size;
  float scale;
  int64_t width;  // dim rounded up to 16: the float rows' width (zeros past dim)
};

// A work item: rows [row0, row0 + rows) of sequence seq, heads [head0, head0 + count).
struct Item {
  int64_t seq, row0, rows, head0, count, cost;
};

// Items of up to MAX_ROWS rows and MAX_VECTORS vectors; heads split further where the
// items would be too few to keep every thread busy (a decode batch of one or two). Longest
// first (threads take items as they free up: the one that sees the most keys must not
// come last). Items never change a result.
std::vector<Item> make_items(const Call& c, int threads) {
  std::vector<Item> tiles;
  for (int64_t s = 0; s < c.num_seqs; ++s)
    for (int64_t r = 0; r < c.query_lens[s]; r += MAX_ROWS) {
      const int64_t rows = std::min<int64_t>(MAX_ROWS, c.query_lens[s] - r);
      tiles.push_back({s, r, rows, 0, c.heads, rows * (c.seq_lens[s] - c.query_lens[s] + r + rows)});
    }
  const int64_t wanted = std::max<int64_t>(1, (2 * threads + static_cast<int64_t>(tiles.size()) - 1)
                                                  / std::max<int64_t>(1, static_cast<int64_t>(tiles.size())));
  std::vector<Item> items;
  for (const Item& tile : tiles) {
    const int64_t most_heads = MAX_VECTORS / tile.rows;  // an item's rows x heads fit the scratch
    const int64_t splits = std::min(c.heads, std::max(wanted, (c.heads + most_heads - 1) / most_heads));
    for (int64_t i = 0; i < splits; ++i) {  // heads [i H / splits, (i + 1) H / splits): even shares
      Item item = tile;
      item.head0 = i * c.heads / splits;
      item.count = (i + 1) * c.heads / splits - item.head0;
      item.cost = tile.cost * item.count;
      items.push_back(item);
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}


// A vector's running softmax state: acc [value chunks x 16] float32, the 16-lane sum, the max.
struct State {
  float* acc;
  float* sum;
  float* max;
};

// The online-softmax step every path shares: the tile's scores (sums of the key products,
// lane t key t) scaled, keys from `live` on masked, the state rescaled where the max moves,
// and e = exp(score - max) added to the sum. Returns e (zero past live).
inline V16 softmax_step(const Call& c, V16 products, int64_t live, const State& st) {
  const V16 scores = first_lanes(mul(products, splat(c.scale)), live, -INFINITY);
  const float top = std::max(*st.max, max_lane(scores));
  V16 total = load(st.sum);
  if (top != *st.max) {  // rescale what was accumulated under the old max (none before the first tile)
    if (*st.max != -INFINITY) {
      const V16 f = splat(std::exp(*st.max - top));
      for (int64_t d = 0; d < c.value_dim; d += 16) store(st.acc + d, mul(load(st.acc + d), f));  // whole chunks
      total = mul(total, f);
    }
    *st.max = top;
  }
  const V16 e = first_lanes(exp(sub(scores, top)), live, 0.0f);  // exp16 floors at 2^-126: dead lanes zeroed
  store(st.sum, add(total, e));
  return e;
}

// ---- float32 products (every CPU) ---------------------------------------------------
// A tile: 16 keys widened to float32 rows of `width` (zero past dim: a zero product
// changes no sum; acc's chunks past value_dim collect what no output reads).
struct FloatPath {
  using Query = float;
  std::vector<float> keys;
  explicit FloatPath(const Call& c) : keys(KEYS * c.width, 0.0f) {}
  static int64_t query_width(const Call& c) { return c.width; }
  template <class T>
  static float query_value(T x) { return to_float(x); }  // bf16 widened

  template <class T>
  void load_tile(const Call& c, const T* const* rows, int64_t count) {
    for (int64_t t = 0; t < count; ++t) {
      float* dst = &keys[t * c.width];
      int64_t d = 0;
      for (; d + 16 <= c.dim; d += 16) store(dst + d, load(rows[t] + d));
      for (; d < c.dim; ++d) dst[d] = to_float(rows[t][d]);
    }
  }

  // acc[16 c0, 16 (c0 + N)) += e[t] * keys[t][the same] for t < live: N chunks held in
  // registers across the keys (a chunk's fmas run in key order).
  template <int N>
  void add_values(const Call& c, float* acc, const float* e, int64_t live, int64_t c0) const {
    V16 a[N];
    unrolled<N>([&](auto i) { a[i] = load(acc + 16 * (c0 + i)); });
    for (int64_t t = 0; t < live; ++t) {
      const V16 w = splat(e[t]);
      const float* key = keys.data() + t * c.width;
      unrolled<N>([&](auto i) { a[i] = fma(w, load(key + 16 * (c0 + i)), a[i]); });
    }
    unrolled<N>([&](auto i) { store(acc + 16 * (c0 + i), a[i]); });
  }

  void attend(const Call& c, const float* query, int64_t live, const State& st) const {
    V16 parts[KEYS];  // key j's 16 lanes, KEY_GROUP keys' chains at a time in registers
    for (int j0 = 0; j0 < KEYS; j0 += KEY_GROUP) {
      const float* group = keys.data() + j0 * c.width;
      unrolled<KEY_GROUP>([&](auto j) { parts[j0 + j] = mul(load(group + j * c.width), load(query)); });
      for (int64_t d = 16; d < c.width; d += 16) {
        const V16 qd = load(query + d);
        unrolled<KEY_GROUP>([&](auto j) { parts[j0 + j] = fma(load(group + j * c.width + d), qd, parts[j0 + j]); });
      }
    }
    alignas(64) float e[KEYS];
    store(e, softmax_step(c, sums_of(parts), live, st));
    const int64_t chunks = (c.value_dim + 15) / 16;
    int64_t c0 = 0;
    for (; c0 + PV_CHUNKS <= chunks; c0 += PV_CHUNKS) add_values<PV_CHUNKS>(c, st.acc, e, live, c0);
    for (; c0 < chunks; ++c0) add_values<1>(c, st.acc, e, live, c0);
  }
};

#if defined(KVLOOM_AVX512) && defined(__AVX512BF16__)
#define KVLOOM_LATENT_BF16 1
// ---- bf16 products (vdpbf16ps) ------------------------------------------------------
// A bf16 cache and bf16 queries: each instruction takes 32 products of bf16 pairs into
// 16 float32 lanes, twice the float32 path's work per instruction, from the cache's own
// bits. A key's score: lane l takes the pairs (2l, 2l + 1) of every 32 numbers in
// order, then the lanes' fixed tree; the weights e rounded to bf16 (as the reference's
// softmax output is) weigh pairs of keys: acc += e_2p v_2p + e_2p+1 v_2p+1, p in order.
// A tile: its keys' bf16 rows of `pad` numbers (dim rounded up to 32, zeros past it) for
// the scores, and their first value_dim numbers as pairs of keys, word (v_2p[d],
// v_2p+1[d]), for the weighted sums; both built once per tile for every vector. Where the
// tile is 16 rows lying in one block as the copy would lay them (dim a multiple of 32: DeepSeek's
// 576, the families' 288), the rows are read in place: the same numbers, no copy (a decode step
// of 16 or 64 requests at context 512 over 30 layers' pools: 22.2-23.6 -> 18.5-19.8 and 77.9 ->
// 68.0 ms, AMD EPYC model 17, docs/results/issue17/genoa37/latent_in_place.txt).
struct Bf16Path {
  using Query = uint16_t;
  int64_t pad, chunks;  // row width; value chunks of 16
  std::vector<uint16_t> keys;
  const uint16_t* key_rows = nullptr;  // the tile's rows: the cache's own where they lie as keys would
  std::vector<uint32_t> pairs;  // [KEYS / 2][chunks][16]
  explicit Bf16Path(const Call& c)
      : pad(query_width(c)), chunks((c.value_dim + 15) / 16), keys(KEYS * pad, 0), pairs(KEYS / 2 * chunks * 16, 0) {}
  static int64_t query_width(const Call& c) { return (c.dim + 31) / 32 * 32; }
  static uint16_t query_value(uint16_t x) { return x; }

  void load_tile(const Call& c, const uint16_t* const* rows, int64_t count) {
    bool in_place = count == KEYS && pad == c.dim;  // a whole tile of one block, rows of no padding
    for (int64_t t = 1; t < count && in_place; ++t) in_place = rows[t] == rows[0] + t * c.dim;
    key_rows = in_place ? rows[0] : keys.data();
    for (int64_t t = 0; t < KEYS && !in_place; ++t) {  // rows past count zeroed: their pairs weigh 0 by finite numbers
      if (t < count) std::memcpy(&keys[t * pad], rows[t], c.dim * sizeof(uint16_t));
      else if (t == count) std::memset(&keys[t * pad], 0, (KEYS - count) * pad * sizeof(uint16_t));
    }
    // Word l of pair p's chunk k: (key 2p's number 16k + l, key 2p + 1's): the two rows'
    // 16 numbers side by side, then interleaved.
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    // Locals: read through `this`, the compiler reloaded them after every store below (a store may
    // alias them); hoisted, a decode step of 64 at context 512 over 30 layers ran 69-75 -> 64-66 ms.
    const uint16_t* const from = key_rows;
    uint32_t* const to = pairs.data();
    const int64_t width = pad, per_pair = chunks;
    for (int64_t p = 0; p < (count + 1) / 2; ++p)
      for (int64_t k = 0; k < per_pair; ++k) {
        const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + 2 * p * width + 16 * k));
        const __m256i second =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + (2 * p + 1) * width + 16 * k));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
        _mm512_storeu_si512(to + (p * per_pair + k) * 16, _mm512_permutexvar_epi16(interleave, both));
      }
  }

  template <int N>
  void add_values(float* acc, const uint32_t* weights, int64_t count, int64_t c0) const {
    __m512 a[N];
    unrolled<N>([&](auto i) { a[i] = _mm512_loadu_ps(acc + 16 * (c0 + i)); });
    for (int64_t p = 0; p < count; ++p) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[p]));
      const uint32_t* row = &pairs[(p * chunks + c0) * 16];
      unrolled<N>([&](auto i) { a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(row + 16 * i), w); });
    }
    unrolled<N>([&](auto i) { _mm512_storeu_ps(acc + 16 * (c0 + i), a[i]); });
  }

  // parts[j] += the pair products of key j's row and the query, 32 numbers at a time. PAD: the
  // rows' width where it is a constant (their 16 addresses then one register and offsets, not 16
  // registers the loop spills), 0 for pad.
  template <int64_t PAD>
  static void score_tile(const uint16_t* keys, const uint16_t* query, int64_t pad, V16* parts) {
    const int64_t width = PAD > 0 ? PAD : pad;
    for (int64_t d = 0; d < width; d += 32) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(query + d);
      unrolled<KEYS>([&](auto j) {
        parts[j].v = _mm512_dpbf16_ps(parts[j].v, (__m512bh)_mm512_loadu_si512(keys + j * width + d), qd);
      });
    }
  }

  void attend(const Call& c, const uint16_t* query, int64_t live, const State& st) const {
    V16 parts[KEYS];
    unrolled<KEYS>([&](auto j) { parts[j] = zero(); });
    if (pad == 576) score_tile<576>(key_rows, query, pad, parts);       // DeepSeek-V2/V3's 512 + 64
    else if (pad == 288) score_tile<288>(key_rows, query, pad, parts);  // the families bench's 256 + 32
    else score_tile<0>(key_rows, query, pad, parts);
    const V16 e = softmax_step(c, sums_of(parts), live, st);
    alignas(32) uint32_t weights[KEYS / 2];  // word p: (e_2p, e_2p+1) as bf16
    _mm256_store_si256(reinterpret_cast<__m256i*>(weights), (__m256i)_mm512_cvtneps_pbh(e.v));
    const int64_t count = (live + 1) / 2;
    int64_t c0 = 0;
    for (; c0 + PV_CHUNKS <= chunks; c0 += PV_CHUNKS) add_values<PV_CHUNKS>(st.acc, weights, count, c0);
    for (; c0 < chunks; ++c0) add_values<1>(st.acc, weights, count, c0);
  }
};
#endif

// One thread's buffers, sized for the largest item: the path's tile, the vectors' queries
// (in the path's type and width, zeros past dim: only [0, dim) is ever written) and states.
template <class Path>
struct Scratch {
  Path tile;
  int64_t query_width;
  std::vector<typename Path::Query> queries;
  std::vector<float> acc, sums, maxima;
  explicit Scratch(const Call& c)
      : tile(c), query_width(Path::query_width(c)), queries(MAX_VECTORS * query_width, 0),
        acc(MAX_VECTORS * c.width), sums(MAX_VECTORS * 16), maxima(MAX_VECTORS) {}
  State state(const Call& c, int64_t v) { return {&acc[v * c.width], &sums[v * 16], &maxima[v]}; }
};

template <class T, class Path>
void run_item(const Call& c, const Item& item, Scratch<Path>& s) {
  const T* q = static_cast<const T*>(c.q);
  T* out = static_cast<T*>(c.out);
  const T* cache = static_cast<const T*>(c.cache);
  const int32_t* table = c.block_tables + item.seq * c.max_blocks;
  const int64_t q_len = c.query_lens[item.seq], first_pos = c.seq_lens[item.seq] - q_len + item.row0;
  const int64_t vectors = item.rows * item.count;  // vector v: row v / count, head head0 + v % count
  const auto token = [&](int64_t v) { return c.query_start[item.seq] + item.row0 + v / item.count; };
  for (int64_t v = 0; v < vectors; ++v) {
    const T* src = q + (token(v) * c.heads + item.head0 + v % item.count) * c.dim;
    for (int64_t d = 0; d < c.dim; ++d) s.queries[v * s.query_width + d] = Path::query_value(src[d]);
  }
  std::fill(s.acc.begin(), s.acc.begin() + vectors * c.width, 0.0f);
  std::fill(s.sums.begin(), s.sums.begin() + vectors * 16, 0.0f);
  std::fill(s.maxima.begin(), s.maxima.begin() + vectors, -INFINITY);
  const int64_t last_key = first_pos + item.rows;  // exclusive: the keys the last row sees
  const auto key_row = [&](int64_t pos) {
    return cache + (static_cast<int64_t>(table[pos / c.block_size]) * c.block_size + pos % c.block_size) * c.dim;
  };
  for (int64_t base = 0; base < last_key; base += KEYS) {
    const int64_t count = std::min(KEYS, last_key - base);
    const T* rows[KEYS];
    for (int64_t t = 0; t < count; ++t) rows[t] = key_row(base + t);
    s.tile.load_tile(c, rows, count);
    // The next tile's keys fetched while this one's vectors compute: a step's latents come
    // from memory (every layer's pool), and blocks are scattered.
    for (int64_t t = base + KEYS; t < std::min(base + 2 * KEYS, last_key); ++t) {
      const char* next = reinterpret_cast<const char*>(key_row(t));
      for (int64_t off = 0; off < c.dim * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(next + off, 0, 2);
    }
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t live = std::min(KEYS, first_pos + v / item.count + 1 - base);
      if (live > 0) s.tile.attend(c, &s.queries[v * s.query_width], live, s.state(c, v));
    }
  }
  for (int64_t v = 0; v < vectors; ++v) {
    const float inv = 1.0f / sum_lanes(load(&s.sums[v * 16]));
    T* dst = out + (token(v) * c.heads + item.head0 + v % item.count) * c.value_dim;
    for (int64_t d = 0; d < c.value_dim; ++d) from_float(s.acc[v * c.width + d] * inv, dst + d);
  }
}

template <class T, class Path>
void run(const Call& c, int num_threads) {
  const std::vector<Item> items = make_items(c, num_threads);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, items.size())));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch<Path> scratch(c);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) run_item<T>(c, items[i], scratch);
  }
}

enum Products : int { PRODUCTS_FLOAT32 = 0, PRODUCTS_BF16 = 1 };

// The rotary part of DeepSeek's queries and keys, as transformers rotates it (and
// models/deepseek.py's rotate in PyTorch): in float32, each product and sum rounded in
// float32 (no contraction into fmas), the result rounded once to T.
// Pairs (x1, x2) = (x[2i], x[2i + 1]) where interleaved, else (x[i], x[half + i]); the
// output de-interleaved: [x1 c - x2 s for each pair | x2 c + x1 s for each pair].
template <class T>
__attribute__((optimize("fp-contract=off")))  // a product, then the sum: no fma (GCC contracts by default)
void rotate_rows(const T* x, T* out, const float* cos, const float* sin, int64_t tokens, int64_t heads, int64_t dim,
                 int interleaved) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * dim;  // the table's first half (its halves are equal)
    const float* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* v = x + (t * heads + h) * dim;
      T* o = out + (t * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(interleaved ? v[2 * i] : v[i]), x2 = to_float(interleaved ? v[2 * i + 1] : v[half + i]);
        const float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
        from_float(a - b, o + i);
        from_float(d + e, o + half + i);
      }
    }
  }
}

}  // namespace

extern "C" {

// Whether this build has the bf16-products path (vdpbf16ps): 1, else 0.
int kvloom_latent_attention_bf16() {
#ifdef KVLOOM_LATENT_BF16
  return 1;
#else
  return 0;
#endif
}

// out [tokens, heads, value_dim] = each query vector's attention over its sequence's
// latents (module comment). q [tokens, heads, dim], cache [blocks, block_size, dim],
// out: of `dtype` (0 float32, 1 bf16), contiguous; 0 < value_dim <= dim. `products`: 0
// float32 (every build), 1 bf16 (bf16 only, where kvloom_latent_attention_bf16()).
// Returns 0; -1 for a path this build or dtype does not run, -2 for a shape or dtype it
// does not take (nothing written either way).
int kvloom_latent_attention(const void* q, void* out, const void* cache, const int32_t* block_tables,
                            int64_t max_blocks, const int32_t* seq_lens, const int32_t* query_start,
                            const int32_t* query_lens, int64_t num_seqs, int64_t num_heads, int64_t dim,
                            int64_t value_dim, int64_t block_size, float scale, int dtype, int products,
                            int num_threads) {
  if (value_dim > dim || value_dim <= 0 || block_size <= 0 || (dtype != 0 && dtype != 1)) return -2;
  if (products != PRODUCTS_FLOAT32 && (products != PRODUCTS_BF16 || dtype != 1 || !kvloom_latent_attention_bf16()))
    return -1;
  const Call c{q, out, cache, block_tables, max_blocks, seq_lens, query_start, query_lens,
               num_seqs, num_heads, dim, value_dim, block_size, scale, (dim + 15) / 16 * 16};
  if (dtype == 0) {
    run<float, FloatPath>(c, num_threads);
  } else if (products == PRODUCTS_FLOAT32) {
    run<uint16_t, FloatPath>(c, num_threads);
  } else {
#ifdef KVLOOM_LATENT_BF16
    run<uint16_t, Bf16Path>(c, num_threads);
#endif
  }
  return 0;
}

// out [tokens, heads, dim] = x rotated as rotate_rows says; cos, sin [tokens, dim] float32;
// x and out of `dtype` (0 float32, 1 bf16), contiguous, dim even.
void kvloom_latent_rotary(const void* x, void* out, const float* cos, const float* sin, int64_t tokens,
                          int64_t heads, int64_t dim, int interleaved, int dtype) {
  if (dtype == 0)
    rotate_rows(static_cast<const float*>(x), static_cast<float*>(out), cos, sin, tokens, heads, dim, interleaved);
  else
    rotate_rows(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), cos, sin, tokens, heads, dim,
                interleaved);
}

}  // extern "C"
