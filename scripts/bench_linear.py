"""All of one forward's projections on the default model's shapes: ``F.linear`` vs oneDNN-packed weights
(and, for 1-4 rows, the few-row AVX-512 kernel of ``runtime.cpu.ops`` on the dense weights; for 1-8 rows
its int8 sibling on the weights ``--quantization int8`` makes, and the int4 kernel with the int8-group
head on those ``--quantization int4`` makes).

    .venv/bin/python scripts/bench_linear.py [--rows 1 8 32 128 512] [--threads 2] [--bf16] [--skip-dense]

Every layer gets its own weights (30 x qkv, o, gate_up, down: 425 MB in float32), so the numbers include
streaming them from memory as a real decode step must; the vocabulary head (49152 x 576) is timed apart.
Prints median milliseconds per full pass, the weight-read rate and GFLOP/s; compare the read rate with
the host's memory ceiling (~25-30 GB/s here) and GFLOP/s with its matmul ceiling (~200-280 here).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from servelm.runtime import quantization as qz
from servelm.runtime.cpu import linear as cpu_linear
from servelm.runtime.quantization import quantize_rows

LAYERS = 30
HIDDEN, INTER, Q, KV, VOCAB = 576, 1536, 576, 192, 49152
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (out, in)


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--bf16", action="store_true", help="also time bfloat16 weights")
    ap.add_argument("--skip-dense", action="store_true", help="only the quantized kernels (float32 x)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 else [])
    print(f"threads {args.threads}; {LAYERS} layers of {SHAPES} (out, in) + head {VOCAB}x{HIDDEN}")
    for dtype in dtypes:
        dense = [[(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i in SHAPES] for _ in range(LAYERS)]
        head = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(dtype)
        packed = (
            [[cpu_linear.pack(w) for w in ws] for ws in dense] if cpu_linear.onednn_linear_available(dtype) else None
        )
        head_packed = cpu_linear.pack(head) if packed is not None else None
        layer_bytes = sum(w.numel() * w.element_size() for ws in dense for w in ws)
        head_bytes = head.numel() * head.element_size()
        name = str(dtype).replace("torch.", "")
        int8 = cpu_linear.few_row_int8_kernel() if dtype == torch.float32 else None
        if int8 is not None:  # the weights --quantization int8 makes, for the int8 kernel
            q_layers = [[quantize_rows(w) for w in ws] for ws in dense]
            q_head = quantize_rows(head)
            q_bytes = sum(q.numel() for ws in q_layers for q, _ in ws)
            kernels = cpu_linear.quantized_kernels()
            q4_layers = [[qz.quantize(w, "int4", kernels) for w in ws] for ws in dense]
            q4_head = qz.quantize(head, "int8_groups", kernels)
            q4_bytes = sum(q.nbytes for ws in q4_layers for q in ws)
        for rows in args.rows:
            xs = [torch.randn(rows, i, generator=g).to(dtype) for _, i in SHAPES]
            h = torch.randn(rows, HIDDEN, generator=g).to(dtype)
            flops = 2 * rows * sum(o * i for o, i in SHAPES) * LAYERS

            def torch_layers() -> None:
                for ws in dense:
                    for w, x in zip(ws, xs):
                        F.linear(x, w)

            line = f"{name:8s} rows {rows:4d}"
            if not args.skip_dense:
                t_layers = median_ms(torch_layers, args.reps)
                t_head = median_ms(lambda: F.linear(h, head), args.reps)
                line += (
                    f" | F.linear: layers {t_layers:7.2f} ms "
                    f"({layer_bytes / t_layers / 1e6:5.1f} GB/s, {flops / t_layers / 1e6:4.0f} GFLOP/s) head {t_head:6.2f} ms"
                )
            if packed is not None and head_packed is not None and not args.skip_dense:
                pk = packed

                def onednn_layers() -> None:
                    for ws in pk:
                        for w, x in zip(ws, xs):
                            cpu_linear.linear(x, w, None)

                p_layers = median_ms(onednn_layers, args.reps)
                p_head = median_ms(lambda: cpu_linear.linear(h, head_packed, None), args.reps)
                line += (
                    f" | oneDNN: layers {p_layers:7.2f} ms ({layer_bytes / p_layers / 1e6:5.1f} GB/s, "
                    f"{flops / p_layers / 1e6:4.0f} GFLOP/s) head {p_head:6.2f} ms "
                    f"({head_bytes / p_head / 1e6:5.1f} GB/s) | speed-up {(t_layers + t_head) / (p_layers + p_head):.2f}x"
                )
            small = cpu_linear.few_row_kernel() if dtype == torch.float32 else None
            if small is not None and rows <= small[1] and not args.skip_dense:
                fn = small[0]

                def small_layers() -> None:
                    for ws in dense:
                        for w, x in zip(ws, xs):
                            fn(x, w, None)

                s_layers = median_ms(small_layers, args.reps)
                s_head = median_ms(lambda: fn(h, head, None), args.reps)
                line += (
                    f" | few-row kernel: layers {s_layers:7.2f} ms ({layer_bytes / s_layers / 1e6:5.1f} GB/s) "
                    f"head {s_head:6.2f} ms ({head_bytes / s_head / 1e6:5.1f} GB/s)"
                )
            if int8 is not None and rows <= int8[1]:
                fn8 = int8[0]

                def int8_layers() -> None:
                    for ws in q_layers:
                        for (q, scale), x in zip(ws, xs):
                            fn8(x, q, scale, None)

                i_layers = median_ms(int8_layers, args.reps)
                i_head = median_ms(lambda: fn8(h, q_head[0], q_head[1], None), args.reps)
                line += (
                    f" | int8 kernel: layers {i_layers:7.2f} ms ({q_bytes / i_layers / 1e6:5.1f} GB/s of int8) "
                    f"head {i_head:6.2f} ms"
                )

                def int4_layers() -> None:
                    for ws in q4_layers:
                        for q4, x in zip(ws, xs):
                            q4.linear(x, None)

                f_layers = median_ms(int4_layers, args.reps)
                f_head = median_ms(lambda: q4_head.linear(h, None), args.reps)
                line += (
                    f" | int4 kernel: layers {f_layers:7.2f} ms ({q4_bytes / f_layers / 1e6:5.1f} GB/s) "
                    f"int8-group head {f_head:6.2f} ms"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
