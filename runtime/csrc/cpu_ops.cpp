// Small CPU ops of the decode step, float32, AVX-512:
//   * linear_small_m: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows (M <= 4); float32, or
//     bfloat16 with float32 accumulation where the CPU has AVX512-BF16;
//   * linear_small_m_int8: the same with int8 weights and a float32 scale per output row
//     (weight-only quantization): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias), float32 x,
//     up to 8 rows;
//   * rms_norm: y = x * rsqrt(mean(x^2) + eps) * w over the last dimension (float32, or bfloat16 with
//     Hugging Face's roundings).
//
// linear_small_m is the decode-latency matmul.
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
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

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
void check_small_m(const at::Tensor& x, const at::Tensor& weight, int64_t max_rows = kMaxM) {
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

at::Tensor linear_small_m_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512_BF16, "linear_small_m was built without AVX512-BF16");
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

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "linear_small_m was built without AVX-512");
  check_small_m(x, weight);
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) return linear_small_m_bf16(x, weight, bias);
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

at::Tensor linear_small_m_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "linear_small_m_int8 was built without AVX-512");
  check_small_m(x, weight, kMaxMInt8);
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
  TORCH_CHECK(SERVELM_HAVE_AVX512, "rms_norm was built without AVX-512");
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
#if SERVELM_HAVE_AVX512
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // A decode step has a handful of rows: threads would cost more than they save below ~64.
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * H, wp, yp + r * H, H, e);
  });
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "servelm small CPU ops of the decode step";
  m.def("linear_small_m", &linear_small_m, "x [M<=4, K] @ W[N, K]^T (+ bias), float32 or bfloat16", py::arg("x"),
        py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("linear_small_m_int8", &linear_small_m_int8, "x [M<=8, K] float32 @ (scale[:, None] * W[N, K] int8)^T (+ bias)",
        py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2, -1) + eps) * weight, float32 or bfloat16", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.attr("max_rows") = kMaxM;
  m.attr("int8_max_rows") = kMaxMInt8;
  m.attr("has_avx512") = py::bool_(SERVELM_HAVE_AVX512 != 0);
  m.attr("has_avx512_bf16") = py::bool_(SERVELM_HAVE_AVX512_BF16 != 0);
}
