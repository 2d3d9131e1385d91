"""A projection from GGUF blocks three ways: the native block kernel (``runtime.cpu.gguf_kernels``), the
dequantize-a-tile-then-``F.linear`` fallback (``runtime.gguf.projection.GGUFMethod``), and ``F.linear``
on the dense float32 weight, for decode-sized inputs (1 and 4 rows).

    .venv/bin/python scripts/bench_gguf_linear.py [--formats Q4_K Q8_0] [--rows 1 4] [--threads 2] [--copies 0]
    .venv/bin/python scripts/bench_gguf_linear.py --set smollm2 --formats Q4_1 --rows 1 --threads 1 --skip-fallback
    .venv/bin/python scripts/bench_gguf_linear.py --shapes 576x576 49152x576:Q8_0 --formats Q4_1

``--set`` picks a model's projection shapes (fused q/k/v and gate/up as the engine runs them); a shape
``NxK:FMT`` is timed in FMT only (the Q8_0 heads), the others in every ``--formats``.

Prints median (and best) milliseconds per call and the kernel's read rate (quantized weight bytes / time). Each
timed call uses the next of several copies of the weight, enough that they do not fit in the last-level
cache (``--copies`` overrides), so every method streams its weight from memory as a decode step does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from servelm.runtime.cpu import gguf_kernels as kernels
from servelm.runtime.gguf.projection import GGUFMethod
from servelm.runtime.gguf.registry import BLOCK_LAYOUT, dequantize

SHAPES = ((2048, 2048), (8192, 2048))  # (out_features, in_features)
# (out_features, in_features, format or None for every --formats) of each model's decode projections.
SHAPE_SETS: dict[str, tuple[tuple[int, int, str | None], ...]] = {
    "square": tuple((n, k, None) for n, k in SHAPES),
    # SmolLM2-135M: hidden 576, 9 q heads + 3 k + 3 v of 64 (fused 960), intermediate 1536, Q8_0 tied head.
    "smollm2": ((576, 576, None), (960, 576, None), (3072, 576, None), (576, 1536, None), (49152, 576, "Q8_0")),
    # Gemma 3 270M: hidden 640, q 4x256 + k 256 + v 256 (fused 1536), o 640x1024, intermediate 2048.
    "gemma3": ((1536, 640, None), (640, 1024, None), (4096, 640, None), (640, 2048, None), (262144, 640, "Q8_0")),
}


def parse_shape(spec: str) -> tuple[int, int, str | None]:
    """``NxK`` or ``NxK:FMT`` -> (N, K, FMT or None)."""
    dims, _, fmt = spec.partition(":")
    n, k = (int(v) for v in dims.lower().split("x"))
    return n, k, fmt or None


DEFAULT_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")
CACHE_BYTES = 32 << 20  # last-level cache to defeat (this host: 32 MiB L3)


def timed_ms(fns: list[Callable[[], object]], reps: int) -> tuple[float, float]:
    """(median, best) time of one call, cycling through ``fns`` (one per weight copy) after a warm-up pass."""
    for fn in fns:
        fn()
    times = []
    for i in range(reps):
        fn = fns[i % len(fns)]
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def copies_for(nbytes: int, requested: int) -> int:
    """Copies of an ``nbytes`` weight that together overflow the cache twice over (at most 64)."""
    return requested if requested > 0 else int(min(64, max(2, -(-2 * CACHE_BYTES // nbytes))))


def tile_methods(blocks: list[torch.Tensor], qtype: Q, shape: tuple[int, int]) -> list[GGUFMethod]:
    """``GGUFMethod``s held to their dequantize-a-tile path: built with the kernels disabled, so a
    method that would route few-row steps to the kernel does not."""
    saved = os.environ.get(kernels.DISABLE_ENV)
    os.environ[kernels.DISABLE_ENV] = "1"
    try:
        return [GGUFMethod(b.reshape(-1), qtype, shape) for b in blocks]
    finally:
        if saved is None:
            del os.environ[kernels.DISABLE_ENV]
        else:
            os.environ[kernels.DISABLE_ENV] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument(
        "--copies", type=int, default=0, help="weight copies to cycle through (0: enough to overflow the cache)"
    )
    parser.add_argument("--set", choices=sorted(SHAPE_SETS), default="square", help="shape set (default: square)")
    parser.add_argument("--shapes", nargs="+", default=None, help="NxK[:FMT] shapes instead of --set")
    parser.add_argument("--skip-dense", action="store_true", help="do not time dense F.linear")
    parser.add_argument("--skip-fallback", action="store_true", help="do not time GGUFMethod (slow)")
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="the kernel with activations rounded to int8 (--gguf-activations int8)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.load() is None:
        raise SystemExit("the GGUF kernels are unavailable here")
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}; times in ms (median of {args.reps}); GB/s = quantized weight bytes / kernel time")
    print(
        f"{'format':6} {'weight':>11} {'M':>2} {'kernel':>8} {'(best)':>8} {'GB/s':>6} {'fallback':>9} "
        f"{'dense f32':>9} {'(best)':>8} {'dense GB/s':>10}"
    )
    shapes = [parse_shape(v) for v in args.shapes] if args.shapes else list(SHAPE_SETS[args.set])
    jobs = [(n, k, f) for f in args.formats for n, k, only in shapes if only is None]
    jobs += [(n, k, only) for n, k, only in shapes if only is not None]
    for out_f, in_f, name in jobs:
        qtype = Q[name]
        if in_f % BLOCK_LAYOUT[qtype][0]:  # e.g. Gemma 3's 640 columns in a 256-element format
            print(
                f"{name:6} {out_f:5}x{in_f:<5} skipped: {in_f} columns are not whole {BLOCK_LAYOUT[qtype][0]}-element blocks"
            )
            continue
        base = kernels.random_blocks(qtype, out_f, in_f, rng)
        qbytes = base.numel()
        n_q = copies_for(qbytes, args.copies)
        n_d = copies_for(out_f * in_f * 4, args.copies)
        blocks = [base.clone() for _ in range(n_q)]
        dense_w = dequantize((base.reshape(-1), qtype, (out_f, in_f)))
        dense = [] if args.skip_dense else [dense_w.clone() for _ in range(n_d)]
        del dense_w
        methods = [] if args.skip_fallback else tile_methods(blocks[: min(n_q, 4)], qtype, (out_f, in_f))
        for m in args.rows:
            x = torch.randn(m, in_f)
            out = torch.empty(m, out_f)
            t_kernel, best_kernel = timed_ms(
                [lambda b=b: kernels.linear(x, b, qtype, out, int8_x=args.int8_activations) for b in blocks], args.reps
            )
            t_fallback = (
                float("nan")
                if args.skip_fallback
                else timed_ms([lambda g=g: g.apply(x) for g in methods], max(5, args.reps // 3))[0]
            )
            t_dense, best_dense = (
                (float("nan"), float("nan"))
                if args.skip_dense
                else timed_ms([lambda w=w: F.linear(x, w) for w in dense], args.reps)
            )
            print(
                f"{name:6} {out_f:5}x{in_f:<5} {m:2} {t_kernel:8.3f} {best_kernel:8.3f} {qbytes / t_kernel / 1e6:6.1f} "
                f"{t_fallback:9.2f} {t_dense:9.3f} {best_dense:8.3f} {out_f * in_f * 4 / t_dense / 1e6:10.1f}",
                flush=True,
            )
        del blocks, dense, methods


if __name__ == "__main__":
    main()
