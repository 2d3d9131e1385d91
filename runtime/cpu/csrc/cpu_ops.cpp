// Small CPU ops of the decode step, float32, AVX-512:
//   * linear_few_row: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows (M <= 4); float32, or
//     bfloat16 with float32 accumulation where the CPU has AVX512-BF16;
//   * linear_few_row_int8: the same with int8 weights and a float32 scale per output row
//     (weight-only quantization): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias), float32 x,
//     up to 8 rows;
//   * linear_few_row_int4 / linear_few_row_int8_grouped: the same over weights quantized in groups of
//     32 along K (int4 with an fp16 scale and minimum a group, int8 with an fp16 scale a group);
//   * add_rms_norm / silu_mul: the residual add and the norm after it, and SiLU x up, one call each;
//   * rms_norm: y = x * rsqrt(mean(x^2) + eps) * w over the last dimension (float32, or bfloat16 with
//     Hugging Face's roundings);
//   * apply_token_bitmask: structured outputs' mask, -inf for every token whose bit is clear;
//   * lora_apply: LoRA adapters' updates of a few rows, each row with its own adapter (or none).
//
// linear_few_row is the decode-latency matmul.
// With one to four rows a projection is a pass over the weight: it is memory-bound, and what matters
// is streaming W at the machine's read bandwidth. BLAS libraries tune for larger M; here MKL's sgemm
// reads W at ~12 GB/s and oneDNN at ~20, while this loop reaches ~30 GB/s of the ~32 a plain AVX-512
// read loop gets on 2 cores (scripts/bench_linear.py).
//
// Work split: blocks of 8 output rows of W, contiguous ranges of blocks per thread (at::parallel_for,
// so torch.set_num_threads applies). Per block, 8 x M accumulators of 16 lanes walk K together: the 8
// weight rows are read once, sequentially, and each x row stays in L1. One horizontal sum per output.

// Narrow headers on purpose: <torch/extension.h> doubles the one-off compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SERVELM_HAVE_AVX512 1
#else
#define SERVELM_HAVE_AVX512 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SERVELM_HAVE_AVX512_BF16 1
#else
#define SERVELM_HAVE_AVX512_BF16 0
#endif

namespace {

constexpr int kRows = 8;   // weight rows per block
constexpr int kMaxM = 4;   // x rows handled in one pass over W
constexpr int kMaxMInt8 = 8;  // the same for int8 weights: converting a weight is dearer, more rows share it
constexpr int kGroup = 32;    // weights per group of the grouped int4 / int8 layouts

#if SERVELM_HAVE_AVX512
template <int M>
void block_dot(const float* x, const float* w, float* y, const float* bias, int64_t n0, int nn, int64_t N,
               int64_t K) {
  __m512 acc[kRows][M];
  for (int r = 0; r < kRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t k_main = K - K % 16;
  if (nn == kRows) {
    for (int64_t k = 0; k < k_main; k += 16) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < kRows; ++r) {
        const __m512 wv = _mm512_loadu_ps(w + (n0 + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
  } else {
    for (int64_t k = 0; k < k_main; k += 16) {
      for (int r = 0; r < nn; ++r) {
        const __m512 wv = _mm512_loadu_ps(w + (n0 + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[r][m]);
      }
    }
  }
  if (k_main < K) {  // K not a multiple of 16: one masked step
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k_main)) - 1u);
    for (int r = 0; r < nn; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + (n0 + r) * K + k_main);
      for (int m = 0; m < M; ++m)
        acc[r][m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k_main), acc[r][m]);
    }
  }
  for (int r = 0; r < nn; ++r) {
    const float b = bias ? bias[n0 + r] : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]) + b;
  }
}

template <int M>
void run(const float* x, const float* w, float* y, const float* bias, int64_t N, int64_t K) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  // Grain: at least 16 blocks (128 rows, >= 36 KB of weights at K=576) per thread, so a small
  // projection is not split into pieces whose fork/join costs more than their reads.
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRows;
      const int nn = static_cast<int>(std::min<int64_t>(kRows, N - n0));
      block_dot<M>(x, w, y, bias, n0, nn, N, K);
    }
  });
}
#endif

#if SERVELM_HAVE_AVX512
// int8 weights, float32 inputs and accumulation: weights sign-extended to int32 and converted to
// float32 (exact), multiplied into float32 accumulators as in the float32 loop; the row's scale is
// applied once to the finished sum. A quarter of the float32 loop's bytes. The main loop loads 64
// weights of a row at once (one 512-bit load, four conversions); on this project's AMD EPYC, 16-byte
// loads, shift-based conversions of pre-permuted weights and split accumulators all timed the same.
inline __m512 i8x16_to_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

// R weight rows a block: 8 up to 4 x rows, then 2 (R x M accumulators must fit the 32 registers).
template <int R, int M>
void block_dot_i8(const float* x, const int8_t* w, const float* scale, float* y, const float* bias, int64_t n0, int nn,
                  int64_t N, int64_t K) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t k64 = K - K % 64;
  for (int64_t k = 0; k < k64; k += 64) {
    __m512 xv[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) xv[m][j] = _mm512_loadu_ps(x + m * K + k + 16 * j);
    for (int r = 0; r < nn; ++r) {
      // A row of int8 weights is only a few cache lines (576 bytes at K = 576): too short a stream for
      // the hardware prefetcher, so fetch the next block's rows at the same offset meanwhile (~2-5%).
      if (n0 + R + r < N) _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + R + r) * K + k), _MM_HINT_T0);
      const __m512i q = _mm512_loadu_si512(w + (n0 + r) * K + k);
      const __m512 w0 = i8x16_to_ps(_mm512_castsi512_si128(q));
      const __m512 w1 = i8x16_to_ps(_mm512_extracti32x4_epi32(q, 1));
      const __m512 w2 = i8x16_to_ps(_mm512_extracti32x4_epi32(q, 2));
      const __m512 w3 = i8x16_to_ps(_mm512_extracti32x4_epi32(q, 3));
      for (int m = 0; m < M; ++m) {
        acc[r][m] = _mm512_fmadd_ps(w0, xv[m][0], acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(w1, xv[m][1], acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(w2, xv[m][2], acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(w3, xv[m][3], acc[r][m]);
      }
    }
  }
  const int64_t k16 = K - K % 16;
  for (int64_t k = k64; k < k16; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < nn; ++r) {
      const __m512 wv = i8x16_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + r) * K + k)));
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  if (k16 < K) {  // K not a multiple of 16: one masked step
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k16)) - 1u);
    for (int r = 0; r < nn; ++r) {
      alignas(16) int8_t tail[16] = {0};
      std::copy(w + (n0 + r) * K + k16, w + (n0 + r) * K + K, tail);
      const __m512 wv = i8x16_to_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
      for (int m = 0; m < M; ++m)
        acc[r][m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k16), acc[r][m]);
    }
  }
  for (int r = 0; r < nn; ++r) {
    const float s = scale[n0 + r];
    const float b = bias ? bias[n0 + r] : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]) * s + b;
  }
}

template <int M>
void run_i8(const float* x, const int8_t* w, const float* scale, float* y, const float* bias, int64_t N, int64_t K) {
  constexpr int R = M <= 4 ? kRows : 2;
  const int64_t blocks = (N + R - 1) / R;
  // A quarter of the float32 bytes per row: four times the float32 grain (in rows) keeps pieces as large.
  at::parallel_for(0, blocks, 64 * kRows / R, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R;
      block_dot_i8<R, M>(x, w, scale, y, bias, n0, static_cast<int>(std::min<int64_t>(R, N - n0)), N, K);
    }
  });
}
#endif

#if SERVELM_HAVE_AVX512
// Weights in groups of 32 along K, each group with an fp16 scale d (and, for int4, an fp16 minimum m):
//   int4:  w[n, k] = d[n, g] * q[n, k] + m[n, g], q in 0..15, two per byte: byte j of a group's 16
//          holds q[j] (low nibble) and q[j + 16] (high nibble);
//   int8g: w[n, k] = d[n, g] * q[n, k], q in -127..127.
// (llama.cpp's Q4_1 and Q8_0 layouts, which the default model ships in, are exactly these values.)
// With one x row the kernel forms p = sum_k q[k] * x[k] per group in float32 and adds d * p; for int4
// the minimum term sum_g m[g] * sum_{k in g} x[k] uses the x group sums computed once per call. With
// more, it multiplies by the weights themselves (int4: looked up, see kUseLut). float32 throughout: the
// result equals x @ dequantized(W)^T up to summation order.
constexpr int kGroupChunk = 64;  // scales converted to float32 for this many groups at a time

void halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))));
  for (; j < n; ++j) dst[j] = _cvtsh_ss(src[j]);
}

struct Int4Groups {
  static constexpr int64_t kGroupBytes = kGroup / 2;
  static constexpr bool kHasMin = true;
  static constexpr bool kLut = true;  // look the weights up (2+ x rows), see block_dot_g32
  // The codes as indices (vpermps reads the low 4 bits of each lane: the low nibble as is).
  static inline void indices(const uint8_t* p, __m512i& i0, __m512i& i1) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    i0 = b;
    i1 = _mm512_srli_epi32(b, 4);
  }
  static inline void unpack(const uint8_t* p, __m512& w0, __m512& w1) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
};

struct Int8Groups {
  static constexpr int64_t kGroupBytes = kGroup;
  static constexpr bool kHasMin = false;
  static constexpr bool kLut = false;
  static inline void indices(const uint8_t*, __m512i&, __m512i&) {}
  static inline void unpack(const uint8_t* p, __m512& w0, __m512& w1) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
  }
};

// Int4 with 2+ x rows looks each code's weight up in a 16-entry table built per group (d * q + m for
// q = 0..15): two permutes replace two conversions, the scale multiplies and the minimum term; at 4 to
// 8 rows that made the projections 1.1-1.4x faster. One x row keeps the conversions and scales the
// group's sum instead (fewer operations per weight there: 1.15x faster than the table).
template <typename Kind, int M>
constexpr bool kUseLut = Kind::kLut && M >= 2;

// R weight rows (n0 ..) x M rows of x. xsum: [M, G rounded up to 16] group sums of x (int4, one row).
template <typename Kind, int R, int M>
void block_dot_g32(const float* x, const float* xsum, const uint8_t* w, const uint16_t* d16, const uint16_t* m16,
                   float* y, const float* bias, int64_t n0, int64_t N, int64_t K) {
  constexpr bool lut = kUseLut<Kind, M>;
  const int64_t G = K / kGroup;
  const int64_t row_bytes = G * Kind::kGroupBytes;
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  alignas(64) float dsc[R][kGroupChunk];
  alignas(64) float msc[lut ? R : 1][kGroupChunk];
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t gc = 0; gc < G; gc += kGroupChunk) {
    const int64_t gn = std::min<int64_t>(kGroupChunk, G - gc);
    for (int r = 0; r < R; ++r) halves_to_floats(d16 + (n0 + r) * G + gc, dsc[r], gn);
    if constexpr (lut)
      for (int r = 0; r < R; ++r) halves_to_floats(m16 + (n0 + r) * G + gc, msc[r], gn);
    for (int64_t j = 0; j < gn; ++j) {
      const int64_t g = gc + j;
      __m512 x0[M], x1[M];
      for (int m = 0; m < M; ++m) {
        x0[m] = _mm512_loadu_ps(x + m * K + g * kGroup);
        x1[m] = _mm512_loadu_ps(x + m * K + g * kGroup + 16);
      }
      // Short rows (288 or 576 bytes at K = 576) are too short a stream for the hardware prefetcher: fetch
      // the next block's rows at the same offset, a cache line at a time (as the int8 kernel does).
      if ((g * Kind::kGroupBytes) % 64 == 0)
        for (int r = 0; r < R; ++r)
          if (n0 + R + r < N) _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + R + r) * row_bytes + g * Kind::kGroupBytes), _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        if constexpr (lut) {
          // The group's 16 possible weights d * q + m (as the dequantized tensor computes them), then
          // each code looks its weight up: no conversion, no scaling, no minimum term.
          const __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(dsc[r][j])), _mm512_set1_ps(msc[r][j]));
          __m512i i0, i1;
          Kind::indices(w + (n0 + r) * row_bytes + g * Kind::kGroupBytes, i0, i1);
          const __m512 w0 = _mm512_permutexvar_ps(i0, table);
          const __m512 w1 = _mm512_permutexvar_ps(i1, table);
          for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(w1, x1[m], _mm512_fmadd_ps(w0, x0[m], acc[r][m]));
        } else {
          __m512 w0, w1;
          Kind::unpack(w + (n0 + r) * row_bytes + g * Kind::kGroupBytes, w0, w1);
          const __m512 d = _mm512_set1_ps(dsc[r][j]);
          if constexpr (M <= 2) {
            // Few x rows: scale each row's group sum (3 operations a row and group).
            for (int m = 0; m < M; ++m) {
              const __m512 p = _mm512_fmadd_ps(w1, x1[m], _mm512_mul_ps(w0, x0[m]));
              acc[r][m] = _mm512_fmadd_ps(d, p, acc[r][m]);
            }
          } else {
            // More x rows (int8 groups; int4 looks its weights up): scale the weights once (2
            // operations), then 2 a row.
            w0 = _mm512_mul_ps(w0, d);
            w1 = _mm512_mul_ps(w1, d);
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(w1, x1[m], _mm512_fmadd_ps(w0, x0[m], acc[r][m]));
          }
        }
      }
    }
  }
  if constexpr (Kind::kHasMin && !lut) {
    // sum_g m[g] * xsum[g], 16 groups a step into the same accumulators (xsum is zero-padded to a
    // multiple of 16 groups; the minimums' tail is loaded masked, so nothing past the tensor is read).
    const int64_t G16 = (G + 15) / 16 * 16;
    for (int64_t g = 0; g < G16; g += 16) {
      for (int r = 0; r < R; ++r) {
        const uint16_t* mp = m16 + (n0 + r) * G + g;
        __m256i mh;
        if (g + 16 <= G) {
          mh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mp));
        } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
          mh = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << (G - g)) - 1u), mp);
#else
          alignas(32) uint16_t tail[16] = {0};
          std::copy(mp, mp + (G - g), tail);
          mh = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
#endif
        }
        const __m512 mv = _mm512_cvtph_ps(mh);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xsum + m * G16 + g), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = bias ? bias[n0 + r] : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]) + b;
  }
}

template <typename Kind, int M>
void run_g32(const float* x, const uint8_t* w, const uint16_t* d16, const uint16_t* m16, float* y, const float* bias,
             int64_t N, int64_t K) {
  // R x M accumulators plus 2M x vectors must fit the 32 registers.
  constexpr int R = M <= 2 ? 8 : (M <= 4 ? 4 : 2);
  const int64_t G = K / kGroup;
  std::vector<float> xsum;
  if constexpr (Kind::kHasMin && !kUseLut<Kind, M>) {
    const int64_t G16 = (G + 15) / 16 * 16;  // padded with zeros: the kernel reads 16 groups at a time
    xsum.assign(M * G16, 0.0f);
    for (int m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + m * K + g * kGroup;
        xsum[m * G16 + g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16)));
      }
  }
  const float* xs = xsum.data();
  const int64_t blocks = (N + R - 1) / R;
  // ~512 weight rows a piece at least, as the int8 kernel: smaller pieces cost more to fork than they read.
  at::parallel_for(0, blocks, std::max<int64_t>(1, 512 / R), [&](int64_t begin, int64_t end) {
    for (int64_t bl = begin; bl < end; ++bl) {
      const int64_t n0 = bl * R;
      if (n0 + R <= N) {
        block_dot_g32<Kind, R, M>(x, xs, w, d16, m16, y, bias, n0, N, K);
      } else {
        for (int64_t n = n0; n < N; ++n) block_dot_g32<Kind, 1, M>(x, xs, w, d16, m16, y, bias, n, N, K);
      }
    }
  });
}
#endif

#if SERVELM_HAVE_AVX512_BF16
// bfloat16 weights and inputs, float32 accumulation: vdpbf16ps multiplies 32 bf16 pairs per step.
template <int M>
void block_dot_bf16(const uint16_t* x, const uint16_t* w, c10::BFloat16* y, const c10::BFloat16* bias, int64_t n0,
                    int nn, int64_t N, int64_t K) {
  __m512 acc[kRows][M];
  for (int r = 0; r < kRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t k_main = K - K % 32;
  for (int64_t k = 0; k < k_main; k += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < nn; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if (k_main < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k_main)) - 1ull);
    for (int r = 0; r < nn; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + r) * K + k_main);
      for (int m = 0; m < M; ++m)
        acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k_main));
    }
  }
  for (int r = 0; r < nn; ++r) {
    const float b = bias ? static_cast<float>(bias[n0 + r]) : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + b);
  }
}

template <int M>
void run_bf16(const uint16_t* x, const uint16_t* w, c10::BFloat16* y, const c10::BFloat16* bias, int64_t N, int64_t K) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRows;
      block_dot_bf16<M>(x, w, y, bias, n0, static_cast<int>(std::min<int64_t>(kRows, N - n0)), N, K);
    }
  });
}
#endif

// What both few-row entry points check of x [M, K] and weight [N, K].
void check_few_row(const at::Tensor& x, const at::Tensor& weight, int64_t max_rows = kMaxM) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous x and weight expected");
  TORCH_CHECK(weight.size(1) == x.size(1), "x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_rows, "1..", max_rows, " rows expected, got ", x.size(0));
}

// The optional float32 bias [N] as a pointer (nullptr when absent).
const float* float_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias [N] float32");
  return bias->data_ptr<float>();
}

// f(std::integral_constant<int, M>{}) for the row count M in 1..kMaxM (1..kMaxMInt8 with ``upto8``):
// the kernels are templates on M.
template <bool upto8 = false, typename F>
void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default:
      if constexpr (upto8) {
        switch (M) {
          case 5: f(std::integral_constant<int, 5>{}); break;
          case 6: f(std::integral_constant<int, 6>{}); break;
          case 7: f(std::integral_constant<int, 7>{}); break;
          default: f(std::integral_constant<int, 8>{}); break;
        }
      } else {
        TORCH_CHECK(false, "1..", kMaxM, " rows expected, got ", M);
      }
  }
}

at::Tensor linear_few_row_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512_BF16, "linear_few_row was built without AVX512-BF16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "bias [N] bfloat16");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if SERVELM_HAVE_AVX512_BF16
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  auto* yp = y.data_ptr<c10::BFloat16>();
  with_rows(M, [&](auto rows) { run_bf16<decltype(rows)::value>(xp, wp, yp, b, N, K); });
#endif
  return y;
}

at::Tensor linear_few_row(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "linear_few_row was built without AVX-512");
  check_few_row(x, weight);
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) return linear_few_row_bf16(x, weight, bias);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 or bfloat16 x and weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* b = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
#if SERVELM_HAVE_AVX512
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  with_rows(M, [&](auto rows) { run<decltype(rows)::value>(xp, wp, yp, b, N, K); });
#endif
  return y;
}

at::Tensor linear_few_row_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "linear_few_row_int8 was built without AVX-512");
  check_few_row(x, weight, kMaxMInt8);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "float32 x, int8 weight, float32 scale expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == N, "scale must be contiguous with ", N, " entries");
  const float* b = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
#if SERVELM_HAVE_AVX512
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  with_rows<true>(M, [&](auto rows) { run_i8<decltype(rows)::value>(xp, wp, sp, yp, b, N, K); });
#endif
  return y;
}

// The group-quantized weights' shared checks: x [M <= 8, K] float32 with K a multiple of 32, and
// [N, K / 32] fp16 scales (and minimums).
void check_groups(const at::Tensor& x, const at::Tensor& weight, int64_t row_bytes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x [M, K] float32 contiguous expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxMInt8, "1..", kMaxMInt8, " rows expected, got ", x.size(0));
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of ", kGroup, ", got ", K);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == row_bytes, "weight [N, ", row_bytes,
              "] contiguous expected");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == weight.size(0) && scales.size(1) == K / kGroup,
              "scales [N, K / 32] float16 contiguous expected");
}

const uint16_t* halves(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

at::Tensor linear_few_row_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "linear_few_row_int4 was built without AVX-512");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "int4 weights come packed two to a uint8");
  check_groups(x, packed, x.size(1) / 2, scales);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous(),
              "mins must be like scales");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  const float* b = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
#if SERVELM_HAVE_AVX512
  with_rows<true>(M, [&](auto rows) {
    run_g32<Int4Groups, decltype(rows)::value>(x.data_ptr<float>(), packed.data_ptr<uint8_t>(), halves(scales),
                                               halves(mins), y.data_ptr<float>(), b, N, K);
  });
#endif
  return y;
}

at::Tensor linear_few_row_int8_grouped(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "linear_few_row_int8_grouped was built without AVX-512");
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8 weights expected");
  check_groups(x, q, x.size(1), scales);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const float* b = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
#if SERVELM_HAVE_AVX512
  with_rows<true>(M, [&](auto rows) {
    run_g32<Int8Groups, decltype(rows)::value>(x.data_ptr<float>(), reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()),
                                               halves(scales), nullptr, y.data_ptr<float>(), b, N, K);
  });
#endif
  return y;
}

#if SERVELM_HAVE_AVX512
void rms_norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  const int64_t h_main = H - H % 16;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < h_main; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (H - h_main)) - 1u);
  if (h_main < H) {
    const __m512 v = _mm512_maskz_loadu_ps(tail, x + h_main);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  // Same arithmetic as Hugging Face's LlamaRMSNorm in float32: (x * rsqrt(mean(x^2) + eps)) * w.
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < h_main; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), s), _mm512_loadu_ps(w + i)));
  if (h_main < H)
    _mm512_mask_storeu_ps(y + h_main, tail, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + h_main), s),
                                                            _mm512_maskz_loadu_ps(tail, w + h_main)));
}
#else
// Without AVX-512 (an AVX2 host): plain loops, which -O3 -march=native vectorises except the sum.
void rms_norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = (x[i] * inv) * w[i];
}
#endif

// bfloat16 as Hugging Face's LlamaRMSNorm computes it: normalise in float32, round to bfloat16, then
// multiply by the bfloat16 weight (one more rounding).
void rms_norm_row_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t H, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < H; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const c10::BFloat16 normed(static_cast<float>(x[i]) * inv);
    y[i] = c10::BFloat16(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && weight.is_contiguous(), "contiguous x and weight expected");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "weight must be [", H, "]");
  const int64_t rows = H ? x.numel() / H : 0;
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) {
    const auto* xp = x.data_ptr<c10::BFloat16>();
    const auto* wp = weight.data_ptr<c10::BFloat16>();
    auto* yp = y.data_ptr<c10::BFloat16>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row_bf16(xp + r * H, wp, yp + r * H, H, e);
    });
    return y;
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 or bfloat16 x and weight");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // A decode step has a handful of rows: threads would cost more than they save below ~64.
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * H, wp, yp + r * H, H, e);
  });
  return y;
}

// The residual add before a norm and the norm in one call (float32): residual += x in place, then
// (rms_norm(residual) * weight, residual). Without a residual: (rms_norm(x) * weight, None). The same
// arithmetic as ``x + residual`` followed by ``rms_norm``; a decode step makes 61 such calls, and one
// call instead of two saves the per-call cost of the second.
std::tuple<at::Tensor, c10::optional<at::Tensor>> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                               const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "add_rms_norm takes float32");
  if (!residual.has_value() || !residual->defined()) return {rms_norm(x, weight, eps), c10::nullopt};
  TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == at::kFloat,
              "residual must be a contiguous float32 tensor shaped like x");
  at::Tensor r = *residual;
  r.add_(x);
  return {rms_norm(r, weight, eps), r};
}

// silu(gate) * up of a fused [T, 2I] gate/up projection -> [T, I], with ATen's own kernels (so the
// same values as F.silu then mul_), in one call from Python instead of four.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [T, 2I] expected");
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor act = at::silu(gate_up.narrow(1, 0, inter));
  return act.mul_(gate_up.narrow(1, inter, inter));
}

// logits[rows[i], t] = -inf wherever bit t % 32 of bitmask[i, t / 32] is clear (tokens past the
// mask's 32 * W included). A word decides 32 tokens at once: all set (inside a JSON string, say) costs
// one compare, none set one run of stores. torch's masked_fill over the unpacked mask took ~3 ms for
// 32 rows of 49,152 here; this writes only the masked entries.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be a contiguous float32 [R, V] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64 [n]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0),
              "bitmask must be a contiguous int32 [n, W] tensor, one row per entry of rows");
  const int64_t R = logits.size(0), V = logits.size(1), W = bitmask.size(1), n = rows.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(0 <= rp[i] && rp[i] < R, "row ", rp[i], " outside the logits' ", R);
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * V;
      const uint32_t* words = bp + i * W;
      const int64_t covered = std::min<int64_t>(W, (V + 31) / 32);
      for (int64_t w = 0; w < covered; ++w) {
        const uint32_t bits = words[w];
        if (bits == 0xFFFFFFFFu) continue;
        float* out = row + w * 32;
        const int k_end = static_cast<int>(std::min<int64_t>(32, V - w * 32));
        if (bits == 0) {
          std::fill(out, out + k_end, ninf);
          continue;
        }
        for (int k = 0; k < k_end; ++k)
          if (!((bits >> k) & 1u)) out[k] = ninf;
      }
      if (32 * W < V) std::fill(row + 32 * W, row + V, ninf);
    }
  });
}

#if SERVELM_HAVE_AVX512
// h[m][k] = a[k, :] . x[m, :] for k in [k0, k1): the A rows of an adapter against M input rows,
// each A row read once for all of them.
template <int M>
void lora_down(const float* const* xs, const float* a, float* h, int64_t R, int64_t k0, int64_t k1, int64_t K) {
  const int64_t k_main = K - K % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - k_main)) - 1u);
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = a + k * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k_main; i += 16) {
      const __m512 w = _mm512_loadu_ps(row + i);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs[m] + i), acc[m]);
    }
    if (k_main < K) {
      const __m512 w = _mm512_maskz_loadu_ps(tail, row + k_main);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(tail, xs[m] + k_main), acc[m]);
    }
    for (int m = 0; m < M; ++m) h[m * R + k] = _mm512_reduce_add_ps(acc[m]);
  }
}

// ys[m][o0 + o] += sum_k hs[m][k] * bt[k, o] for o in [c0 * 16, c1 * 16) of the shard's n outputs:
// B^T is [r, n], so each of its rows is read once, 16 outputs at a time, for all M rows.
template <int M>
void lora_up(float* const* ys, const float* const* hs, const float* bt, int64_t r, int64_t n, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t o = c * 16;
    const __mmask16 mask = o + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - o)) - 1u);
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_maskz_loadu_ps(mask, ys[m] + o);
    for (int64_t k = 0; k < r; ++k) {
      const __m512 b = _mm512_maskz_loadu_ps(mask, bt + k * n + o);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(hs[m][k]), b, acc[m]);
    }
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(ys[m] + o, mask, acc[m]);
  }
}
#endif

// y[t] += B_s (A_s x[t]) for every row t whose adapter s = row_adapter[t] is not -1 (float32, in place).
// Adapter s: a[s] [R_s, K], the A rows of each shard in shard order; bt[s], flat: each shard's B^T
// [r_j, n_j] after the previous shard's (scaling folded in); shards[s] int64 [J, 3]: (first output,
// outputs n_j, rank r_j) per shard, in the same order. An empty a[s] means "no update here". The rows
// of one adapter go together (up to 8 at a time), so its weights are read once per 8 rows: what a
// decode step needs, where the rows are few and the adapter's bytes are the cost.
void lora_apply(const at::Tensor& x, at::Tensor& y, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
                const std::vector<at::Tensor>& shards, const at::Tensor& row_adapter) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "lora_apply was built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [T, K] and y [T, N] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && x.is_contiguous() && y.is_contiguous(),
              "contiguous float32 x and y expected");
  TORCH_CHECK(row_adapter.dim() == 1 && row_adapter.size(0) == x.size(0) && row_adapter.scalar_type() == at::kInt &&
                  row_adapter.is_contiguous(),
              "row_adapter must be int32 [T]");
  const int64_t S = static_cast<int64_t>(a.size());
  TORCH_CHECK(bt.size() == a.size() && shards.size() == a.size(), "a, bt and shards must have one entry per adapter");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int32_t* ra = row_adapter.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(-1 <= ra[t] && ra[t] < S, "row ", t, ": adapter ", ra[t], " of ", S);
#if SERVELM_HAVE_AVX512
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> h;
  for (int64_t s = 0; s < S; ++s) {
    if (a[s].numel() == 0) continue;
    const int64_t R = a[s].size(0);
    TORCH_CHECK(a[s].dim() == 2 && a[s].size(1) == K && a[s].scalar_type() == at::kFloat && a[s].is_contiguous(),
                "adapter ", s, ": a must be contiguous float32 [R, ", K, "]");
    TORCH_CHECK(shards[s].dim() == 2 && shards[s].size(1) == 3 && shards[s].scalar_type() == at::kLong &&
                    shards[s].is_contiguous(),
                "adapter ", s, ": shards must be int64 [J, 3]");
    TORCH_CHECK(bt[s].scalar_type() == at::kFloat && bt[s].is_contiguous(), "adapter ", s, ": bt must be contiguous float32");
    const int64_t J = shards[s].size(0);
    const int64_t* sh = shards[s].data_ptr<int64_t>();
    int64_t rank_total = 0, bt_total = 0;
    for (int64_t j = 0; j < J; ++j) {
      TORCH_CHECK(sh[3 * j] >= 0 && sh[3 * j + 1] >= 0 && sh[3 * j] + sh[3 * j + 1] <= N && sh[3 * j + 2] >= 0,
                  "adapter ", s, ": shard ", j, " outside the ", N, " outputs");
      rank_total += sh[3 * j + 2];
      bt_total += sh[3 * j + 1] * sh[3 * j + 2];
    }
    TORCH_CHECK(rank_total == R && bt_total == bt[s].numel(), "adapter ", s, ": shards do not match a and bt");
    std::vector<int64_t> rows;
    for (int64_t t = 0; t < T; ++t)
      if (ra[t] == s) rows.push_back(t);
    const float* ap = a[s].data_ptr<float>();
    const float* bp = bt[s].data_ptr<float>();
    for (size_t g = 0; g < rows.size(); g += kMaxMInt8) {
      const int64_t M = std::min<int64_t>(kMaxMInt8, static_cast<int64_t>(rows.size() - g));
      const float* xs[kMaxMInt8];
      float* ys[kMaxMInt8];
      const float* hs[kMaxMInt8];
      h.assign(static_cast<size_t>(M * R), 0.0f);
      for (int64_t m = 0; m < M; ++m) {
        xs[m] = xp + rows[g + m] * K;
        ys[m] = yp + rows[g + m] * N;
        hs[m] = h.data() + m * R;
      }
      with_rows<true>(M, [&](auto mm) {
        constexpr int Mc = decltype(mm)::value;
        // Threads only where each gets ~64 KB of A or B^T: a fork/join costs more than a smaller read.
        at::parallel_for(0, R, std::max<int64_t>(1, 16384 / K), [&](int64_t k0, int64_t k1) {
          lora_down<Mc>(xs, ap, h.data(), R, k0, k1, K);
        });
        int64_t k_at = 0, b_at = 0;
        for (int64_t j = 0; j < J; ++j) {
          const int64_t o0 = sh[3 * j], n = sh[3 * j + 1], r = sh[3 * j + 2];
          float* yj[kMaxMInt8];
          const float* hj[kMaxMInt8];
          for (int64_t m = 0; m < M; ++m) {
            yj[m] = ys[m] + o0;
            hj[m] = hs[m] + k_at;
          }
          const int64_t chunks = (n + 15) / 16;
          at::parallel_for(0, chunks, std::max<int64_t>(1, 1024 / std::max<int64_t>(r, 1)), [&](int64_t c0, int64_t c1) {
            lora_up<Mc>(yj, hj, bp + b_at, r, n, c0, c1);
          });
          k_at += r;
          b_at += n * r;
        }
      });
    }
  }
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "servelm small CPU ops of the decode step";
  m.def("linear_few_row", &linear_few_row, "x [M<=4, K] @ W[N, K]^T (+ bias), float32 or bfloat16", py::arg("x"),
        py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("linear_few_row_int8", &linear_few_row_int8, "x [M<=8, K] float32 @ (scale[:, None] * W[N, K] int8)^T (+ bias)",
        py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_few_row_int4", &linear_few_row_int4,
        "x [M<=8, K] float32 @ W^T, W int4 in groups of 32 (packed uint8 [N, K/2], fp16 scales and mins [N, K/32])",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("mins"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_few_row_int8_grouped", &linear_few_row_int8_grouped,
        "x [M<=8, K] float32 @ W^T, W int8 [N, K] with an fp16 scale per group of 32 ([N, K/32])", py::arg("x"),
        py::arg("weight"), py::arg("scales"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual) * weight, x + residual), the sum in place in residual",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate_up[:, :I]) * gate_up[:, I:]", py::arg("gate_up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2, -1) + eps) * weight, float32 or bfloat16", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is clear (in place)", py::arg("logits"),
        py::arg("rows"), py::arg("bitmask"), py::call_guard<py::gil_scoped_release>());
  m.def("lora_apply", &lora_apply,
        "y[t] += B_s (A_s x[t]) for rows t with adapter s = row_adapter[t] (-1: none); float32, in place",
        py::arg("x"), py::arg("y"), py::arg("a"), py::arg("bt"), py::arg("shards"), py::arg("row_adapter"),
        py::call_guard<py::gil_scoped_release>());
  m.attr("max_rows") = kMaxM;
  m.attr("int8_max_rows") = kMaxMInt8;
  m.attr("has_avx512") = py::bool_(SERVELM_HAVE_AVX512 != 0);
  m.attr("has_avx512_bf16") = py::bool_(SERVELM_HAVE_AVX512_BF16 != 0);
}
