// Paged decode attention on CPU: one query token per sequence attends over its cached context,
// reading K/V rows straight from the pool through the block table.
//
// Pool layout (flash-attn's paged layout): k_cache, v_cache [num_blocks, block_size, KVH, D].
// Work is split over (sequence, KV head) pairs; each pair handles its whole group of H/KVH query
// heads so every K/V row is fetched from memory once per call. When there are too few pairs to keep
// the threads evenly busy (batch 1), each pair's context is also cut into slices whose softmax
// states are merged at the end. Tokens are taken in tiles of 16:
// the tile's scores are computed, the running max / denominator are updated once per tile
// (online softmax in float32), then the tile's V rows are accumulated.
//
// Two implementations of the same loop:
//   * an AVX-512 one (fp32 / bf16, head_dim a multiple of 16) whose 16 dot products per tile are
//     reduced together with a transpose-and-add (no per-token horizontal sum);
//   * a portable one in plain loops (any head_dim), auto-vectorised by -O3 -march=native.
// The Python module exports both; `paged_decode_attention` picks the fastest available.

// Narrow headers on purpose: <torch/extension.h> doubles the one-off compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include "compiled_isa.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define SERVELM_HAVE_AVX512 1
#else
#define SERVELM_HAVE_AVX512 0
#endif
#if !SERVELM_HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SERVELM_HAVE_AVX2 1
#else
#define SERVELM_HAVE_AVX2 0
#endif

namespace {

constexpr int kTile = 16;  // tokens per online-softmax update; also the AVX-512 lane count
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Work (K/V rows x query heads per KV head x head_dim) below which a call stays on one thread. A decode
// step's rows are cold (the layer's K/V was last read a whole step of weights ago): 600 rows of the
// default model (3 queries per KV head, head_dim 64) took 61 us on one core, and two balanced threads
// ran 1.6x faster; Gemma 3's rows (4 queries, head_dim 256) weigh 5x as much each.
constexpr int64_t kMinWorkToParallelise = 512 * 3 * 64;
// A sequence's context is cut into slices (merged afterwards) only down to this many tokens.
constexpr int64_t kMinSliceTokens = 64;

// Everything a worker needs, resolved once per call.
struct Problem {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t group;         // query heads per KV head
  int64_t block_size;
  int64_t max_blocks;    // block-table row length
  int64_t row_stride;    // elements between consecutive token rows of one block (KVH * D)
  int64_t block_stride;  // elements per block (block_size * KVH * D)
  float scale;
  const int32_t* block_tables;
  const int32_t* seq_lens;
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// e^x for x <= 0 (softmax arguments), accurate to a few ulp; plain code so loops over it
// vectorise. Range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // keeps 2^n a normal number; e^-87 is ~1e-38, i.e. zero weight
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// Offsets (in elements) of the K/V rows of tokens t0 .. t0+n-1 of one sequence and KV head.
// Walks the block table incrementally: no division per token, and only entries below
// ceil(seq_len / block_size) are ever read.
inline void tile_offsets(const Problem& p, const int32_t* table, int64_t kvh, int64_t t0, int n,
                         int64_t* offs) {
  int64_t blk = t0 / p.block_size;
  int64_t pos = t0 - blk * p.block_size;
  const int64_t head_off = kvh * p.head_dim;
  for (int i = 0; i < n; ++i) {
    offs[i] = static_cast<int64_t>(table[blk]) * p.block_stride + pos * p.row_stride + head_off;
    if (++pos == p.block_size) {
      pos = 0;
      ++blk;
    }
  }
}

// Asks for the K and V rows of the next tile while the current one computes: the rows sit in
// blocks scattered over the pool. Measured 5-8% with cold caches; one tile ahead beat two or four.
template <typename T>
inline void prefetch_rows(const T* k, const T* v, const int64_t* offs, int n, int64_t head_dim) {
  const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(T));
  for (int i = 0; i < n; ++i) {
    const char* kr = reinterpret_cast<const char*>(k + offs[i]);
    const char* vr = reinterpret_cast<const char*>(v + offs[i]);
    for (int64_t byte = 0; byte < bytes; byte += 64) {
      __builtin_prefetch(kr + byte, 0, 3);
      __builtin_prefetch(vr + byte, 0, 3);
    }
  }
}

// Tokens [begin, n) of sequence b's KV head kvh in tiles of kTile: tile(offs, nt) gets each tile's row
// offsets, with the next tile's rows already asked for.
template <typename T, typename Fn>
inline void for_each_tile(const Problem& p, const T* k, const T* v, int64_t b, int64_t kvh, int64_t begin,
                          int64_t n, int64_t D, Fn&& tile) {
  const int32_t* table = p.block_tables + b * p.max_blocks;
  int64_t offs_a[kTile], offs_b[kTile];
  int64_t* offs = offs_a;
  int64_t* next_offs = offs_b;
  if (begin < n) tile_offsets(p, table, kvh, begin, static_cast<int>(std::min<int64_t>(kTile, n - begin)), offs);
  for (int64_t t0 = begin; t0 < n; t0 += kTile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    if (t0 + kTile < n) {
      const int nn = static_cast<int>(std::min<int64_t>(kTile, n - t0 - kTile));
      tile_offsets(p, table, kvh, t0 + kTile, nn, next_offs);
      prefetch_rows(k, v, next_offs, nn, D);
    }
    tile(offs, nt);
    std::swap(offs, next_offs);
  }
}

// Per-thread scratch: scaled queries, accumulators, scores and softmax state of one group.
struct Scratch {
  std::vector<float> buf;
  float* qs;   // [G, D], q * scale
  float* acc;  // [G, D]
  float* s;    // [G, kTile]
  float* m;    // [G] running max
  float* l;    // [G] running denominator
  float* row;  // [D] a float16 cache row widened (the portable loops cannot vectorise c10::Half)
  explicit Scratch(const Problem& p) : buf(2 * p.group * p.head_dim + p.group * (kTile + 2) + p.head_dim) {
    qs = buf.data();
    acc = qs + p.group * p.head_dim;
    s = acc + p.group * p.head_dim;
    m = s + p.group * kTile;
    l = m + p.group;
    row = l + p.group;
  }
};

// The online softmax over one tile's scores of query g: its scores become e^(s - m) in place, the
// running max and denominator move on; returns the factor the accumulator must be scaled by first.
inline float softmax_tile(Scratch& w, int64_t g, int nt) {
  float* sg = w.s + g * kTile;
  float tile_max = kNegInf;
  for (int i = 0; i < nt; ++i) tile_max = std::max(tile_max, sg[i]);
  const float m_new = std::max(w.m[g], tile_max);
  const float alpha = std::exp(w.m[g] - m_new);  // 0 on the first tile (m = -inf)
  w.m[g] = m_new;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < nt; ++i) {
    sg[i] = exp_nonpositive(sg[i] - m_new);
    sum += sg[i];
  }
  w.l[g] = w.l[g] * alpha + sum;
  return alpha;
}

template <typename T>
inline void load_group(const Problem& p, const T* q, int64_t b, int64_t kvh, int64_t D, Scratch& w) {
  const int64_t G = p.group;
  const T* qb = q + (b * p.num_heads + kvh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) w.qs[i] = to_float(qb[i]) * p.scale;
  std::fill(w.acc, w.acc + G * D, 0.0f);
  std::fill(w.m, w.m + G, kNegInf);
  std::fill(w.l, w.l + G, 0.0f);
}

template <typename T>
inline void store_group(const Problem& p, T* out, int64_t b, int64_t kvh, int64_t D, const Scratch& w) {
  const int64_t G = p.group;
  T* ob = out + (b * p.num_heads + kvh * G) * D;
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / w.l[g];
    for (int64_t d = 0; d < D; ++d) ob[g * D + d] = from_float<T>(w.acc[g * D + d] * inv);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable implementation. kD > 0 fixes head_dim at compile time (64, 128) so the inner loops
// have known trip counts; kD == 0 reads it from the problem.
// A cache row as float32: float and bfloat16 rows are read in place (their loops vectorise); a
// float16 row is widened into ``buf`` first, 8 at a time with F16C where the CPU has it (the element
// conversion in the loops measured 5.7x slower than a float32 cache).
template <typename T>
inline const T* as_floats(const T* x, int64_t, float*) { return x; }
inline const float* as_floats(const c10::Half* x, int64_t D, float* buf) {
  int64_t d = 0;
#ifdef __F16C__
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d))));
#endif
  for (; d < D; ++d) buf[d] = static_cast<float>(x[d]);
  return buf;
}

// TQ: the queries' type; T: the cache's (a 16-bit cache under float32 queries halves the KV memory).
template <typename TQ, typename T, int kD>
void attend_portable(const Problem& p, const TQ* q, const T* k, const T* v, int64_t b, int64_t kvh,
                     int64_t begin, int64_t n, Scratch& w) {
  const int64_t D = kD > 0 ? kD : p.head_dim;
  const int64_t G = p.group;
  load_group(p, q, b, kvh, D, w);
  for_each_tile(p, k, v, b, kvh, begin, n, D, [&](const int64_t* offs, int nt) {
    // Each K and V row is read (and a float16 row widened) once for the whole group of G queries.
    for (int i = 0; i < nt; ++i) {
      const auto* kr = as_floats(k + offs[i], D, w.row);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = w.qs + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(kr[d]);
        w.s[g * kTile + i] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float alpha = softmax_tile(w, g, nt);
      float* ag = w.acc + g * D;
      if (alpha != 1.0f) {
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
      }
    }
    for (int i = 0; i < nt; ++i) {
      const auto* vr = as_floats(v + offs[i], D, w.row);
      for (int64_t g = 0; g < G; ++g) {
        float* ag = w.acc + g * D;
        const float pi = w.s[g * kTile + i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += pi * to_float(vr[d]);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
#if SERVELM_HAVE_AVX512
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  // bf16 is the top half of an fp32: widen to 32 bits and shift into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// Lane i of the result is the sum of the 16 lanes of r[i].
inline __m512 transpose_sum16(const __m512* r) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i) {
    // per 128-bit block: [x0+x2, y0+y2, x1+x3, y1+y3] of x = r[2i], y = r[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                         _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  }
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    // per 128-bit block j: lane c = block-j sum of r[4i + c]
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // block i = full sums of r[4i .. 4i+3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// e^x for x <= 0, same reduction as exp_nonpositive; scalef applies 2^n.
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// kC = head_dim / 16 at compile time (4, 8), or 0 for any other multiple of 16.
template <typename TQ, typename T, int kC>
void attend_avx512(const Problem& p, const TQ* q, const T* k, const T* v, int64_t b, int64_t kvh,
                   int64_t begin, int64_t n, Scratch& w) {
  const int64_t D = p.head_dim;
  const int C = kC > 0 ? kC : static_cast<int>(D / 16);
  const int64_t G = p.group;
  const int32_t* table = p.block_tables + b * p.max_blocks;
  load_group(p, q, b, kvh, D, w);
  int64_t offs_a[kTile], offs_b[kTile];
  int64_t* offs = offs_a;
  int64_t* next_offs = offs_b;
  __m512 parts[kTile];
  alignas(64) float probs[kTile];
  if (begin < n) tile_offsets(p, table, kvh, begin, static_cast<int>(std::min<int64_t>(kTile, n - begin)), offs);
  for (int64_t t0 = begin; t0 < n; t0 += kTile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    const __mmask16 valid = static_cast<__mmask16>((1u << nt) - 1u);
    if (t0 + kTile < n) {
      const int nn = static_cast<int>(std::min<int64_t>(kTile, n - t0 - kTile));
      tile_offsets(p, table, kvh, t0 + kTile, nn, next_offs);
      prefetch_rows(k, v, next_offs, nn, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = w.qs + g * D;
      // Scores of the tile: per-token partial vectors, then one transpose-and-add.
      for (int i = 0; i < kTile; ++i) {
        if (i < nt) {
          const T* kr = k + offs[i];
          __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(kr));
          __m512 s1 = _mm512_setzero_ps();
          int c = 1;
          for (; c + 1 < C; c += 2) {
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), load16(kr + 16 * c), s1);
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * (c + 1)), load16(kr + 16 * (c + 1)), s0);
          }
          if (c < C) s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), load16(kr + 16 * c), s1);
          parts[i] = _mm512_add_ps(s0, s1);
        } else {
          parts[i] = _mm512_setzero_ps();
        }
      }
      const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid, transpose_sum16(parts));
      const float m_new = std::max(w.m[g], _mm512_reduce_max_ps(scores));
      const float alpha = std::exp(w.m[g] - m_new);  // 0 on the first tile (m = -inf)
      w.m[g] = m_new;
      const __m512 pr = _mm512_maskz_mov_ps(valid, exp16_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
      w.l[g] = w.l[g] * alpha + _mm512_reduce_add_ps(pr);
      _mm512_store_ps(probs, pr);
      float* ag = w.acc + g * D;
      const __m512 va = _mm512_set1_ps(alpha);
      if constexpr (kC > 0) {
        // Accumulators stay in registers across the tile.
        __m512 acc[kC];
        for (int c = 0; c < kC; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), va);
        for (int i = 0; i < nt; ++i) {
          const T* vr = v + offs[i];
          const __m512 pi = _mm512_set1_ps(probs[i]);
          for (int c = 0; c < kC; ++c) acc[c] = _mm512_fmadd_ps(pi, load16(vr + 16 * c), acc[c]);
        }
        for (int c = 0; c < kC; ++c) _mm512_storeu_ps(ag + 16 * c, acc[c]);
      } else {
        for (int c = 0; c < C; ++c) {
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), va);
          for (int i = 0; i < nt; ++i) a = _mm512_fmadd_ps(_mm512_set1_ps(probs[i]), load16(v + offs[i] + 16 * c), a);
          _mm512_storeu_ps(ag + 16 * c, a);
        }
      }
    }
    std::swap(offs, next_offs);
  }
}
#endif  // SERVELM_HAVE_AVX512

// ---------------------------------------------------------------------------------------------
#if SERVELM_HAVE_AVX2
// AVX2 + FMA (float32 queries over a float32 or float16 cache, head_dim a multiple of 8): the same
// tiles and online softmax as the portable loop, with the work arranged for the FMA units. The portable
// loop's dot products were one chain of dependent FMAs each, and each K/V row was widened once per
// query head: Gemma 3's 4 queries per KV head at head_dim 256 ran ~4x slower than this.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

template <typename T>
void attend_avx2(const Problem& p, const float* q, const T* k, const T* v, int64_t b, int64_t kvh,
                 int64_t begin, int64_t n, Scratch& w) {
  const int64_t D = p.head_dim, G = p.group;
  load_group(p, q, b, kvh, D, w);
  for_each_tile(p, k, v, b, kvh, begin, n, D, [&](const int64_t* offs, int nt) {
    // Scores: each K chunk is loaded once for up to 4 queries, two independent sums each.
    for (int i = 0; i < nt; ++i) {
      const T* kr = k + offs[i];
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int gn = static_cast<int>(std::min<int64_t>(4, G - g0));
        __m256 acc[4][2];
        for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
          const __m256 k0 = load8(kr + d), k1 = load8(kr + d + 8);
          for (int j = 0; j < gn; ++j) {
            const float* qj = w.qs + (g0 + j) * D + d;
            acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qj), k0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8), k1, acc[j][1]);
          }
        }
        if (d < D) {  // head_dim 8 mod 16
          const __m256 k0 = load8(kr + d);
          for (int j = 0; j < gn; ++j) acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(w.qs + (g0 + j) * D + d), k0, acc[j][0]);
        }
        for (int j = 0; j < gn; ++j) w.s[(g0 + j) * kTile + i] = hsum8(_mm256_add_ps(acc[j][0], acc[j][1]));
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float alpha = softmax_tile(w, g, nt);
      const float* sg = w.s + g * kTile;
      // Values: the tile's rows summed into 8 chunks of the accumulator at a time (8 independent chains).
      float* ag = w.acc + g * D;
      const __m256 va = _mm256_set1_ps(alpha);
      int64_t d = 0;
      for (; d + 64 <= D; d += 64) {
        __m256 a[8];
        for (int c = 0; c < 8; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(ag + d + 8 * c), va);
        for (int i = 0; i < nt; ++i) {
          const __m256 pi = _mm256_set1_ps(sg[i]);
          const T* vr = v + offs[i] + d;
          for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pi, load8(vr + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(ag + d + 8 * c, a[c]);
      }
      for (; d < D; d += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ag + d), va);
        for (int i = 0; i < nt; ++i) a = _mm256_fmadd_ps(_mm256_set1_ps(sg[i]), load8(v + offs[i] + d), a);
        _mm256_storeu_ps(ag + d, a);
      }
    }
  });
}
#endif  // SERVELM_HAVE_AVX2

// Attention of sequence b's query group for KV head kvh over its tokens [begin, end): the softmax
// state (running max, denominator, unnormalised output) is left in the scratch.
using AttendFn = void (*)(const Problem&, const void*, const void*, const void*, int64_t, int64_t,
                          int64_t, int64_t, Scratch&);

template <typename TQ, typename T, int kD>
void portable_entry(const Problem& p, const void* q, const void* k, const void* v, int64_t b,
                    int64_t kvh, int64_t begin, int64_t end, Scratch& w) {
  attend_portable<TQ, T, kD>(p, static_cast<const TQ*>(q), static_cast<const T*>(k),
                         static_cast<const T*>(v), b, kvh, begin, end, w);
}

#if SERVELM_HAVE_AVX2
template <typename T>
void avx2_entry(const Problem& p, const void* q, const void* k, const void* v, int64_t b, int64_t kvh,
                int64_t begin, int64_t end, Scratch& w) {
  attend_avx2<T>(p, static_cast<const float*>(q), static_cast<const T*>(k), static_cast<const T*>(v), b, kvh,
                 begin, end, w);
}
#endif

#if SERVELM_HAVE_AVX512
template <typename TQ, typename T, int kC>
void avx512_entry(const Problem& p, const void* q, const void* k, const void* v, int64_t b,
                  int64_t kvh, int64_t begin, int64_t end, Scratch& w) {
  attend_avx512<TQ, T, kC>(p, static_cast<const TQ*>(q), static_cast<const T*>(k),
                       static_cast<const T*>(v), b, kvh, begin, end, w);
}
#endif

// Writes a pair's normalised output (acc / l) from the scratch.
using StoreFn = void (*)(const Problem&, void*, int64_t, int64_t, const Scratch&);

template <typename T>
void store_entry(const Problem& p, void* out, int64_t b, int64_t kvh, const Scratch& w) {
  store_group(p, static_cast<T*>(out), b, kvh, p.head_dim, w);
}

template <typename TQ, typename T>
AttendFn choose(int64_t head_dim, bool allow_simd) {
#if SERVELM_HAVE_AVX512
  if (allow_simd && head_dim % 16 == 0) {
    if (head_dim == 64) return avx512_entry<TQ, T, 4>;
    if (head_dim == 128) return avx512_entry<TQ, T, 8>;
    return avx512_entry<TQ, T, 0>;
  }
#elif SERVELM_HAVE_AVX2
  if constexpr (std::is_same_v<TQ, float> && (std::is_same_v<T, float> || std::is_same_v<T, c10::Half>)) {
    if (allow_simd && head_dim % 8 == 0) return avx2_entry<T>;
  }
#else
  (void)allow_simd;
#endif
  if (head_dim == 64) return portable_entry<TQ, T, 64>;
  if (head_dim == 128) return portable_entry<TQ, T, 128>;
  return portable_entry<TQ, T, 0>;
}

// The queries' and the cache's types: float32 queries over a float32, bfloat16 or float16 cache, or
// bfloat16 over bfloat16.
AttendFn choose_types(at::ScalarType q, at::ScalarType kv, int64_t head_dim, bool allow_simd) {
  if (q == at::kBFloat16) return choose<c10::BFloat16, c10::BFloat16>(head_dim, allow_simd);
  if (kv == at::kBFloat16) return choose<float, c10::BFloat16>(head_dim, allow_simd);
  if (kv == at::kHalf) return choose<float, c10::Half>(head_dim, allow_simd);
  return choose<float, float>(head_dim, allow_simd);
}

// window > 0: sliding-window attention, each query attends to its sequence's last ``window`` tokens
// only (itself included), as transformers' sliding-window mask does; 0: the whole context.
at::Tensor run(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in, double scale,
               const c10::optional<at::Tensor>& out, bool allow_simd, int64_t window = 0) {
  // q may be a strided view (e.g. split from a fused qkv); the pool must already be contiguous,
  // since copying it here would be silent and huge.
  const at::Tensor q = q_in.contiguous();
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors expected");
  TORCH_CHECK(q.dim() == 3, "q must be [batch, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", v_cache.sizes(),
              " differs from k_cache shape ", k_cache.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q must be float32 or bfloat16, got ", dtype);
  const auto kv_dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv_dtype, "k_cache and v_cache must share a dtype");
  TORCH_CHECK(kv_dtype == dtype || (dtype == at::kFloat && (kv_dtype == at::kBFloat16 || kv_dtype == at::kHalf)),
              "the cache must be q's dtype, or bfloat16/float16 under float32 q; got q ", dtype, ", cache ", kv_dtype);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q (", D, ") and of the cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads (", H, ") must be a multiple of num_kv_heads (", KVH, ")");
  TORCH_CHECK(block_size > 0 && D > 0, "empty block_size or head_dim");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window), got ", window);
  TORCH_CHECK(block_tables_in.scalar_type() == at::kInt && block_tables_in.dim() == 2 &&
                  block_tables_in.size(0) == B,
              "block_tables must be int32 [batch, max_blocks], got ", block_tables_in.scalar_type(), " ",
              block_tables_in.sizes());
  TORCH_CHECK(seq_lens_in.scalar_type() == at::kInt && seq_lens_in.dim() == 1 && seq_lens_in.size(0) == B,
              "seq_lens must be int32 [batch], got ", seq_lens_in.scalar_type(), " ", seq_lens_in.sizes());
  const at::Tensor block_tables = block_tables_in.contiguous();
  const at::Tensor seq_lens = seq_lens_in.contiguous();

  at::Tensor dst;
  if (out.has_value()) {
    TORCH_CHECK(out->sizes() == q.sizes() && out->scalar_type() == dtype && out->device().is_cpu(),
                "out must be a CPU tensor shaped and typed like q");
    dst = out->is_contiguous() ? *out : at::empty_like(q);
  } else {
    dst = at::empty_like(q);
  }
  if (B == 0) return out.has_value() ? *out : dst;

  Problem p;
  p.num_heads = H;
  p.num_kv_heads = KVH;
  p.head_dim = D;
  p.group = H / KVH;
  p.block_size = block_size;
  p.max_blocks = block_tables.size(1);
  p.row_stride = KVH * D;
  p.block_stride = block_size * KVH * D;
  p.scale = static_cast<float>(scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();

  // Validate every table entry the workers will dereference, so a bad table is an error, not a
  // wild read. Costs one compare per used block.
  int64_t total_tokens = 0;  // what the queries attend to (their windows)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = p.seq_lens[b];
    total_tokens += window > 0 ? std::min(len, window) : len;
    TORCH_CHECK(len >= 1, "seq_lens[", b, "] = ", len, ": each sequence needs at least one token");
    const int64_t used = (len + block_size - 1) / block_size;
    TORCH_CHECK(used <= p.max_blocks, "seq_lens[", b, "] = ", len, " needs ", used,
                " blocks but block_tables has ", p.max_blocks, " columns");
    const int32_t* row = p.block_tables + b * p.max_blocks;
    for (int64_t j = 0; j < used; ++j) {
      TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, "block_tables[", b, ", ", j, "] = ", row[j],
                  " is outside the pool of ", num_blocks, " blocks");
    }
  }

  const AttendFn fn = choose_types(dtype, kv_dtype, D, allow_simd);
  const void* qp = q.data_ptr();
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  void* op = dst.data_ptr();

  // Dynamic scheduling over (sequence, KV head) pairs: context lengths differ, so a static split
  // would leave threads idle. at::parallel_for runs on torch's own thread pool, sized by
  // torch.get_num_threads(). Small calls stay on the calling thread: waking the pool costs
  // microseconds on an idle machine and milliseconds on a busy one.
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = B * KVH;
  const bool parallel = threads > 1 && total_tokens * KVH * p.group * D >= kMinWorkToParallelise;
  // Too few pairs to keep the threads evenly busy (batch 1: 3 KV heads on 2 threads): each pair's
  // context is cut into slices ("split-K"), whose softmax states are merged afterwards.
  int64_t splits = 1;
  if (parallel && pairs < 2 * threads) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = p.seq_lens[b];
      longest = std::max<int64_t>(longest, window > 0 ? std::min(len, window) : len);
    }
    splits = std::max<int64_t>(1, std::min<int64_t>((2 * threads + pairs - 1) / pairs, longest / kMinSliceTokens));
  }
  const int64_t items = pairs * splits;
  const int64_t workers = parallel ? std::min<int64_t>(items, threads) : 1;
  const StoreFn store = dtype == at::kFloat ? store_entry<float> : store_entry<c10::BFloat16>;
  const int64_t G = p.group, state = G * (D + 2);  // a slice's m [G], l [G], acc [G, D]
  std::vector<float> slices(splits > 1 ? items * state : 0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w(p);
    for (;;) {
      const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
      if (item >= items) break;
      const int64_t pair = item / splits, b = pair / KVH, kvh = pair % KVH;
      const int64_t n = p.seq_lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      if (splits == 1) {
        fn(p, qp, kp, vp, b, kvh, lo, n, w);
        store(p, op, b, kvh, w);
        continue;
      }
      // Slices of whole tiles; the last ones may be empty (m = -inf, l = 0: no weight in the merge).
      const int64_t chunk = ((n - lo + splits - 1) / splits + kTile - 1) / kTile * kTile;
      const int64_t begin = std::min(n, lo + (item % splits) * chunk);
      fn(p, qp, kp, vp, b, kvh, begin, std::min(n, begin + chunk), w);
      float* st = slices.data() + item * state;
      std::copy(w.m, w.m + G, st);
      std::copy(w.l, w.l + G, st + G);
      std::copy(w.acc, w.acc + G * D, st + 2 * G);
    }
  });
  if (splits > 1) {
    Scratch w(p);
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const float* first = slices.data() + pair * splits * state;
      for (int64_t g = 0; g < G; ++g) {
        float m = kNegInf;
        for (int64_t s = 0; s < splits; ++s) m = std::max(m, first[s * state + g]);
        float l = 0.0f;
        float* acc = w.acc + g * D;
        std::fill(acc, acc + D, 0.0f);
        for (int64_t s = 0; s < splits; ++s) {
          const float* st = first + s * state;
          const float weight = std::exp(st[g] - m);  // 0 for an empty slice (m_s = -inf)
          l += st[G + g] * weight;
          const float* a = st + 2 * G + g * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * weight;
        }
        w.l[g] = l;
      }
      store(p, op, pair / KVH, pair % KVH, w);
    }
  }

  if (out.has_value() && !dst.is_same(*out)) out->copy_(dst);
  return out.has_value() ? *out : dst;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  const c10::optional<at::Tensor>& out, int64_t window) {
  return run(q, k_cache, v_cache, block_tables, seq_lens, scale, out, /*allow_simd=*/true, window);
}

at::Tensor paged_decode_attention_portable(const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                                           const at::Tensor& seq_lens, double scale,
                                           const c10::optional<at::Tensor>& out, int64_t window) {
  return run(q, k_cache, v_cache, block_tables, seq_lens, scale, out, /*allow_simd=*/false, window);
}

// One rotation of a head: [x1 c - x2 s, x2 c + x1 s] over the two halves, written to dst. Products and
// sums are rounded one by one (no fused multiply-add), which is exactly what torch's element-wise
// ops compute for the unfused path, so both give the same bits.
__attribute__((optimize("fp-contract=off"))) void rotate_head(const float* x, const float* c, const float* s,
                                                               float* dst, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    const float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
    dst[i] = a - b;
    dst[half + i] = d + e;
  }
}

// RMS-normalise one head, x * rsqrt(mean(x^2) + eps) * w, in float32 as F.rms_norm computes it (the
// q/k norms of Qwen3 and Gemma 3; Gemma's 1 + w is already folded into w).
void rms_head(const float* x, const float* w, float eps, float* dst, int64_t D) {
  float ss = 0.0f;
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) dst[d] = x[d] * r * w[d];
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);  // rounded to the cache's type
  }
}

// Rotate (and first normalise, with q/k norms) q and k of every token, and write k and v at their slots
// in a cache of type T (float32, or a 16-bit pool that stores them rounded).
template <typename T>
void rope_store(const float* src, const float* cp, const float* sp, const int64_t* slot, int64_t B, int64_t H,
                int64_t KVH, int64_t D, const float* qn, const float* kn, float eps, float* qp, T* kc, T* vc) {
  const int64_t half = D / 2, row = (H + 2 * KVH) * D;
  std::vector<float> tmp(D);
  for (int64_t b = 0; b < B; ++b) {
    const float* x = src + b * row;
    const float* c = cp + b * half;
    const float* s = sp + b * half;
    for (int64_t h = 0; h < H; ++h) {
      float* qd = qp + (b * H + h) * D;
      const float* in = x + h * D;
      if (qn != nullptr) {
        rms_head(in, qn, eps, qd, D);
        in = qd;  // rotate_head reads each pair before writing it: in place is safe
      }
      rotate_head(in, c, s, qd, half);
    }
    if (slot[b] < 0) continue;
    T* kd = kc + slot[b] * KVH * D;
    T* vd = vc + slot[b] * KVH * D;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* in = x + (H + h) * D;
      if (kn != nullptr) {
        rms_head(in, kn, eps, tmp.data(), D);
        in = tmp.data();
      }
      if constexpr (std::is_same_v<T, float>) {
        rotate_head(in, c, s, kd + h * D, half);
      } else {
        rotate_head(in, c, s, tmp.data(), half);
        store_row(tmp.data(), kd + h * D, D);
      }
    }
    store_row(x + (H + KVH) * D, vd, KVH * D);
  }
}

const float* norm_weight(const c10::optional<at::Tensor>& w, int64_t D, const char* what) {
  if (!w.has_value() || !w->defined()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == D,
              "rope_write_decode: ", what, " must be contiguous float32 [head_dim]");
  return w->data_ptr<float>();
}

// A decode-only step of one layer in one call: (q/k norms,) rotate q and k of every token (fused qkv
// rows [q heads | k heads | v heads]), write k and v at their slots (slot < 0: not written), then
// decode attention over the pool. Replaces ~15 small torch ops per layer (~25 with q/k norms and a
// 16-bit cache). float32 activations; the cache float32, bfloat16 or float16.
at::Tensor rope_write_decode(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping_in,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                             double scale, int64_t window, const c10::optional<at::Tensor>& q_norm,
                             const c10::optional<at::Tensor>& k_norm, double norm_eps) {
  const at::Tensor qkv = qkv_in.contiguous();
  const auto kv_dtype = k_cache.scalar_type();
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && v_cache.scalar_type() == kv_dtype &&
                  (kv_dtype == at::kFloat || kv_dtype == at::kHalf || kv_dtype == at::kBFloat16),
              "rope_write_decode: float32 qkv, and a float32, float16 or bfloat16 cache");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "rope_write_decode: contiguous [num_blocks, block_size, num_kv_heads, head_dim] caches expected");
  const int64_t B = qkv.size(0), KVH = k_cache.size(2), D = k_cache.size(3), half = D / 2;
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(D % 2 == 0 && qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * KVH) * D,
              "rope_write_decode: qkv must be [batch, (num_heads + 2 * num_kv_heads) * head_dim], got ", qkv.sizes());
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == B * half &&
                  sin.numel() == B * half,
              "rope_write_decode: cos and sin must hold [batch, head_dim / 2] float32");
  const at::Tensor slot_mapping = slot_mapping_in.contiguous();
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == B,
              "rope_write_decode: slot_mapping must be int64 [batch]");
  const float* qn = norm_weight(q_norm, D, "q_norm");
  const float* kn = norm_weight(k_norm, D, "k_norm");
  at::Tensor q = at::empty({B, num_heads, D}, qkv.options());
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slot[b] < slots, "slot_mapping[", b, "] = ", slot[b], " is outside the pool of ", slots, " slots");
  }
  // Tiny work per token (a few hundred floats): one thread; the attention below is parallel.
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float eps = static_cast<float>(norm_eps);
  float* qp = q.data_ptr<float>();
  if (kv_dtype == at::kFloat) {
    rope_store(src, cp, sp, slot, B, num_heads, KVH, D, qn, kn, eps, qp, k_cache.data_ptr<float>(),
               v_cache.data_ptr<float>());
  } else if (kv_dtype == at::kHalf) {
    rope_store(src, cp, sp, slot, B, num_heads, KVH, D, qn, kn, eps, qp, k_cache.data_ptr<c10::Half>(),
               v_cache.data_ptr<c10::Half>());
  } else {
    rope_store(src, cp, sp, slot, B, num_heads, KVH, D, qn, kn, eps, qp, k_cache.data_ptr<c10::BFloat16>(),
               v_cache.data_ptr<c10::BFloat16>());
  }
  return run(q, k_cache, v_cache, block_tables, seq_lens, scale, c10::nullopt, /*allow_simd=*/true, window);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "servelm paged decode attention for CPU";
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV pool (fastest implementation compiled in)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("out") = py::none(), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention_portable", &paged_decode_attention_portable,
        "The same, always through the plain-loop implementation", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("out") = py::none(), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_decode", &rope_write_decode,
        "Decode-only layer step: RoPE on q/k from fused qkv rows, k/v written at their slots, paged attention",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("num_heads"),
        py::arg("scale"), py::arg("window") = 0, py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
        py::arg("norm_eps") = 0.0, py::call_guard<py::gil_scoped_release>());
  // For a caller in another extension (gguf_linear.cpp's gguf_decode_stack): the function's address
  // and a number for its signature, which that caller checks against its own.
  m.attr("rope_write_decode_address") = py::int_(reinterpret_cast<std::uintptr_t>(&rope_write_decode));
  m.attr("rope_write_decode_abi") = 1;
  m.def("compiled_isa", &compiled_isa);
  m.attr("has_avx512") = py::bool_(SERVELM_HAVE_AVX512 != 0);
  m.attr("has_avx2") = py::bool_(SERVELM_HAVE_AVX2 != 0);
}
