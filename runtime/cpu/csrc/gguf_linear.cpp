// Projections and embedding lookups straight from GGUF's quantized blocks (float32 activations):
//   * gguf_linear: out[M, N] = x[M, K] @ W^T (+ bias), W given as its raw block rows [N, row_bytes];
//   * gguf_linear_parts: the same for a fused projection whose parts are separate weights;
//   * gguf_get_rows: the rows ids of W as float32 [T, K] (an embedding lookup), only those decoded.
// Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32.
//
// A decode step's projection is a pass over the weight, so the bytes read set its speed: reading the
// quantized blocks instead of a float32 copy reads 4-8x fewer. For up to kGroup activation rows each
// block is decoded once (with AVX2 in registers, 8 quants at a time; else into L1) as integer-valued
// floats q with a scale s (and offset b) per sub-block, and every row accumulates s * sum(q x) +
// b * sum(x): the same sum as over the dequantized weights, in another order. x stays float32 (no
// int8 activations as llama.cpp uses), so results match a float32 reference within summation noise.
// With more rows, each weight row is decoded once to floats (the reference's roundings: get_rows is
// bit-equal) in a per-thread buffer and every group of rows reads it there. Output rows are split
// over threads (at::parallel_for) in at most get_num_threads() spans of equal weight bytes;
// gguf_linear_parts does so over the rows of several weights at once (a fused projection's parts).
//
// AVX2 + FMA + F16C where the compiler targets them (so AVX-512 machines run it too), plain C++ else;
// with AVX-512 VNNI, the int8-activation steps of many rows take the tiles of gguf_vnni.h.

// Narrow headers on purpose: <torch/extension.h> doubles the one-off compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include "compiled_isa.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <tuple>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SERVELM_GGUF_AVX2 1
#else
#define SERVELM_GGUF_AVX2 0
#endif

// Decoded weights must round as the reference does (a multiply, then an add): no fused contraction.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

constexpr int kGroup = 8;          // activation rows that share one decode of a block
constexpr int kPassRows = 4 * kGroup;  // most activation rows the few-row kernels take in one pass over W
constexpr int kFloatChunk = 256;   // elements decoded at a time for the float formats

// gguf.GGMLQuantizationType values.
enum QType : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
                   Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

inline uint16_t u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
#if SERVELM_GGUF_AVX2
inline float f16(const uint8_t* p) { return _cvtsh_ss(u16(p)); }  // one instruction, exact
#else
inline float f16(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(u16(p)); }
#endif
inline float bf16(const uint8_t* p) { uint32_t v = uint32_t(u16(p)) << 16; float f; std::memcpy(&f, &v, 4); return f; }

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes s.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All 8 (scale, minimum) pairs of a Q4_K / Q5_K block at once: the same fields as scale_min_k4,
// taken 4 at a time from the 32-bit words of the 12 packed bytes, as the words of scales 0-3, 4-7 and
// minimums 0-3, 4-7 (one byte each).
inline void scales_mins_k4(const uint8_t* s, uint32_t words[4]) {
  const uint32_t w0 = u32(s), w1 = u32(s + 4), w2 = u32(s + 8);
  const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
  words[0] = w0 & low6;
  words[1] = (w2 & low4) | (((w0 >> 6) & top2) << 4);
  words[2] = w1 & low6;
  words[3] = ((w2 >> 4) & low4) | (((w1 >> 6) & top2) << 4);
}

#if SERVELM_GGUF_AVX2
inline __m128i hi8(__m128i v) { return _mm_srli_si128(v, 8); }
inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A few-row step streams its weight from memory, but its many instructions per cache line keep the
// core's own look-ahead short: unhinted, the 5-bit formats read under a third of the host's bandwidth
// (docs/gguf.md). So the kernels ask now for the cache lines kPrefetchAhead bytes past what they read
// (rows lie end to end: past a row's end is the next row's start).
constexpr int64_t kPrefetchAhead = 2048;
inline void prefetch_range(const uint8_t* p, int64_t n) {
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + uintptr_t(n);
  for (uintptr_t c = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); c < last; c += 64)
    _mm_prefetch(reinterpret_cast<const char*>(c), _MM_HINT_T0);
}
inline void prefetch_ahead(const uint8_t* p, int64_t n) { prefetch_range(p + kPrefetchAhead, n); }

// 32 bytes (unsigned or signed) widened to 32 floats at dst.
template <bool kSigned>
inline void bytes_to_floats(__m256i q, float* dst) {
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {a, hi8(a), b, hi8(b)};
  for (int p = 0; p < 4; ++p) {
    const __m256i v = kSigned ? _mm256_cvtepi8_epi32(parts[p]) : _mm256_cvtepu8_epi32(parts[p]);
    _mm256_storeu_ps(dst + 8 * p, _mm256_cvtepi32_ps(v));
  }
}

// 16 packed bytes -> 32 nibbles as bytes, low nibbles (elements 0..15) first as ggml packs them.
// (The 16 bytes in both halves, the upper half's 64-bit lanes shifted by 4, then masked: 3 instructions.)
inline __m256i nibbles32(const uint8_t* qs) {
  const __m256i q = _mm256_broadcastsi128_si256(load128(qs));
  return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

// Bit i of the 32-bit qh as byte i: 0x10 where set, else 0 (the 5th bit of Q5_0 / Q5_1 element i).
inline __m256i fifth_bits(uint32_t qh) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(qh)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
#endif

// A block of each format as integer-valued floats q, with a scale s (and for formats with a minimum
// an offset b) per sub-block of `sub` elements: w = s * q (+ b), rounded as the reference rounds it
// (b is -dmin*min for the K-quants: adding the negation rounds as subtracting does).
template <int Q> struct Format;

template <> struct Format<Q4_0> {
  static constexpr int elems = 32, bytes = 18, sub = 32;
  static constexpr bool has_min = false;
  static void decode_q(const uint8_t* b, float* q, float* s, float*) {
    s[0] = f16(b);
#if SERVELM_GGUF_AVX2
    bytes_to_floats<true>(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), q);
#else
    for (int i = 0; i < 16; ++i) {
      q[i] = float((b[2 + i] & 0x0F) - 8);
      q[i + 16] = float((b[2 + i] >> 4) - 8);
    }
#endif
  }
};

template <> struct Format<Q4_1> {
  static constexpr int elems = 32, bytes = 20, sub = 32;
  static constexpr bool has_min = true;
  static void decode_q(const uint8_t* b, float* q, float* s, float* m) {
    s[0] = f16(b);
    m[0] = f16(b + 2);
#if SERVELM_GGUF_AVX2
    bytes_to_floats<false>(nibbles32(b + 4), q);
#else
    for (int i = 0; i < 16; ++i) {
      q[i] = float(b[4 + i] & 0x0F);
      q[i + 16] = float(b[4 + i] >> 4);
    }
#endif
  }
};

// Q5_0 (offset 16) and Q5_1 (with a min) share the bit layout: qh bit i is element i's 5th bit.
template <bool kMin>
inline void decode_q5(const uint8_t* b, float* q, float* s, float* m) {
  s[0] = f16(b);
  if (kMin) m[0] = f16(b + 2);
  const uint32_t qh = u32(b + (kMin ? 4 : 2));
  const uint8_t* qs = b + (kMin ? 8 : 6);
#if SERVELM_GGUF_AVX2
  const __m256i v = _mm256_or_si256(nibbles32(qs), fifth_bits(qh));
  bytes_to_floats<true>(kMin ? v : _mm256_sub_epi8(v, _mm256_set1_epi8(16)), q);
#else
  for (int i = 0; i < 16; ++i) {
    const int lo = (qs[i] & 0x0F) | (((qh >> i) & 1) << 4);
    const int hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    q[i] = float(kMin ? lo : lo - 16);
    q[i + 16] = float(kMin ? hi : hi - 16);
  }
#endif
}
template <> struct Format<Q5_0> {
  static constexpr int elems = 32, bytes = 22, sub = 32;
  static constexpr bool has_min = false;
  static void decode_q(const uint8_t* b, float* q, float* s, float* m) { decode_q5<false>(b, q, s, m); }
};
template <> struct Format<Q5_1> {
  static constexpr int elems = 32, bytes = 24, sub = 32;
  static constexpr bool has_min = true;
  static void decode_q(const uint8_t* b, float* q, float* s, float* m) { decode_q5<true>(b, q, s, m); }
};

template <> struct Format<Q8_0> {
  static constexpr int elems = 32, bytes = 34, sub = 32;
  static constexpr bool has_min = false;
  static void decode_q(const uint8_t* b, float* q, float* s, float*) {
    s[0] = f16(b);
#if SERVELM_GGUF_AVX2
    bytes_to_floats<true>(load256(b + 2), q);
#else
    for (int i = 0; i < 32; ++i) q[i] = float(int8_t(b[2 + i]));
#endif
  }
};

// Q4_K (no 5th bits) and Q5_K: 8 sub-blocks of 32, each (d*scale)*q - dmin*min; 32 quant bytes feed
// sub-blocks 2c (low nibbles) and 2c+1 (high); bit j of qh[l] is the 5th bit of element l of sub-block j.
// The 8 sub-blocks' scales d * scale and offsets -(dmin * min) of a Q4_K / Q5_K block.
inline void k45_scales(const uint8_t* b, float* s, float* m) {
  const float d = f16(b), dmin = f16(b + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b + 4, j, sc, mn);
    s[j] = d * float(sc);
    m[j] = -(dmin * float(mn));
  }
}

template <bool kHigh>
inline void decode_k45(const uint8_t* b, float* q, float* s, float* m) {
  k45_scales(b, s, m);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (kHigh ? 48 : 16);
  for (int c = 0; c < 4; ++c) {
#if SERVELM_GGUF_AVX2
    const __m256i raw = load256(qs + 32 * c), mask = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    if (kHigh) {
      const __m256i h = load256(qh), one = _mm256_set1_epi8(1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c)), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
    }
    bytes_to_floats<false>(lo, q + 64 * c);
    bytes_to_floats<false>(hi, q + 64 * c + 32);
#else
    for (int l = 0; l < 32; ++l) {
      int lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
      if (kHigh) {
        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      q[64 * c + l] = float(lo);
      q[64 * c + 32 + l] = float(hi);
    }
#endif
  }
}
template <> struct Format<Q4_K> {
  static constexpr int elems = 256, bytes = 144, sub = 32;
  static constexpr bool has_min = true;
  static void decode_q(const uint8_t* b, float* q, float* s, float* m) { decode_k45<false>(b, q, s, m); }
};
template <> struct Format<Q5_K> {
  static constexpr int elems = 256, bytes = 176, sub = 32;
  static constexpr bool has_min = true;
  static void decode_q(const uint8_t* b, float* q, float* s, float* m) { decode_k45<true>(b, q, s, m); }
};

// Q6_K: two halves of 128; element 128h + 32p + l takes low bits from ql (byte l or 32 + l of the
// half's 64, low or high nibble) and 2 high bits from qh[32h + l] at shift 2p; (d*scale)*(q - 32)
// with an int8 scale per 16 elements.
template <> struct Format<Q6_K> {
  static constexpr int elems = 256, bytes = 210, sub = 16;
  static constexpr bool has_min = false;
  static void decode_q(const uint8_t* b, float* q, float* s, float*) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const float d = f16(b + 208);
    for (int j = 0; j < 16; ++j) s[j] = d * float(int8_t(b[192 + j]));
    for (int h = 0; h < 2; ++h) {
#if SERVELM_GGUF_AVX2
      const __m256i A = load256(ql + 64 * h), B = load256(ql + 64 * h + 32), H = load256(qh + 32 * h);
      const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
      const __m256i low[4] = {_mm256_and_si256(A, m4), _mm256_and_si256(B, m4),
                              _mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(_mm256_srli_epi16(B, 4), m4)};
      for (int p = 0; p < 4; ++p) {
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * p)), m2);
        bytes_to_floats<true>(_mm256_sub_epi8(_mm256_or_si256(low[p], _mm256_slli_epi16(high, 4)), off), q + 128 * h + 32 * p);
      }
#else
      for (int p = 0; p < 4; ++p)
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = ql[64 * h + (p & 1) * 32 + l];
          const int lo = p < 2 ? (byte & 0x0F) : (byte >> 4);
          q[128 * h + 32 * p + l] = float((lo | (((qh[32 * h + l] >> (2 * p)) & 3) << 4)) - 32);
        }
#endif
    }
  }
};

// A whole block's float weights from its q, s, b: s * q, then + b where the format has a minimum.
template <int Q>
inline void decode_block(const uint8_t* blk, float* dst) {
  using F = Format<Q>;
  alignas(32) float q[F::elems];
  float s[F::elems / F::sub], m[F::elems / F::sub];
  F::decode_q(blk, q, s, m);
  for (int j = 0; j < F::elems / F::sub; ++j) {
#if SERVELM_GGUF_AVX2
    const __m256 sv = _mm256_set1_ps(s[j]), mv = _mm256_set1_ps(F::has_min ? m[j] : 0.0f);
    for (int i = j * F::sub; i < (j + 1) * F::sub; i += 8) {
      const __m256 w = _mm256_mul_ps(sv, _mm256_load_ps(q + i));
      _mm256_storeu_ps(dst + i, F::has_min ? _mm256_add_ps(w, mv) : w);
    }
#else
    for (int i = j * F::sub; i < (j + 1) * F::sub; ++i) {
      const float w = s[j] * q[i];
      dst[i] = F::has_min ? w + m[j] : w;
    }
#endif
  }
}

// The float formats: one element a "block", decoded kFloatChunk (or fewer, at a row's end) at a time.
template <int Q> struct FloatFormat;
template <> struct FloatFormat<F32> {
  static constexpr int size = 4;
  static void decode(const uint8_t* b, float* dst, int n) { std::memcpy(dst, b, size_t(n) * 4); }
};
template <> struct FloatFormat<F16> {
  static constexpr int size = 2;
  static void decode(const uint8_t* b, float* dst, int n) {
    int i = 0;
#if SERVELM_GGUF_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(load128(b + 2 * i)));
#endif
    for (; i < n; ++i) dst[i] = f16(b + 2 * i);
  }
};
template <> struct FloatFormat<BF16> {
  static constexpr int size = 2;
  static void decode(const uint8_t* b, float* dst, int n) {
    int i = 0;
#if SERVELM_GGUF_AVX2
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(b + 2 * i)), 16)));
#endif
    for (; i < n; ++i) dst[i] = bf16(b + 2 * i);
  }
};

// Decodes elements [k0, k0 + n) of a weight row; n is a whole number of blocks (any n for floats).
template <int Q> constexpr bool kIsFloat = Q == F32 || Q == F16 || Q == BF16;

template <int Q, bool kFloat = kIsFloat<Q>>
struct RowDecoder {
  static constexpr int chunk = Format<Q>::elems;
  static void decode(const uint8_t* row, int64_t k0, int n, float* dst) {
    for (int i = 0; i < n; i += chunk) decode_block<Q>(row + (k0 + i) / chunk * Format<Q>::bytes, dst + i);
  }
};
template <int Q>
struct RowDecoder<Q, true> {
  static constexpr int chunk = kFloatChunk;
  static void decode(const uint8_t* row, int64_t k0, int n, float* dst) {
    FloatFormat<Q>::decode(row + k0 * FloatFormat<Q>::size, dst, n);
  }
};

// M rows' running dot products with one weight row.
template <int M>
struct Accumulators {
#if SERVELM_GGUF_AVX2
  // Independent chains per row, so one row does not wait on FMA latency.
  static constexpr int A = M == 1 ? 4 : (M == 2 ? 2 : 1);
  __m256 v[M][A];
#endif
  float tail[M];

  Accumulators() {
    for (int m = 0; m < M; ++m) {
      tail[m] = 0.0f;
#if SERVELM_GGUF_AVX2
      for (int a = 0; a < A; ++a) v[m][a] = _mm256_setzero_ps();
#endif
    }
  }

  // += w[0..n) . x[m * ldx + 0..n) for each row m.
  inline void add(const float* w, const float* x, int64_t ldx, int n) {
    int j = 0;
#if SERVELM_GGUF_AVX2
    for (; j + 8 * A <= n; j += 8 * A)
      for (int a = 0; a < A; ++a) {
        const __m256 wv = _mm256_loadu_ps(w + j + 8 * a);
        for (int m = 0; m < M; ++m) v[m][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + j + 8 * a), v[m][a]);
      }
    for (; j + 8 <= n; j += 8) {
      const __m256 wv = _mm256_loadu_ps(w + j);
      for (int m = 0; m < M; ++m) v[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + j), v[m][0]);
    }
#endif
    for (; j < n; ++j)
      for (int m = 0; m < M; ++m) tail[m] += w[j] * x[m * ldx + j];
  }

  // += s * (q[0..S) . x[m * ldx + 0..S)) for each row m: one sub-block's integer-valued quants, its scale.
  template <int S>
  inline void add_scaled(const float* q, const float* x, int64_t ldx, float s) {
#if SERVELM_GGUF_AVX2
    const __m256 sv = _mm256_set1_ps(s);
    for (int m0 = 0; m0 < M; m0 += 4) {  // four rows at a time keep t and v in registers
      constexpr int kChunk = M < 4 ? M : 4;
      __m256 t[kChunk];
      const __m256 q0 = _mm256_load_ps(q);
      for (int i = 0; i < kChunk && m0 + i < M; ++i) t[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(x + (m0 + i) * ldx));
      for (int j = 8; j < S; j += 8) {
        const __m256 qv = _mm256_load_ps(q + j);
        for (int i = 0; i < kChunk && m0 + i < M; ++i)
          t[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(x + (m0 + i) * ldx + j), t[i]);
      }
      for (int i = 0; i < kChunk && m0 + i < M; ++i) v[m0 + i][0] = _mm256_fmadd_ps(sv, t[i], v[m0 + i][0]);
    }
#else
    for (int m = 0; m < M; ++m) {
      float t = 0.0f;
      for (int j = 0; j < S; ++j) t += q[j] * x[m * ldx + j];
      tail[m] += s * t;
    }
#endif
  }

  inline float total(int m) const {
#if SERVELM_GGUF_AVX2
    __m256 s = v[m][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, v[m][a]);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r) + tail[m];
#else
    return tail[m];
#endif
  }
};

// f(std::integral_constant<int, M>{}) for M = min(rows, kGroup), M >= 1.
template <int M = 1, typename F>
void with_rows(int64_t rows, F&& f) {
  if constexpr (M < kGroup) {
    if (rows > M) return with_rows<M + 1>(rows, std::forward<F>(f));
  }
  f(std::integral_constant<int, M>{});
}

struct LinearArgs {
  const float* x;        // [M, K], row stride K
  const uint8_t* w;      // [N, row_bytes], row stride ldw
  float* out;            // [M, N], row stride ldo
  const float* bias;     // [N] or nullptr
  const float* xsum;     // x's sums per 32 elements (x_sums), for formats with a minimum
  int64_t M, N, K, ldw, ldo;
};

// Output row n for activation rows [m0, m0 + M): dot products written (plus bias) to out.
template <int M>
inline void store_row(const LinearArgs& a, const Accumulators<M>& acc, int64_t m0, int64_t n) {
  const float b = a.bias ? a.bias[n] : 0.0f;
  for (int m = 0; m < M; ++m) a.out[(m0 + m) * a.ldo + n] = acc.total(m) + b;
}

#if SERVELM_GGUF_AVX2
// Few rows, vectorized: each block is decoded in registers, 8 elements at a time as int32 lanes
// (no round trip through memory), into several accumulator chains (FMA latency, not throughput,
// bounds a single chain).
//
// 8 bytes at p zero- or sign-extended to 8 int32 lanes (one load + widen).
inline __m256i u8x8(const void* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i i8x8(const void* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
// The low or high nibbles of 8 bytes at p.
inline __m256i nib8(const uint8_t* p, bool high) {
  const __m256i v = u8x8(p);
  return high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
}
// Bits e..e+7 of qh, each as 0x10 or 0 in its lane (the 5th bits of Q5_0 / Q5_1 elements e..e+7).
inline __m256i fifth8(uint32_t qh, int e) {
  const __m256i sh = _mm256_add_epi32(_mm256_set1_epi32(e), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(qh)), sh), _mm256_set1_epi32(1));
  return _mm256_slli_epi32(bit, 4);
}
inline __m256i minus(__m256i v, int c) { return _mm256_sub_epi32(v, _mm256_set1_epi32(c)); }

// Per format: scales(b, s, m) gives each sub-block's scale (and offset b where has_min) as Format
// does; q8(b, j, g) the integer quants of elements 8g..8g+7 of sub-block j as int32 lanes, or where
// kBuffered, decode_i8(b, q) all of the block's quants as int8 (32-byte aligned q).
template <int Q> struct Regs;
template <> struct Regs<Q4_0> {
  static constexpr bool kBuffered = false;
  static void scales(const uint8_t* b, float* s, float*) { s[0] = f16(b); }
  static __m256i q8(const uint8_t* b, int, int g) { return minus(nib8(b + 2 + 8 * (g & 1), g >= 2), 8); }
};
template <> struct Regs<Q4_1> {
  static constexpr bool kBuffered = false;
  static void scales(const uint8_t* b, float* s, float* m) { s[0] = f16(b); m[0] = f16(b + 2); }
  static __m256i q8(const uint8_t* b, int, int g) { return nib8(b + 4 + 8 * (g & 1), g >= 2); }
};
// Q5_K and Q6_K, whose bits take many steps per element, decode a whole block to int8 in 256-bit
// steps first (decode_i8, kBuffered), and the kernel widens 8 of those at a time. (Q5_0 / Q5_1
// measured ~15% slower that way than with fifth8.)
inline void store_i8(int8_t* dst, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(dst), v); }
template <> struct Regs<Q5_0> {
  static constexpr bool kBuffered = false;
  static void scales(const uint8_t* b, float* s, float*) { s[0] = f16(b); }
  static __m256i q8(const uint8_t* b, int, int g) {
    return minus(_mm256_or_si256(nib8(b + 6 + 8 * (g & 1), g >= 2), fifth8(u32(b + 2), 8 * g)), 16);
  }
};
template <> struct Regs<Q5_1> {
  static constexpr bool kBuffered = false;
  static void scales(const uint8_t* b, float* s, float* m) { s[0] = f16(b); m[0] = f16(b + 2); }
  static __m256i q8(const uint8_t* b, int, int g) {
    return _mm256_or_si256(nib8(b + 8 + 8 * (g & 1), g >= 2), fifth8(u32(b + 4), 8 * g));
  }
};
template <> struct Regs<Q8_0> {
  static constexpr bool kBuffered = false;
  static void scales(const uint8_t* b, float* s, float*) { s[0] = f16(b); }
  static __m256i q8(const uint8_t* b, int, int g) { return i8x8(b + 2 + 8 * g); }
};
template <bool kHigh> struct RegsK45 {
  static constexpr bool kBuffered = kHigh;
  static void scales(const uint8_t* b, float* s, float* m) {
    const float d = f16(b), dmin = f16(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(b + 4, j, sc, mn);
      s[j] = d * float(sc);
      m[j] = -(dmin * float(mn));
    }
  }
  static __m256i q8(const uint8_t* b, int j, int g) { return nib8(b + 16 + 32 * (j / 2) + 8 * g, j & 1); }
  static void decode_i8(const uint8_t* b, int8_t* q) {  // Q5_K
    const __m256i h = load256(b + 16), one = _mm256_set1_epi8(1), mask = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = load256(b + 48 + 32 * c);
      const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      store_i8(q + 64 * c, _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c)), one), 4)));
      store_i8(q + 64 * c + 32, _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c + 1)), one), 4)));
    }
  }
};
template <> struct Regs<Q4_K> : RegsK45<false> {};
template <> struct Regs<Q5_K> : RegsK45<true> {};
template <> struct Regs<Q6_K> {
  static constexpr bool kBuffered = true;
  static void scales(const uint8_t* b, float* s, float*) {
    const float d = f16(b + 208);
    for (int j = 0; j < 16; ++j) s[j] = d * float(int8_t(b[192 + j]));
  }
  static void decode_i8(const uint8_t* b, int8_t* q) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i A = load256(b + 64 * h), B = load256(b + 64 * h + 32), H = load256(b + 128 + 32 * h);
      const __m256i low[4] = {_mm256_and_si256(A, m4), _mm256_and_si256(B, m4),
                              _mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(_mm256_srli_epi16(B, 4), m4)};
      for (int p = 0; p < 4; ++p) {
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * p)), m2);
        store_i8(q + 128 * h + 32 * p, _mm256_sub_epi8(_mm256_or_si256(low[p], _mm256_slli_epi16(high, 4)), off));
      }
    }
  }
};

// Output row n for all M activation rows, one weight row at a time: walking 2-4 rows together
// (to share x loads) measured slower, up to 1.7x for Q4_1 2048x2048 and 2x for the Q8_0 head
// (interleaved row streams read memory slower; 256-element formats also grow and spill).
// Per sub-block j and activation row m: t = sum q x over its elements, acc += s_j * t (+ b_j *
// lane sums of x, for formats with a minimum).
template <int Q, int M>
inline void regs_rows(const LinearArgs& a, int64_t n) {
  using F = Format<Q>;
  constexpr int subs = F::elems / F::sub, G = F::sub / 8;
  // Accumulators per activation row: enough chains that the FMAs into them do not wait on
  // each other's latency (one chain took 4 cycles a sub-block: the bound for Q6_K / Q4_K / Q8_0).
  constexpr int A = M >= 4 ? 1 : 4 / M;
  static_assert(!F::has_min || F::sub == 32, "the x lane sums are per 32 elements");
  __m256 acc[M][A];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < A; ++c) acc[m][c] = _mm256_setzero_ps();
  const int64_t nblk = a.K / F::elems, ldxs = a.K / 4;
  const uint8_t* row = a.w + n * a.ldw;
  // Block blk, its sub-block j's terms going to chain (u + j) % A (the minimum's to the next chain).
  auto block = [&](int64_t blk, auto uu) {
    constexpr int u = decltype(uu)::value;
    const float* xb = a.x + blk * F::elems;
    const float* xs = a.xsum + blk * subs * 8;
    {
      const uint8_t* b = row + blk * F::bytes;
      prefetch_ahead(b, F::bytes);
      float s[subs], mn[subs];
      Regs<Q>::scales(b, s, mn);
      alignas(32) int8_t qb[Regs<Q>::kBuffered ? F::elems : 32];
      if constexpr (Regs<Q>::kBuffered) Regs<Q>::decode_i8(b, qb);
#pragma GCC unroll 16
      for (int j = 0; j < subs; ++j) {
        __m256 q[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          if constexpr (Regs<Q>::kBuffered) q[g] = _mm256_cvtepi32_ps(i8x8(qb + j * F::sub + 8 * g));
          else q[g] = _mm256_cvtepi32_ps(Regs<Q>::q8(b, j, g));
        }
        const __m256 sv = _mm256_set1_ps(s[j]);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const float* xj = xb + m * a.K + j * F::sub;
          __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xj));
          for (int g = 1; g < G; ++g) t = _mm256_fmadd_ps(q[g], _mm256_loadu_ps(xj + 8 * g), t);
          __m256& c0 = acc[m][(u + j) % A];
          c0 = _mm256_fmadd_ps(sv, t, c0);
          if constexpr (F::has_min) {
            __m256& c1 = acc[m][(u + j + 1) % A];
            c1 = _mm256_fmadd_ps(_mm256_set1_ps(mn[j]), _mm256_loadu_ps(xs + m * ldxs + j * 8), c1);
          }
        }
      }
    }
  };
  using I0 = std::integral_constant<int, 0>;
  int64_t blk = 0;
  if constexpr (subs < A) {  // one sub-block a block: consecutive blocks take turns over the chains
    for (; blk + A <= nblk; blk += A) {
      block(blk, I0{});
      if constexpr (A > 1) block(blk + 1, std::integral_constant<int, 1>{});
      if constexpr (A > 2) block(blk + 2, std::integral_constant<int, 2>{});
      if constexpr (A > 3) block(blk + 3, std::integral_constant<int, 3>{});
    }
  }
  for (; blk < nblk; ++blk) block(blk, I0{});
  Accumulators<M> sums;
  for (int m = 0; m < M; ++m) {
    __m256 v = acc[m][0];
    for (int c = 1; c < A; ++c) v = _mm256_add_ps(v, acc[m][c]);
    sums.v[m][0] = v;
  }
  store_row<M>(a, sums, 0, n);
}

template <int Q, int M>
void quant_rows(const LinearArgs& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) regs_rows<Q, M>(a, n);
}

// For formats with a minimum: x's sums per 32 elements, kept as 8 lane sums [M, K / 32, 8].
inline void x_sums(const float* x, int64_t M, int64_t K, std::vector<float>& xs) {
  xs.assign(size_t(M * (K / 4)), 0.0f);
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    __m256 v = _mm256_loadu_ps(x + 32 * i);
    for (int g = 1; g < 4; ++g) v = _mm256_add_ps(v, _mm256_loadu_ps(x + 32 * i + 8 * g));
    _mm256_storeu_ps(xs.data() + 8 * i, v);
  }
}
#else
// Few rows of a quantized format: sum_i (s q_i + b) x_i = s * sum_i q_i x_i + b * sum_i x_i per
// sub-block, so each weight costs one conversion and one FMA per row.
template <int Q, int M>
void quant_rows(const LinearArgs& a, int64_t n0, int64_t n1) {
  using F = Format<Q>;
  constexpr int nsub = F::elems / F::sub;
  alignas(32) float q[F::elems];
  float s[nsub], mn[nsub];
  const int64_t subs_per_row = a.K / F::sub;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.ldw;
    Accumulators<M> acc;
    for (int64_t blk = 0; blk < a.K / F::elems; ++blk) {
      F::decode_q(row + blk * F::bytes, q, s, mn);
      const float* xb = a.x + blk * F::elems;
      for (int j = 0; j < nsub; ++j) acc.template add_scaled<F::sub>(q + j * F::sub, xb + j * F::sub, a.K, s[j]);
      if constexpr (F::has_min)
        for (int m = 0; m < M; ++m)
          for (int j = 0; j < nsub; ++j) acc.tail[m] += mn[j] * a.xsum[m * subs_per_row + blk * nsub + j];
    }
    store_row<M>(a, acc, 0, n);
  }
}

// For formats with a minimum: x's sums per 32 elements [M, K / 32].
inline void x_sums(const float* x, int64_t M, int64_t K, std::vector<float>& xs) {
  xs.assign(size_t(M * (K / 32)), 0.0f);
  for (int64_t i = 0; i < M * (K / 32); ++i)
    for (int j = 0; j < 32; ++j) xs[i] += x[i * 32 + j];
}
#endif

template <int Q>
void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1) {
  using D = RowDecoder<Q>;
  if constexpr (!kIsFloat<Q>) {
    if (a.M <= kGroup) {
      with_rows(a.M, [&](auto mm) { quant_rows<Q, decltype(mm)::value>(a, n0, n1); });
      return;
    }
#if SERVELM_GGUF_AVX2
    if (a.M <= kPassRows) {
      // Each weight row meets every group of kGroup rows while it is still in L1: one pass over W.
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m0 = 0; m0 < a.M; m0 += kGroup) {
          LinearArgs b = a;
          b.M = std::min<int64_t>(kGroup, a.M - m0);
          b.x += m0 * a.K;
          if (b.xsum) b.xsum += m0 * (a.K / 4);
          b.out += m0 * a.ldo;
          with_rows(b.M, [&](auto mm) { regs_rows<Q, decltype(mm)::value>(b, n); });
        }
      return;
    }
#endif
  }
  if (a.M <= kGroup) {
    // Decode each chunk once into L1 and multiply it into every row's accumulators.
    alignas(64) float wbuf[kFloatChunk];
    with_rows(a.M, [&](auto mm) {
      constexpr int M = decltype(mm)::value;
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = a.w + n * a.ldw;
        Accumulators<M> acc;
        for (int64_t k = 0; k < a.K; k += D::chunk) {
          const int len = int(std::min<int64_t>(D::chunk, a.K - k));
          if (Q == F32 && reinterpret_cast<uintptr_t>(row) % alignof(float) == 0) {
            acc.add(reinterpret_cast<const float*>(row) + k, a.x + k, a.K, len);  // already floats
            continue;
          }
          D::decode(row, k, len, wbuf);
          acc.add(wbuf, a.x + k, a.K, len);
        }
        store_row<M>(a, acc, 0, n);
      }
    });
    return;
  }
  // Many rows: decode each weight row once, then let every group of rows read the floats.
  std::vector<float> wrow(size_t(a.K));
  for (int64_t n = n0; n < n1; ++n) {
    D::decode(a.w + n * a.ldw, 0, int(a.K), wrow.data());
    for (int64_t m0 = 0; m0 < a.M; m0 += kGroup) {
      with_rows(std::min<int64_t>(kGroup, a.M - m0), [&](auto mm) {
        constexpr int M = decltype(mm)::value;
        Accumulators<M> acc;
        acc.add(wrow.data(), a.x + m0 * a.K, a.K, int(a.K));
        store_row<M>(a, acc, m0, n);
      });
    }
  }
}

// f(std::integral_constant<int, Q>{}) for the supported qtype Q; raises for any other.
template <int Q, int... Rest, typename F>
void dispatch_qtype(int64_t qtype, F&& f) {
  if (qtype == Q) return f(std::integral_constant<int, Q>{});
  if constexpr (sizeof...(Rest) > 0) {
    dispatch_qtype<Rest...>(qtype, std::forward<F>(f));
  } else {
    TORCH_CHECK(false, "GGUF kernels: unsupported quantization type ", qtype,
                " (supported: F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, BF16 30)");
  }
}
template <typename F>
void with_qtype(int64_t qtype, F&& f) {
  dispatch_qtype<F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K>(qtype, std::forward<F>(f));
}

// (elements, bytes) of one block of qtype; elements == 1 for the float formats.
std::pair<int, int> layout(int64_t qtype) {
  std::pair<int, int> result;
  with_qtype(qtype, [&](auto qq) {
    constexpr int Q = decltype(qq)::value;
    if constexpr (kIsFloat<Q>) result = {1, FloatFormat<Q>::size};
    else result = {Format<Q>::elems, Format<Q>::bytes};
  });
  return result;
}

// Checks blocks against [N, K / block_elems * block_bytes] uint8 with contiguous rows.
void check_blocks(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  const auto [elems, bytes] = layout(qtype);
  TORCH_CHECK(K > 0 && K % elems == 0, "GGUF kernels: K = ", K, " is not a positive multiple of ", elems);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.device().is_cpu(),
              "GGUF kernels: blocks must be uint8 [N, row_bytes] on the CPU");
  TORCH_CHECK(blocks.size(1) == K / elems * bytes, "GGUF kernels: K = ", K, " wants ", K / elems * bytes,
              " bytes a row, blocks have ", blocks.size(1));
  TORCH_CHECK(blocks.stride(1) == 1 && (blocks.size(0) <= 1 || blocks.stride(0) >= blocks.size(1)),
              "GGUF kernels: each row of blocks must be contiguous");
}

// ---- int8 activations: llama.cpp's arithmetic, on request (`int8_x`) ----
// x is rounded to int8 with one float scale per block of 32 elements (for the 32-element formats) or
// 256 (the K-quants), and each weight block meets it in integer dot products (maddubs / madd), one
// float multiply-add per block: roughly twice the blocks per cycle of the float path, whose
// int-to-float widening bounds a one-row step. The result is W x' with x' the rounded x (about 0.4%
// of a block's largest element): no longer the float32 reference's sum, as with llama.cpp.

// One activation matrix rounded per block of `blk`: x'[i] = d[i / blk] * q[i]; sums of q per 16.
struct QuantX {
  int blk = 0;
  std::vector<float> d;        // [M * K / blk]
  std::vector<int8_t> q;       // [M * K]
  std::vector<int16_t> sum16;  // [M * K / 16]
  std::vector<float> dsum32;   // [M * K / 32]: d * (sum of q over 32), for the formats with a minimum
  // For blk 32, per group g of 8 whole rows: d and dsum32 of block b for rows 8g..8g+7 at [(g * K / 32 + b) * 8]
  // (what the 8-row tile loads as one vector).
  std::vector<float> d8, dsum8;
};


// Rows a thread takes at least in the per-row loops around the projections (~16k elements: a
// decode step's few rows stay on the calling thread, a prefill's spread over all).
inline int64_t row_grain(int64_t K) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)); }

// One block of blk elements: its scale d and int8 quants q. Returns d (NaN if the block has a non-finite value).
inline float quantize_block(const float* xb, int blk, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
#if SERVELM_GGUF_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps(), vfin = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  for (int i = 0; i < blk; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i));
    vmax = _mm256_max_ps(vmax, a);
    vfin = _mm256_and_ps(vfin, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for inf and NaN
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  amax = _mm_cvtss_f32(m);
  finite = _mm256_movemask_ps(vfin) == 0xFF;
#else
  for (int i = 0; i < blk; ++i) {
    finite &= std::isfinite(xb[i]);
    amax = std::max(amax, std::fabs(xb[i]));
  }
#endif
  // A non-finite activation must surface as NaN in the output (a faulty row), never as zeros.
  const float d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
  const float id = (finite && d > 0.0f) ? 1.0f / d : 0.0f;
#if SERVELM_GGUF_AVX2
  // cvtps rounds half to even under the default rounding mode, as std::nearbyint does.
  const __m256 vid = _mm256_set1_ps(id);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int i = 0; i < blk; i += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
    v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w16, w16));
  }
#else
  for (int i = 0; i < blk; ++i) q[i] = int8_t(std::clamp(int(std::nearbyint(xb[i] * id)), -127, 127));
#endif
  return d;
}

void quantize_x(const float* x, int64_t M, int64_t K, int blk, QuantX& out) {
  out.blk = blk;
  const int64_t nb = K / blk, nblk = K / 32, groups = blk == 32 ? M / 8 : 0;
  out.d.resize(size_t(M * nb));
  out.q.resize(size_t(M * K));
  out.sum16.resize(size_t(M * K / 16));
  out.dsum32.resize(size_t(M * nblk));
  out.d8.resize(size_t(groups * nblk * 8));
  out.dsum8.resize(out.d8.size());
  // Row by row, over the threads for a prefill's rows (serially, one thread waited while it ran).
  at::parallel_for(0, M, row_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* q = out.q.data() + m * K;
      for (int64_t b = 0; b < nb; ++b) out.d[size_t(m * nb + b)] = quantize_block(x + m * K + b * blk, blk, q + b * blk);
      int16_t* s16 = out.sum16.data() + m * K / 16;
      for (int64_t g = 0; g < K / 16; ++g) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += q[16 * g + i];
        s16[g] = int16_t(s);
      }
      for (int64_t g = 0; g < nblk; ++g) {
        const float ds = out.d[size_t(m * nb + 32 * g / blk)] * float(s16[2 * g] + s16[2 * g + 1]);
        out.dsum32[size_t(m * nblk + g)] = ds;
        if (m / 8 < groups) {
          out.d8[size_t((m / 8 * nblk + g) * 8 + m % 8)] = out.d[size_t(m * nb + g)];
          out.dsum8[size_t((m / 8 * nblk + g) * 8 + m % 8)] = ds;
        }
      }
    }
  });
}

// x' as floats [M, K] into xf: what the many-row and non-AVX2 paths multiply, so every path computes W x'.
void dequantize_x_into(const QuantX& xq, int64_t M, int64_t K, float* xf) {
  const int64_t nb = M * K / xq.blk;
  for (int64_t b = 0; b < nb; ++b) {
    const float d = xq.d[size_t(b)];
    const int8_t* q = xq.q.data() + b * xq.blk;
    float* o = xf + b * xq.blk;
    for (int i = 0; i < xq.blk; ++i) o[i] = d * float(q[i]);
  }
}

std::vector<float> dequantize_x(const QuantX& xq, int64_t M, int64_t K) {
  std::vector<float> xf(size_t(M * K));
  dequantize_x_into(xq, M, K, xf.data());
  return xf;
}

template <int Q> constexpr int kXBlock = Format<Q>::elems == 256 ? 256 : 32;

#if SERVELM_GGUF_AVX2
inline __m256i ones16() { return _mm256_set1_epi16(1); }
// Signed bytes w times signed bytes x, summed in pairs to int16 (maddubs wants one unsigned side).
inline __m256i dot_i8_pairs(__m256i w, __m256i x) {
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
inline __m256i load_q(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline float hsum(__m256 s) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// The 32 quants of a 32-element block as bytes: signed (Q8_0), or unsigned u with w = u - kOffset.
// Q4_0 and Q5_0 multiply their unsigned codes (maddubs takes them as they are: no sign trick, no
// subtraction) and take kOffset * d_w * (d_x * sum of x's quants) off per block instead.
template <int Q> struct Bytes32;
template <> struct Bytes32<Q4_0> { static constexpr bool kSigned = false; static constexpr int kOffset = 8;
  static __m256i get(const uint8_t* b) { return nibbles32(b + 2); } };
template <> struct Bytes32<Q4_1> { static constexpr bool kSigned = false; static constexpr int kOffset = 0;
  static __m256i get(const uint8_t* b) { return nibbles32(b + 4); } };
template <> struct Bytes32<Q5_0> { static constexpr bool kSigned = false; static constexpr int kOffset = 16;
  static __m256i get(const uint8_t* b) { return _mm256_or_si256(nibbles32(b + 6), fifth_bits(u32(b + 2))); } };
template <> struct Bytes32<Q5_1> { static constexpr bool kSigned = false; static constexpr int kOffset = 0;
  static __m256i get(const uint8_t* b) { return _mm256_or_si256(nibbles32(b + 8), fifth_bits(u32(b + 4))); } };
template <> struct Bytes32<Q8_0> { static constexpr bool kSigned = true; static constexpr int kOffset = 0;
  static __m256i get(const uint8_t* b) { return load256(b + 2); } };

// A block's 32 products of weight codes and x's quants, summed in 8 int32 lanes: one vpdpbusd with
// AVX-512 VNNI (Q8_0's signed quants read as unsigned codes w + 128), else maddubs and madd.
// kDotOffset<Q>: the offset of the codes so read (w = code - offset), taken off with x's block sums.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnniDots = true;
#else
constexpr bool kVnniDots = false;
#endif
template <int Q> constexpr int kDotOffset = Bytes32<Q>::kSigned && kVnniDots ? 128 : Bytes32<Q>::kOffset;
template <int Q>
inline __m256i block_dots(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (Bytes32<Q>::kSigned) w = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(Bytes32<Q>::kSigned ? dot_i8_pairs(w, x) : _mm256_maddubs_epi16(w, x), ones16());
#endif
}

// A 32-element block's float16 scale d (returned) and, for the formats with one, its minimum (adjacent
// to d: both converted in one instruction).
template <bool kMin>
inline float scale_min32(const uint8_t* b, float& wmin) {
  if constexpr (kMin) {
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(int(u32(b))));
    wmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    return _mm_cvtss_f32(dm);
  }
  return f16(b);
}

// Output row n of a 32-element format for M rows of x' (2-7 rows; one row takes int8_row32_folded).
// One chain per row and block phase (A of them), so a few-row step is not bound by FMA latency.
template <int Q, int M>
inline void int8_rows32(const LinearArgs& a, const QuantX& xq, int64_t n, int64_t m0) {
  using F = Format<Q>;
  using B = Bytes32<Q>;
  constexpr int A = M >= 4 ? 1 : 4 / M;
  const int64_t nblk = a.K / 32;
  const uint8_t* row = a.w + n * a.ldw;
  __m256 acc[M][A];
  float mins[M];
  for (int m = 0; m < M; ++m) {
    mins[m] = 0.0f;
    for (int c = 0; c < A; ++c) acc[m][c] = _mm256_setzero_ps();
  }
  auto block = [&](int64_t blk, int c) {
    const uint8_t* b = row + blk * F::bytes;
    const __m256i w = B::get(b);
    float wmin = 0.0f;
    const float dw = scale_min32<F::has_min>(b, wmin);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256i xv = load_q(xq.q.data() + (m0 + m) * a.K + blk * 32);
      const __m256 p = _mm256_cvtepi32_ps(block_dots<Q>(w, xv));
      acc[m][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * xq.d[size_t((m0 + m) * nblk + blk)]), acc[m][c]);
      // What each block adds besides its products: its minimum, or minus its codes' offset, times x's sum.
      if constexpr (F::has_min) mins[m] += wmin * xq.dsum32[size_t((m0 + m) * nblk + blk)];
      if constexpr (kDotOffset<Q> != 0) mins[m] -= float(kDotOffset<Q>) * dw * xq.dsum32[size_t((m0 + m) * nblk + blk)];
    }
  };
  int64_t blk = 0;
  for (; blk + A <= nblk; blk += A) {
    prefetch_ahead(row + blk * F::bytes, A * F::bytes);
#pragma GCC unroll 4
    for (int c = 0; c < A; ++c) block(blk + c, c);
  }
  for (; blk < nblk; ++blk) block(blk, 0);
  const float bias = a.bias ? a.bias[n] : 0.0f;
  for (int m = 0; m < M; ++m) {
    __m256 v = acc[m][0];
    for (int c = 1; c < A; ++c) v = _mm256_add_ps(v, acc[m][c]);
    a.out[(m0 + m) * a.ldo + n] = hsum(v) + mins[m] + bias;
  }
}

// The 8 int32 lanes of each of s[0..7] summed: one vector of the 8 totals. Unpacking pairs and adding
// (then pairs of pairs) gives [t0, t1, t2, t3] from each half of s[0..3] and of s[4..7]; a lane swap
// adds the halves (a little ahead of hadd on Zen 3).
inline __m256i fold8(const __m256i* s) {
  auto pairs = [](__m256i u, __m256i v) { return _mm256_add_epi32(_mm256_unpacklo_epi32(u, v), _mm256_unpackhi_epi32(u, v)); };
  auto quads = [](__m256i u, __m256i v) { return _mm256_add_epi32(_mm256_unpacklo_epi64(u, v), _mm256_unpackhi_epi64(u, v)); };
  const __m256i s03 = quads(pairs(s[0], s[1]), pairs(s[2], s[3]));
  const __m256i s47 = quads(pairs(s[4], s[5]), pairs(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(s03, s47, 0x20), _mm256_permute2x128_si256(s03, s47, 0x31));
}

// The float16 scales d of 8 consecutive 32-element blocks from b (and, for the formats with one, their
// minimums, stored just after d): one gather of each block's first 4 bytes and one conversion.
template <int Q>
inline __m256 scales8(const uint8_t* b, __m256& wmin) {
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(Format<Q>::bytes));
  const __m256i g = _mm256_i32gather_epi32(reinterpret_cast<const int*>(b), at, 1);
  if constexpr (Format<Q>::has_min) {
    // [d0 m0 d1 m1 d2 m2 d3 m3] and the same of blocks 4-7; even and odd lanes apart, then in block order.
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(g)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(g, 1));
    auto in_order = [](__m256 v) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8)); };
    wmin = in_order(_mm256_shuffle_ps(lo, hi, 0xDD));
    return in_order(_mm256_shuffle_ps(lo, hi, 0x88));
  }
  const __m256i d = _mm256_and_si256(g, _mm256_set1_epi32(0xFFFF));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(d, d), 0x08)));
}

// Output row n of a 32-element format for one row of x' (a decode step). Eight blocks at a time: their
// integer dot products are folded into one vector of 8 totals that meets the 8 blocks' scales (one
// gather) in one conversion and one multiply-add, where int8_rows32 pays a conversion, a scalar scale
// and a broadcast per block: on the 5-bit formats that float work was most of a block's instructions.
template <int Q>
inline void int8_row32_folded(const LinearArgs& a, const QuantX& xq, int64_t n) {
  using F = Format<Q>;
  using B = Bytes32<Q>;
  const int64_t nblk = a.K / 32;
  const uint8_t* row = a.w + n * a.ldw;
  const int8_t* x = xq.q.data();
  __m256 acc = _mm256_setzero_ps(), extra = _mm256_setzero_ps();
  int64_t blk = 0;
  for (; blk + 8 <= nblk; blk += 8) {
    __m256i s[8];
    prefetch_ahead(row + blk * F::bytes, 8 * F::bytes);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w = B::get(row + (blk + j) * F::bytes), xv = load_q(x + (blk + j) * 32);
      s[j] = block_dots<Q>(w, xv);
    }
    __m256 wmin;
    const __m256 dw = scales8<Q>(row + blk * F::bytes, wmin);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold8(s)), _mm256_mul_ps(dw, _mm256_loadu_ps(xq.d.data() + blk)), acc);
    const __m256 dsum = _mm256_loadu_ps(xq.dsum32.data() + blk);
    if constexpr (F::has_min) extra = _mm256_fmadd_ps(wmin, dsum, extra);
    if constexpr (kDotOffset<Q> != 0) extra = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_set1_ps(float(kDotOffset<Q>)), dw), dsum, extra);
  }
  // The last nblk % 8 blocks one at a time, as int8_rows32 takes them.
  float tail = 0.0f;
  for (; blk < nblk; ++blk) {
    const uint8_t* b = row + blk * F::bytes;
    const __m256i w = B::get(b), xv = load_q(x + blk * 32);
    float wmin = 0.0f;
    const float dw = scale_min32<F::has_min>(b, wmin);
    const __m256 p = _mm256_cvtepi32_ps(block_dots<Q>(w, xv));
    const float dx = xq.d[size_t(blk)], ds = xq.dsum32[size_t(blk)];
    tail += hsum(p) * (dw * dx);
    if constexpr (F::has_min) tail += wmin * ds;
    if constexpr (kDotOffset<Q> != 0) tail -= float(kDotOffset<Q>) * dw * ds;
  }
  a.out[n] = hsum(_mm256_add_ps(acc, extra)) + tail + (a.bias ? a.bias[n] : 0.0f);
}

// Output row n of a 32-element format for the 8 rows 8g..8g+7 of x' (a step of many rows). Per block,
// each row's products are summed to 8 int32 lanes as in int8_rows32, and the 8 rows' lanes are then
// folded into one vector of their 8 totals (unpacks and adds, a lane swap), which meets the rows'
// scales in one conversion and one multiply-add: the per-row-and-block float work of int8_rows32 (a
// conversion, a broadcast scale, a multiply-add, the minimum's scalar steps) is paid once per 8 rows.
template <int Q>
inline void int8_tile32(const LinearArgs& a, const QuantX& xq, int64_t n, int64_t g) {
  using F = Format<Q>;
  using B = Bytes32<Q>;
  const int64_t nblk = a.K / 32;
  const uint8_t* row = a.w + n * a.ldw;
  const int8_t* x = xq.q.data() + 8 * g * a.K;
  const float* d8 = xq.d8.data() + g * nblk * 8;
  const float* s8 = xq.dsum8.data() + g * nblk * 8;
  __m256 acc = _mm256_setzero_ps(), extra = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const uint8_t* b = row + blk * F::bytes;
    const __m256i w = B::get(b);
    const __m256i aw = B::kSigned ? _mm256_sign_epi8(w, w) : w;
    __m256i s[8];
#pragma GCC unroll 8
    for (int m = 0; m < 8; ++m) {
      __m256i xv = load_q(x + m * a.K + blk * 32);
      if (B::kSigned) xv = _mm256_sign_epi8(xv, w);
      s[m] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones16());
    }
    const __m256i t = fold8(s);
    float wmin = 0.0f;
    const float dw = scale_min32<F::has_min>(b, wmin);
    const __m256 dx = _mm256_loadu_ps(d8 + blk * 8);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dx, _mm256_set1_ps(dw)), acc);
    if constexpr (F::has_min) extra = _mm256_fmadd_ps(_mm256_set1_ps(wmin), _mm256_loadu_ps(s8 + blk * 8), extra);
    if constexpr (B::kOffset != 0)
      extra = _mm256_fnmadd_ps(_mm256_set1_ps(float(B::kOffset) * dw), _mm256_loadu_ps(s8 + blk * 8), extra);
  }
  alignas(32) float tot[8];
  _mm256_store_ps(tot, _mm256_add_ps(acc, extra));
  const float bias = a.bias ? a.bias[n] : 0.0f;
  for (int m = 0; m < 8; ++m) a.out[(8 * g + m) * a.ldo + n] = tot[m] + bias;
}

// The K-quants against x' rounded per 256: each 32 quants' integer products are scaled by the
// sub-block's integer scale (madd), summed over the block in int32, and meet d_w * d_x once.
template <int Q> struct KBlock;
template <bool kHigh> struct KBlock45 {
  // 8 sub-blocks of 32: integer scale and minimum; quants unsigned (0..15, or 0..31 with the 5th bit).
  // Quants 64c..64c+31 (lo, sub-block 2c) and 64c+32..64c+63 (hi, sub-block 2c+1) as unsigned codes.
  static void codes(const uint8_t* b, int c, __m256i& lo, __m256i& hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i raw = load256(b + (kHigh ? 48 : 16) + 32 * c);
    lo = _mm256_and_si256(raw, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    if (kHigh) {
      const __m256i h = load256(b + 16), one = _mm256_set1_epi8(1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c)), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
    }
  }
  // minsum[m]: sum over sub-blocks of minimum * (sum of x's quants there), as 8 int32 lanes.
  template <int M>
  static void dots(const uint8_t* b, const int8_t* const* xq, __m256i* sumi, __m256i* minsum, const int16_t* const* s16) {
    // Scales and minimums stay in registers ([sc0..sc7 | mn0..mn7] bytes): each sub-block's scale is
    // one in-lane shuffle of them, where byte loads of a stack copy cost a broadcast from memory each.
    uint32_t words[4];
    scales_mins_k4(b + 4, words);
    const __m128i sm = _mm_setr_epi32(int(words[0]), int(words[1]), int(words[2]), int(words[3]));
    const __m256i scales = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(sm, sm));  // sc0..sc7 in each lane
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      codes(b, c, lo, hi);
      const __m256i s_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * (2 * c))));
      const __m256i s_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * (2 * c + 1))));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load_q(xq[m] + 64 * c)), s_lo);
        const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load_q(xq[m] + 64 * c + 32)), s_hi);
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p_lo, p_hi));
      }
    }
    // The minimums against x's sums per 16 (two per sub-block): one madd a row instead of 16 scalar steps.
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_unpackhi_epi64(sm, sm), dup));
    for (int m = 0; m < M; ++m)
      minsum[m] = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16[m])), mins16);
  }
  static float d(const uint8_t* b) { return f16(b); }
  static float dmin(const uint8_t* b) { return f16(b + 2); }
};
template <> struct KBlock<Q4_K> : KBlock45<false> {};
template <> struct KBlock<Q5_K> : KBlock45<true> {};
template <> struct KBlock<Q6_K> {
  // 16 sub-blocks of 16 with a signed int8 scale; quants 6 bits less 32 (signed bytes).
  // Quants 128h + 32p .. 128h + 32p + 31 as unsigned codes q (the weights are scale * (q - 32)).
  static __m256i codes(const uint8_t* b, int h, int p) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i ql = load256(b + 64 * h + 32 * (p & 1));
    const __m256i low = _mm256_and_si256(p < 2 ? ql : _mm256_srli_epi16(ql, 4), m4);
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(load256(b + 128 + 32 * h), _mm_cvtsi32_si128(2 * p)), _mm256_set1_epi8(0x03));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
  template <int M>
  static void dots(const uint8_t* b, const int8_t* const* xq, __m256i* sumi, __m256i*, const int16_t* const*) {
    const __m256i off = _mm256_set1_epi8(32);
    // The 16 scales as int16, scales 0-7 (then 8-15) in both lanes: a pair of sub-blocks' scales is one
    // in-lane shuffle, where two sign-extended byte broadcasts and an insert cost ~7 instructions.
    const __m256i sc16 = _mm256_cvtepi8_epi16(load128(b + 192));
    const __m256i halves[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00), _mm256_permute2x128_si256(sc16, sc16, 0x11)};
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i w = _mm256_sub_epi8(codes(b, h, p), off);
        // the scales of sub-blocks 8h + 2p and 8h + 2p + 1 (elements 128h + 32p + [0, 16) and [16, 32))
        const int k = 2 * p;
        const __m256i s = _mm256_shuffle_epi8(
            halves[h], _mm256_set_m128i(_mm_set1_epi16(int16_t(0x0100 + 0x0202 * (k + 1))), _mm_set1_epi16(int16_t(0x0100 + 0x0202 * k))));
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(dot_i8_pairs(w, load_q(xq[m] + 128 * h + 32 * p)), s));
      }
    }
  }
  static float d(const uint8_t* b) { return f16(b + 208); }
  static float dmin(const uint8_t*) { return 0.0f; }
};

template <int Q, int M>
inline void int8_rowsK(const LinearArgs& a, const QuantX& xq, int64_t n, int64_t m0) {
  using F = Format<Q>;
  const int64_t nblk = a.K / 256;
  const uint8_t* row = a.w + n * a.ldw;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const uint8_t* b = row + blk * F::bytes;
    prefetch_ahead(b, F::bytes);
    const int8_t* xp[M];
    const int16_t* sp[M];
    __m256i sumi[M], minsum[M];
    for (int m = 0; m < M; ++m) {
      xp[m] = xq.q.data() + (m0 + m) * a.K + blk * 256;
      sp[m] = xq.sum16.data() + ((m0 + m) * a.K + blk * 256) / 16;
      sumi[m] = _mm256_setzero_si256();
    }
    KBlock<Q>::template dots<M>(b, xp, sumi, minsum, sp);
    const float dw = KBlock<Q>::d(b), dmin = KBlock<Q>::dmin(b);
    for (int m = 0; m < M; ++m) {
      const float dx = xq.d[size_t((m0 + m) * nblk + blk)];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_set1_ps(dw * dx), acc[m]);
      if constexpr (F::has_min) acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(minsum[m]), _mm256_set1_ps(dmin * dx), acc[m]);
    }
  }
  const float bias = a.bias ? a.bias[n] : 0.0f;
  for (int m = 0; m < M; ++m) a.out[(m0 + m) * a.ldo + n] = hsum(acc[m]) + bias;
}
#endif

#include "gguf_vnni.h"
#include "gguf_amx.h"

// Output rows [n0, n1) of a quantized format against x' (x rounded per block as kXBlock<Q>); px: x'
// packed for the packed tiles, where the step has the rows for them.
template <int Q, typename PX>
void int8_linear_rows(const LinearArgs& a, const QuantX& xq, const float* xf, const PX* px, int64_t n0, int64_t n1) {
#if SERVELM_GGUF_AVX2
  if (px != nullptr) {
#if SERVELM_GGUF_VNNI
    if (px->lanes == 16) {
      if constexpr (Format<Q>::elems == 32) packed_rows32<Lanes16, Q>(a, *px, n0, n1);
      else packed_rowsK<Q>(a, *px, n0, n1);
      return;
    }
#endif
    // Q8_0 keeps the 8-row tiles: its signs cost the AVX2 packed tile two more instructions a dot, and
    // it measured level with them at 32 rows, behind at 8 and 16 (docs/gguf.md).
    if constexpr (Format<Q>::elems == 32) {
      if constexpr (!Bytes32<Q>::kSigned) {
        packed_rows32<Lanes8, Q>(a, *px, n0, n1);
        return;
      }
    }
  }
#endif
#if SERVELM_GGUF_AVX2
  // One row: eight blocks at a time (ahead of rows taken in pairs for Q4_1 / Q5_1 too; docs/gguf.md).
  if constexpr (Format<Q>::elems == 32) {
    if (a.M == 1) {
      for (int64_t n = n0; n < n1; ++n) int8_row32_folded<Q>(a, xq, n);
      return;
    }
  }
  {
    // Each weight row meets every group of x rows in a block of x' rows while it is still in L1, and
    // the block (~128 KB of x') stays in L2 while the thread's span of weight rows passes it: a decode
    // step reads the weight once; a prefill of 512 rows of 2048 (1 MB of x') reads its span of the
    // weight a few times from L2 instead of x' from L3 for every weight row.
    // 32-element formats: whole groups of 8 rows through the tile, the rest row by row.
    const int64_t block_rows = std::max<int64_t>(8, (int64_t(128) << 10) / a.K / 8 * 8);
    for (int64_t mb = 0; mb < a.M; mb += block_rows) {
      const int64_t me = std::min(a.M, mb + block_rows);
      for (int64_t n = n0; n < n1; ++n) {
        int64_t m0 = mb;
        if constexpr (Format<Q>::elems == 32)
          for (; m0 + 8 <= me; m0 += 8) int8_tile32<Q>(a, xq, n, m0 / 8);
        for (; m0 < me; m0 += kGroup)
          with_rows(std::min<int64_t>(kGroup, me - m0), [&](auto mm) {
            constexpr int M = decltype(mm)::value;
            if constexpr (Format<Q>::elems == 256) int8_rowsK<Q, M>(a, xq, n, m0);
            else int8_rows32<Q, M>(a, xq, n, m0);
          });
      }
    }
    return;
  }
#endif
  // Many rows (or no AVX2): the float kernels on x' compute the same W x' (within float32 summation).
  LinearArgs b = a;
  b.x = xf;
  linear_rows<Q>(b, n0, n1);
}

// One weight of a (possibly fused) projection: its blocks, format, and columns of out.
struct Part {
  int64_t qtype;
  LinearArgs a;
  int64_t row_bytes;
};

// Every part's output rows in one parallel region: the parts' rows in order are split into at
// most get_num_threads() contiguous spans of about equal bytes (none under 64 KB, as a fork/join
// costs more than a smaller read), so the threads share fused work evenly and fork once.
void run_parts(std::vector<Part>& parts, const float* x, int64_t M, int64_t K, bool int8_x) {
  thread_local std::vector<float> xsum;
  // With int8_x: x rounded per 32 ([0]) and per 256 ([1]) as the parts' formats want, x' as floats,
  // and x' sums.
  // Per thread and kept between calls: a decode step makes ~70 of these calls, and fresh buffers
  // each time cost a measurable share of the small ones.
  // (Workers reach them through this pointer: a thread_local named in the lambda would be their own.)
#if SERVELM_GGUF_AVX2
  using Packed = PackedX;
#else
  struct Packed {};
#endif
  struct Rounded { QuantX q; std::vector<float> xf, xsum; Packed packed; };
  thread_local Rounded kept[2];
  Rounded* rounded = kept;
  bool need_sums = false, need_rounded[2] = {false, false};
  bool unsigned32 = false;  // a part the 8-lane packed tiles take (Q8_0 alone keeps the 8-row tiles)
  int64_t total_bytes = 0;
  for (const Part& p : parts) {
    with_qtype(p.qtype, [&](auto qq) {
      constexpr int Q = decltype(qq)::value;
      if constexpr (!kIsFloat<Q>) {
        need_sums |= Format<Q>::has_min && M <= kPassRows && (!int8_x || !SERVELM_GGUF_AVX2);
        if (int8_x) need_rounded[kXBlock<Q> == 256] = true;
#if SERVELM_GGUF_AVX2
        if constexpr (Format<Q>::elems == 32) unsigned32 |= !Bytes32<Q>::kSigned;
#endif
      }
    });
    total_bytes += p.a.N * p.row_bytes;
  }
  // Enough rows on a CPU with AMX: every quantized part takes the bfloat16 tiles (gguf_amx.h), and
  // nothing reads x rounded to int8.
  bool amx = false;
#if SERVELM_GGUF_AMX
  thread_local PackedBF kept_bf;
  PackedBF* bf = &kept_bf;
  if (int8_x && M >= amx_min_rows() && K % 32 == 0 && (need_rounded[0] || need_rounded[1]) && amx_granted()) {
    amx = true;
    need_rounded[0] = need_rounded[1] = false;
    pack_bf16(x, M, K, *bf);
  }
#endif
  for (int g = 0; g < 2; ++g) {
    if (!need_rounded[g]) continue;
    quantize_x(x, M, K, g ? 256 : 32, rounded[g].q);
#if SERVELM_GGUF_AVX2
    const int lanes = lanes_for_steps();
    const int64_t least = packed_min_rows(g ? 256 : 32, lanes);
    // (Not for a Q8_0 head alone at 8 lanes: nothing would read it.)
    if (least > 0 && M >= least && (lanes == 16 || unsigned32)) pack_x(rounded[g].q, M, K, lanes, rounded[g].packed);
    else rounded[g].packed.groups = 0;
#endif
    // x' as floats only where a float kernel will read it (no AVX2).
    if (!SERVELM_GGUF_AVX2) {
      rounded[g].xf = dequantize_x(rounded[g].q, M, K);
      if (need_sums) x_sums(rounded[g].xf.data(), M, K, rounded[g].xsum);
    }
  }
  if (need_sums && !int8_x) x_sums(x, M, K, xsum);
  for (Part& p : parts) p.a.xsum = xsum.data();
  if (total_bytes == 0) return;
  // The row (over all parts, in order) at which `pos` bytes of weight have been read.
  auto row_at = [&](int64_t pos) {
    int64_t row = 0;
    for (const Part& p : parts) {
      const int64_t bytes = p.a.N * p.row_bytes;
      if (pos < bytes) return row + (pos + p.row_bytes / 2) / p.row_bytes;
      pos -= bytes;
      row += p.a.N;
    }
    return row;
  };
  // Threads take spans as they free up rather than one fixed span each: on a shared 2-core host a
  // thread preempted by the HTTP loop, the tokenizer or a neighbour left the other waiting at the
  // join (OpenMP waits were ~23% of a 32-stream run's samples).
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total_bytes / (int64_t(64) << 10)));
  const int64_t tasks = threads == 1 ? 1 : std::max(threads, std::min(8 * threads, total_bytes / (int64_t(16) << 10)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      int64_t lo = row_at(total_bytes * t / tasks), hi = row_at(total_bytes * (t + 1) / tasks);
      for (const Part& p : parts) {
        int64_t n0 = std::max<int64_t>(lo, 0), n1 = std::min(hi, p.a.N);
        // AMX tiles take 32 weight rows: spans start on a whole tile (each task rounds both ends the
        // same way, so the spans still meet).
        if (amx) {
          n0 = n0 >= p.a.N ? p.a.N : n0 / 32 * 32;
          n1 = n1 >= p.a.N ? p.a.N : n1 / 32 * 32;
        }
        if (n0 < n1) with_qtype(p.qtype, [&](auto qq) {
          constexpr int Q = decltype(qq)::value;
          if constexpr (!kIsFloat<Q>) {
#if SERVELM_GGUF_AMX
            if (amx) {
              amx_rows<Q>(p.a, *bf, n0, n1);
              return;
            }
#endif
            if (int8_x) {
              Rounded& r = rounded[kXBlock<Q> == 256];
              LinearArgs b = p.a;
              b.xsum = r.xsum.data();
              const Packed* px = nullptr;
#if SERVELM_GGUF_AVX2
              if (r.packed.groups > 0) px = &r.packed;
#endif
              int8_linear_rows<Q>(b, r.q, r.xf.data(), px, n0, n1);
              return;
            }
          }
          linear_rows<Q>(p.a, n0, n1);
        });
        lo -= p.a.N;
        hi -= p.a.N;
      }
    }
  });
}

const float* check_x(const at::Tensor& x, const char* fn) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              fn, ": x must be contiguous float32 [M, K] on the CPU");
  return x.data_ptr<float>();
}

// Checks out ([M, N] float32, unit column stride) and bias ([N] float32 or None); the bias pointer.
const float* check_out_bias(const at::Tensor& out, const c10::optional<at::Tensor>& bias, int64_t M, int64_t N,
                            const char* fn) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  (N <= 1 || out.stride(1) == 1) && out.device().is_cpu(),
              fn, ": out must be float32 [", M, ", ", N, "] with unit column stride");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              fn, ": bias must be contiguous float32 [", N, "]");
  return bias->data_ptr<float>();
}

// The parts of a fused projection of x [M, K] (checked), each writing its columns of out in order.
std::vector<Part> make_parts(const float* xp, int64_t M, int64_t K, const std::vector<at::Tensor>& blocks,
                             const std::vector<int64_t>& qtypes, const at::Tensor& out,
                             const c10::optional<at::Tensor>& bias, const char* fn) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(), fn, ": one qtype per part, at least one part");
  int64_t N = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    check_blocks(blocks[i], qtypes[i], K);
    N += blocks[i].size(0);
  }
  const float* b = check_out_bias(out, bias, M, N, fn);
  std::vector<Part> parts;
  int64_t col = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t n = blocks[i].size(0);
    parts.push_back({qtypes[i],
                     {xp, static_cast<const uint8_t*>(blocks[i].const_data_ptr()), out.data_ptr<float>() + col,
                      b ? b + col : nullptr, nullptr, M, n, K, blocks[i].stride(0), out.stride(0)},
                     blocks[i].size(1)});
    col += n;
  }
  return parts;
}

void gguf_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& qtypes,
                       const at::Tensor& out, const c10::optional<at::Tensor>& bias, bool int8_x) {
  const float* xp = check_x(x, "gguf_linear_parts");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<Part> parts = make_parts(xp, M, K, blocks, qtypes, out, bias, "gguf_linear_parts");
  if (M == 0) return;
  run_parts(parts, xp, M, K, int8_x);
}

#if SERVELM_GGUF_AVX2
// e^x for 8 floats to ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial in r, and 2^n
// from the exponent bits. x is clamped to [-87, 88] (e^88 < FLT_MAX; e^-87 is ~1e-38).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// x * rsqrt(mean(x^2) + eps) * w, as F.rms_norm computes it in float32 (its sum here in double).
inline void rms_row(const float* x, const float* w, float eps, float* dst, int64_t K) {
  double ss = 0.0;
  for (int64_t k = 0; k < K; ++k) ss += double(x[k]) * x[k];
  const float r = 1.0f / std::sqrt(float(ss / double(K)) + eps);
  for (int64_t k = 0; k < K; ++k) dst[k] = x[k] * r * w[k];
}

const float* check_vec(const c10::optional<at::Tensor>& w, int64_t K, const char* fn, const char* what) {
  if (!w.has_value() || !w->defined()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == K && w->device().is_cpu(),
              fn, ": ", what, " must be contiguous float32 [", K, "]");
  return w->data_ptr<float>();
}

// The norm before a projection and the projection, in one call for a step of a few rows:
// r = (pre_w ? rms(x) * pre_w : x) + residual (r = x without a residual: the first layer), then
// out = (rms(r) * norm_w) W^T (+ bias). Returns r, the residual stream after the add. pre_w is Gemma
// 3's norm of the attention's output before its residual add.
at::Tensor gguf_norm_linear(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                            const c10::optional<at::Tensor>& pre_w, const at::Tensor& norm_w, double eps,
                            const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& qtypes,
                            const at::Tensor& out, const c10::optional<at::Tensor>& bias, bool int8_x) {
  const char* fn = "gguf_norm_linear";
  const float* xp = check_x(x, fn);
  const int64_t M = x.size(0), K = x.size(1);
  const float* nw = check_vec(norm_w, K, fn, "norm_w");
  const float* pw = check_vec(pre_w, K, fn, "pre_w");
  const bool has_residual = residual.has_value() && residual->defined();
  TORCH_CHECK(has_residual || pw == nullptr, fn, ": pre_w needs a residual");
  at::Tensor r = x;
  if (has_residual) {
    const float* rp = check_x(*residual, fn);
    TORCH_CHECK(residual->size(0) == M && residual->size(1) == K, fn, ": residual must be shaped like x");
    r = at::empty({M, K}, at::kFloat);
    float* sum = r.data_ptr<float>();
    at::parallel_for(0, M, row_grain(K), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        const float* xm = xp + m * K;
        float* sm = sum + m * K;
        if (pw != nullptr) {
          rms_row(xm, pw, float(eps), sm, K);
          xm = sm;
        }
        for (int64_t k = 0; k < K; ++k) sm[k] = xm[k] + rp[m * K + k];
      }
    });
  }
  // The normalised rows: per thread, kept between calls (workers read them through the pointer).
  thread_local std::vector<float> normed;
  normed.resize(size_t(M * K));
  const float* rp = r.data_ptr<float>();
  float* np = normed.data();
  at::parallel_for(0, M, row_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_row(rp + m * K, nw, float(eps), np + m * K, K);
  });
  std::vector<Part> parts = make_parts(normed.data(), M, K, blocks, qtypes, out, bias, fn);
  if (M > 0) run_parts(parts, normed.data(), M, K, int8_x);
  return r;
}

// The projection after the gated activation, in one call for a step of a few rows:
// out = (act(gate) * up) W^T (+ bias) for gate_up [M, 2I] = [gate | up], act GELU (tanh approximation)
// or SiLU as torch computes them; then, with post_w, each out row becomes rms(out) * post_w (Gemma 3's
// norm of the MLP's output).
void gguf_act_mul_linear(const at::Tensor& gate_up, bool gelu, const std::vector<at::Tensor>& blocks,
                         const std::vector<int64_t>& qtypes, const at::Tensor& out,
                         const c10::optional<at::Tensor>& bias, bool int8_x, const c10::optional<at::Tensor>& post_w,
                         double eps) {
  const char* fn = "gguf_act_mul_linear";
  const float* gp = check_x(gate_up, fn);
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, fn, ": gate_up must be [M, 2 * intermediate]");
  thread_local std::vector<float> act;
  act.resize(size_t(M * I));
  float* actp = act.data();
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi)
  at::parallel_for(0, M, row_grain(I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gp + m * 2 * I;
      const float* u = g + I;
      float* a = actp + m * I;
      int64_t i = 0;
#if SERVELM_GGUF_AVX2
      // 0.5 v (1 + tanh(t)) = v / (1 + e^(-2t)) and silu(v) = v / (1 + e^-v), 8 at a time: the scalar
      // tanh took ~35 us a Gemma 3 layer, on one thread.
      for (; i + 8 <= I; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        __m256 z = v;  // silu: v / (1 + e^-v)
        if (gelu) {
          const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
          z = _mm256_mul_ps(_mm256_set1_ps(2.0f * kBeta), _mm256_fmadd_ps(_mm256_set1_ps(kKappa), v3, v));
        }
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
        const __m256 act8 = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(act8, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float v = g[i];
        a[i] = gelu ? 0.5f * v * (1.0f + std::tanh(kBeta * (v + kKappa * v * v * v))) * u[i]
                    : v / (1.0f + std::exp(-v)) * u[i];
      }
    }
  });
  std::vector<Part> parts = make_parts(act.data(), M, I, blocks, qtypes, out, bias, fn);
  const int64_t N = out.size(1);
  const float* pw = check_vec(post_w, N, fn, "post_w");
  if (M == 0) return;
  run_parts(parts, act.data(), M, I, int8_x);
  if (pw == nullptr) return;
  float* o = out.data_ptr<float>();
  const int64_t ld = out.stride(0);
  at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
    std::vector<float> row(N);
    for (int64_t m = m0; m < m1; ++m) {
      rms_row(o + m * ld, pw, float(eps), row.data(), N);
      std::memcpy(o + m * ld, row.data(), sizeof(float) * N);
    }
  });
}

void gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, const at::Tensor& out,
                 const c10::optional<at::Tensor>& bias, bool int8_x) {
  const float* xp = check_x(x, "gguf_linear");
  const int64_t M = x.size(0), K = x.size(1);
  check_blocks(blocks, qtype, K);
  const int64_t N = blocks.size(0);
  const float* b = check_out_bias(out, bias, M, N, "gguf_linear");
  if (M == 0 || N == 0) return;
  std::vector<Part> parts{{qtype,
                           {xp, static_cast<const uint8_t*>(blocks.const_data_ptr()), out.data_ptr<float>(), b,
                            nullptr, M, N, K, blocks.stride(0), out.stride(0)},
                           blocks.size(1)}};
  run_parts(parts, xp, M, K, int8_x);
}

at::Tensor gguf_get_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t qtype, int64_t K) {
  check_blocks(blocks, qtype, K);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "gguf_get_rows: ids must be int64 [T]");
  const at::Tensor idx = ids.contiguous();
  const int64_t T = idx.size(0), N = blocks.size(0), ldw = blocks.stride(0);
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < N, "gguf_get_rows: id ", id[t], " out of range [0, ", N, ")");
  at::Tensor out = at::empty({T, K}, at::kFloat);
  float* o = out.data_ptr<float>();
  const uint8_t* w = static_cast<const uint8_t*>(blocks.const_data_ptr());
  with_qtype(qtype, [&](auto qq) {
    constexpr int Q = decltype(qq)::value;
    using D = RowDecoder<Q>;
    at::parallel_for(0, T, std::max<int64_t>(1, 16384 / K), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t k = 0; k < K; k += D::chunk)
          D::decode(w + id[t] * ldw, k, int(std::min<int64_t>(D::chunk, K - k)), o + t * K + k);
    });
  });
  return out;
}

// x [M, K] rounded as the int8 path rounds it, per block of blk (32 or 256): (d [M, K / blk], q [M, K] int8).
std::tuple<at::Tensor, at::Tensor> gguf_quantize_x(const at::Tensor& x, int64_t blk) {
  const float* xp = check_x(x, "gguf_quantize_x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK((blk == 32 || blk == 256) && K % blk == 0, "gguf_quantize_x: blk must be 32 or 256 and divide K");
  QuantX xq;
  quantize_x(xp, M, K, int(blk), xq);
  at::Tensor d = at::empty({M, K / blk}, at::kFloat), q = at::empty({M, K}, at::kChar);
  std::memcpy(d.data_ptr<float>(), xq.d.data(), xq.d.size() * sizeof(float));
  std::memcpy(q.data_ptr<int8_t>(), xq.q.data(), xq.q.size());
  return {d, q};
}

// x [M, K] as the int8 path sees it, x' = d * q per block of blk, as float32 (the many-row steps'
// input: one pass here instead of several torch ops).
at::Tensor gguf_round_x(const at::Tensor& x, int64_t blk) {
  const float* xp = check_x(x, "gguf_round_x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK((blk == 32 || blk == 256) && K % blk == 0, "gguf_round_x: blk must be 32 or 256 and divide K");
  thread_local QuantX xq;  // kept between calls: a prefill step rounds each layer's inputs
  quantize_x(xp, M, K, int(blk), xq);
  at::Tensor out = at::empty({M, K}, at::kFloat);
  dequantize_x_into(xq, M, K, out.data_ptr<float>());
  return out;
}

// ---- A decode step's whole stack of layers in one call ----------------------------------------
// One stream's decode step is ~30 layers x 5 compiled calls; the Python, pybind and torch around
// each call ran on the engine thread while the other OpenMP thread waited. Here each layer is the
// calls of runtime/gguf/layer.py (StoredStep.forward) in the same order, from C++.

// The paged attention extension's rope_write_decode, reached by its address (the two extensions are
// built apart); kRopeWriteDecodeAbi names this signature and must match that extension's.
using RopeWriteDecode = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       int64_t, double, int64_t, const c10::optional<at::Tensor>&,
                                       const c10::optional<at::Tensor>&, double);
constexpr int64_t kRopeWriteDecodeAbi = 1;

struct StackProjection {
  std::vector<at::Tensor> blocks;
  std::vector<int64_t> qtypes;
  int64_t out_features;
  c10::optional<at::Tensor> bias;
  bool int8_x;
};

struct StackLayer {
  StackProjection qkv, o, gate_up, down;
  at::Tensor input_norm, norm;
  c10::optional<at::Tensor> pre, post;  // Gemma 3's sandwich norms
  double eps;
  bool gelu;
  at::Tensor k_cache, v_cache;
  int64_t num_heads;
  double scale;
  int64_t window;  // sliding window, 0 for none
  c10::optional<at::Tensor> q_norm, k_norm;
  double qk_eps;
  bool local_rope;  // Gemma 3's sliding layers: the local RoPE rows
};

// Every layer over a decode-only step of x [B, hidden] (float32); returns [the last layer's MLP
// output, the residual stream before it], as the layers' forwards in turn would.
std::vector<at::Tensor> gguf_decode_stack(const at::Tensor& x_in, const std::vector<std::shared_ptr<StackLayer>>& layers,
                                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cos_local,
                                          const at::Tensor& sin_local, const at::Tensor& slot_mapping,
                                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                          int64_t max_seq_len, int64_t attention, int64_t attention_abi) {
  TORCH_CHECK(attention != 0 && attention_abi == kRopeWriteDecodeAbi,
              "gguf_decode_stack: the attention function's ABI ", attention_abi, " is not ", kRopeWriteDecodeAbi);
  TORCH_CHECK(!layers.empty(), "gguf_decode_stack: no layers");
  const auto attend = reinterpret_cast<RopeWriteDecode>(attention);
  at::Tensor x = x_in.contiguous();
  c10::optional<at::Tensor> residual;
  const int64_t B = x.size(0);
  for (const auto& layer : layers) {
    const StackLayer& L = *layer;
    at::Tensor qkv = at::empty({B, L.qkv.out_features}, x.options());
    at::Tensor r = gguf_norm_linear(x, residual, c10::nullopt, L.input_norm, L.eps, L.qkv.blocks, L.qkv.qtypes, qkv,
                                    L.qkv.bias, L.qkv.int8_x);
    const int64_t window = L.window > 0 && max_seq_len > L.window ? L.window : 0;
    const at::Tensor a = attend(qkv, L.local_rope ? cos_local : cos, L.local_rope ? sin_local : sin, L.k_cache,
                                L.v_cache, slot_mapping, block_tables, seq_lens, L.num_heads, L.scale, window,
                                L.q_norm, L.k_norm, L.qk_eps)
                             .reshape({B, -1})
                             .contiguous();
    at::Tensor o = at::empty({B, L.o.out_features}, x.options());
    gguf_linear_parts(a, L.o.blocks, L.o.qtypes, o, L.o.bias, L.o.int8_x);
    at::Tensor gate_up = at::empty({B, L.gate_up.out_features}, x.options());
    r = gguf_norm_linear(o, r, L.pre, L.norm, L.eps, L.gate_up.blocks, L.gate_up.qtypes, gate_up, L.gate_up.bias,
                         L.gate_up.int8_x);
    at::Tensor out = at::empty({B, L.down.out_features}, x.options());
    gguf_act_mul_linear(gate_up, L.gelu, L.down.blocks, L.down.qtypes, out, L.down.bias, L.down.int8_x, L.post, L.eps);
    x = out;
    residual = r;
  }
  return {x, *residual};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "servelm projections and embedding lookups from GGUF quantized blocks";
  m.def("gguf_linear", &gguf_linear,
        "out[M, N] = x[M, K] float32 @ W^T (+ bias), W the GGUF blocks [N, row_bytes] of qtype",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("out"), py::arg("bias") = py::none(),
        py::arg("int8_x") = false, py::call_guard<py::gil_scoped_release>());
  m.def("gguf_linear_parts", &gguf_linear_parts,
        "out[M, sum N_i] = x @ [W_0; W_1; ...]^T (+ bias): parts of a fused projection, concatenated along N",
        py::arg("x"), py::arg("blocks"), py::arg("qtypes"), py::arg("out"), py::arg("bias") = py::none(),
        py::arg("int8_x") = false, py::call_guard<py::gil_scoped_release>());
  m.def("gguf_norm_linear", &gguf_norm_linear,
        "r = (pre_w ? rms(x) pre_w : x) + residual; out = (rms(r) norm_w) @ W^T (+ bias); returns r",
        py::arg("x"), py::arg("residual"), py::arg("pre_w"), py::arg("norm_w"), py::arg("eps"), py::arg("blocks"),
        py::arg("qtypes"), py::arg("out"), py::arg("bias") = py::none(), py::arg("int8_x") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_act_mul_linear", &gguf_act_mul_linear,
        "out = (act(gate) * up) @ W^T (+ bias), act GELU-tanh or SiLU; then rms(out) post_w with post_w",
        py::arg("gate_up"), py::arg("gelu"), py::arg("blocks"), py::arg("qtypes"), py::arg("out"),
        py::arg("bias") = py::none(), py::arg("int8_x") = false, py::arg("post_w") = py::none(),
        py::arg("eps") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("gguf_round_x", &gguf_round_x, "x rounded as int8_x rounds it, back as float32 [M, K]",
        py::arg("x"), py::arg("blk"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_quantize_x", &gguf_quantize_x, "x rounded to int8 per block of blk as int8_x rounds it: (d, q)",
        py::arg("x"), py::arg("blk"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_get_rows", &gguf_get_rows, "rows ids of the GGUF weight [N, K] as float32 [T, K]",
        py::arg("blocks"), py::arg("ids"), py::arg("qtype"), py::arg("K"), py::call_guard<py::gil_scoped_release>());
  py::class_<StackProjection, std::shared_ptr<StackProjection>>(m, "StackProjection")
      .def(py::init([](std::vector<at::Tensor> blocks, std::vector<int64_t> qtypes, int64_t out_features,
                       c10::optional<at::Tensor> bias, bool int8_x) {
             return std::make_shared<StackProjection>(
                 StackProjection{std::move(blocks), std::move(qtypes), out_features, std::move(bias), int8_x});
           }),
           py::arg("blocks"), py::arg("qtypes"), py::arg("out_features"), py::arg("bias"), py::arg("int8_x"));
  py::class_<StackLayer, std::shared_ptr<StackLayer>>(m, "StackLayer")
      .def(py::init([](const StackProjection& qkv, const StackProjection& o, const StackProjection& gate_up,
                       const StackProjection& down, at::Tensor input_norm, at::Tensor norm,
                       c10::optional<at::Tensor> pre, c10::optional<at::Tensor> post, double eps, bool gelu,
                       at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads, double scale, int64_t window,
                       c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double qk_eps,
                       bool local_rope) {
             return std::make_shared<StackLayer>(StackLayer{qkv, o, gate_up, down, std::move(input_norm),
                                                            std::move(norm), std::move(pre), std::move(post), eps, gelu,
                                                            std::move(k_cache), std::move(v_cache), num_heads, scale,
                                                            window, std::move(q_norm), std::move(k_norm), qk_eps,
                                                            local_rope});
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"), py::arg("norm"),
           py::arg("pre"), py::arg("post"), py::arg("eps"), py::arg("gelu"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("num_heads"), py::arg("scale"), py::arg("window"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qk_eps"), py::arg("local_rope"));
  m.def("gguf_decode_stack", &gguf_decode_stack,
        "every StackLayer over a decode-only step x [B, hidden]: [the last MLP output, the residual before it]",
        py::arg("x"), py::arg("layers"), py::arg("cos"), py::arg("sin"), py::arg("cos_local"), py::arg("sin_local"),
        py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("max_seq_len"),
        py::arg("attention"), py::arg("attention_abi"), py::call_guard<py::gil_scoped_release>());
  m.def("compiled_isa", &compiled_isa);
  m.def("set_amx_min_rows", [](int64_t rows) { return amx_rows_override.exchange(rows); },
        "fewest rows a llama.cpp-arithmetic step needs for the AMX bfloat16 tiles (-1: the default); the "
        "previous value");
  m.def("amx_available", []() {
#if SERVELM_GGUF_AMX
    return amx_granted();
#else
    return false;
#endif
  }, "whether this build has the AMX tiles and the kernel granted them");
  m.attr("vnni") = py::bool_(SERVELM_GGUF_VNNI != 0);
  m.def("set_packed_min_rows", [](int64_t rows) { return packed_rows_override.exchange(rows); },
        "the fewest rows a step needs for the packed tiles, -1 for each format's default (returns the "
        "previous setting)", py::arg("rows"));
  m.def("set_packed_lanes", [](int lanes) {
          TORCH_CHECK(lanes == 0 || lanes == 8 || (lanes == 16 && SERVELM_GGUF_VNNI), "lanes: 0, 8 or (with VNNI) 16");
          return packed_lanes.exchange(lanes);
        },
        "rows a vector of the packed tiles: 8 (AVX2), 16 (AVX-512 VNNI) or 0, the widest built (returns the "
        "previous setting)", py::arg("lanes"));
  m.attr("vectorized") = py::bool_(SERVELM_GGUF_AVX2 != 0);
  m.attr("group_rows") = kGroup;
  m.attr("pass_rows") = kPassRows;
  // With int8 activations (and AVX2) one call takes any number of rows in one pass over the weight.
  m.attr("int8_one_pass") = py::bool_(SERVELM_GGUF_AVX2 != 0);
}
