"""The host's int8 dot-product and AMX bfloat16 peaks, the ceilings of a prefill's work (docs/benchmarks.md).

    .venv/bin/python scripts/bench_int8_peak.py

Twelve independent 512-bit ``vpdpbusd`` chains per thread (AVX-512 VNNI: 64 u8 x s8 products and their
sums per instruction, counted as 128 ops), 1 and 2 threads; where the CPU has AMX, four independent
``tdpbf16ps`` tiles per thread (16x16x32 bfloat16 products each, the GGUF kernels' many-row steps);
torch._int_mm (oneDNN) on a 2048^3 int8 product and a bfloat16 matmul for comparison; and the memory
bandwidth as STREAM's triad counts it (a = b + s c over 3 x 256 MiB of float32, 3 arrays' bytes), the
ceiling of a decode step that reads every weight once. Needs a CPU with AVX-512 VNNI and a compiler (built with torch's
cpp_extension on first run).
"""

import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) Cfg { uint8_t palette = 1, start = 0, pad[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
#endif
// 0 where the build or the kernel has no AMX.
double amx_flops(int64_t iters, int threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
  double total = 0;
  #pragma omp parallel num_threads(threads) reduction(+:total)
  {
    Cfg c;
    for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
    _tile_loadconfig(&c);
    alignas(64) static thread_local uint16_t buf[512] = {};
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
    for (int64_t t = 0; t < iters; ++t) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
    total += (double)iters * 4 * 16 * 16 * 32 * 2;  // 16x16 outputs, 32 products and adds each
  }
  return total;
#else
  return 0;
#endif
}
"""


def best_rate(fn, work: float, reps: int = 5) -> float:
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = max(best, work / (time.perf_counter() - t))
    return best


def triad(n: int = 64 << 20) -> None:
    """STREAM's triad a = b + s c over three float32 arrays of n; its bytes are the three arrays'."""
    b, c, out = torch.rand(n), torch.rand(n), torch.empty(n)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        rate = best_rate(lambda: torch.add(b, c, alpha=3.0, out=out), 3 * 4 * n)
        print(f"STREAM triad, {threads} thread(s): {rate / 1e9:.1f} GB/s")


def main() -> None:
    m = load_inline(
        "vnni_peak", cpp_sources=SOURCE, functions=["vnni_ops", "amx_flops"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
    )  # fmt: skip
    iters = 20_000_000
    for threads in (1, 2):
        ops = m.vnni_ops(1000, threads) / 1000 * iters  # the work of one timed call
        rate = best_rate(lambda threads=threads: m.vnni_ops(iters, threads), ops)
        print(f"vpdpbusd zmm, {threads} thread(s): {rate / 1e12:.3f} TOPS (int8 multiply-adds x2)")
    for threads in (1, 2):
        flops = m.amx_flops(1000, threads) / 1000 * iters / 4
        if flops == 0:
            print("AMX bfloat16: not on this CPU (or build, or kernel)")
            break
        rate = best_rate(lambda threads=threads: m.amx_flops(iters // 4, threads), flops)
        print(f"tdpbf16ps (AMX), {threads} thread(s): {rate / 1e12:.3f} TFLOPS (bfloat16 multiply-adds x2)")
    torch.set_num_threads(2)
    x = torch.randn(2048, 2048, dtype=torch.bfloat16)
    rate = best_rate(lambda: x @ x, 2 * 2048**3)
    print(f"bfloat16 matmul 2048^3 (oneDNN), 2 threads: {rate / 1e12:.3f} TFLOPS")
    triad()
    a = torch.randint(-127, 127, (2048, 2048), dtype=torch.int8)
    b = torch.randint(-127, 127, (2048, 2048), dtype=torch.int8)
    torch._int_mm(a, b)
    rate = best_rate(lambda: torch._int_mm(a, b), 2 * 2048**3)
    print(f"torch._int_mm 2048^3 (oneDNN), 2 threads: {rate / 1e12:.3f} TOPS")


if __name__ == "__main__":
    main()
