// Small CPU ops of the decode step, float32, AVX-512:
//   * linear_small_m: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows (M <= 4);
//   * rms_norm: y = x * rsqrt(mean(x^2) + eps) * w over the last dimension.
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
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SERVELM_HAVE_AVX512 1
#else
#define SERVELM_HAVE_AVX512 0
#endif

namespace {

constexpr int kRows = 8;   // weight rows per block
constexpr int kMaxM = 4;   // x rows handled in one pass over W

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

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "linear_small_m was built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous x and weight expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "x has ", K, " columns, weight ", weight.size(1));
  TORCH_CHECK(M >= 1 && M <= kMaxM, "1..", kMaxM, " rows expected, got ", M);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias [N] float32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if SERVELM_HAVE_AVX512
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: run<1>(xp, wp, yp, b, N, K); break;
    case 2: run<2>(xp, wp, yp, b, N, K); break;
    case 3: run<3>(xp, wp, yp, b, N, K); break;
    default: run<4>(xp, wp, yp, b, N, K); break;
  }
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(SERVELM_HAVE_AVX512, "rms_norm was built without AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && weight.is_contiguous(), "contiguous x and weight expected");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "weight must be [", H, "]");
  const int64_t rows = H ? x.numel() / H : 0;
  at::Tensor y = at::empty_like(x);
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
  m.doc() = "servelm small float32 CPU ops of the decode step";
  m.def("linear_small_m", &linear_small_m, "x [M<=4, K] @ W[N, K]^T (+ bias), float32", py::arg("x"),
        py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2, -1) + eps) * weight, float32", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.attr("max_rows") = kMaxM;
  m.attr("has_avx512") = py::bool_(SERVELM_HAVE_AVX512 != 0);
}
