"""The host's int8 dot-product peak, the ceiling of a prefill's int8 work (docs/benchmarks.md).

    .venv/bin/python scripts/bench_int8_peak.py

Twelve independent 512-bit ``vpdpbusd`` chains per thread (AVX-512 VNNI: 64 u8 x s8 products and their
sums per instruction, counted as 128 ops), 1 and 2 threads; and torch._int_mm (oneDNN) on a 2048^3
int8 product for comparison. Needs a CPU with AVX-512 VNNI and a compiler (built with torch's
cpp_extension on first run).
"""
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r'''
#include <immintrin.h>
#include <torch/extension.h>
#include <omp.h>
double vnni_ops(int64_t iters, int threads) {
  double total = 0;
  #pragma omp parallel num_threads(threads) reduction(+:total)
  {
    __m512i a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
    const __m512i x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(2);
    for (int64_t t = 0; t < iters; ++t) {
      #pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
    }
    int s = 0;
    for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_epi32(a[i]);
    total += (double)iters * 12 * 64 * 2 + (s == 42 ? 1 : 0);  // 64 u8*s8 products and their adds per instruction
  }
  return total;
}
'''


def best_rate(fn, work: float, reps: int = 5) -> float:
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = max(best, work / (time.perf_counter() - t))
    return best


def main() -> None:
    m = load_inline(
        "vnni_peak", cpp_sources=SOURCE, functions=["vnni_ops"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
    )  # fmt: skip
    iters = 20_000_000
    for threads in (1, 2):
        ops = m.vnni_ops(1000, threads) / 1000 * iters  # the work of one timed call
        rate = best_rate(lambda threads=threads: m.vnni_ops(iters, threads), ops)
        print(f"vpdpbusd zmm, {threads} thread(s): {rate / 1e12:.3f} TOPS (int8 multiply-adds x2)")
    torch.set_num_threads(2)
    a = torch.randint(-127, 127, (2048, 2048), dtype=torch.int8)
    b = torch.randint(-127, 127, (2048, 2048), dtype=torch.int8)
    torch._int_mm(a, b)
    rate = best_rate(lambda: torch._int_mm(a, b), 2 * 2048**3)
    print(f"torch._int_mm 2048^3 (oneDNN), 2 threads: {rate / 1e12:.3f} TOPS")


if __name__ == "__main__":
    main()
