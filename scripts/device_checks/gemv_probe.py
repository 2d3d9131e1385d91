"""The fused few-row projections (``runtime.triton_gemv``) against what they replace, per projection.

For each Llama-3-8B projection shape and 1, 2 and 4 rows this times, inside a CUDA graph (as a decode
step runs them, so launch latency is not counted but the gaps between kernels are):

- fused: the one Triton kernel (norm + q/k/v or gate/up; SiLU x up + down; o_proj and the head alone);
- plain: the unfused ops (``runtime.triton_ops`` norm or activation, then cuBLAS via ``F.linear``).

Each graph cycles over several copies of the weight (more bytes than the 50 MB L2), so the weights
come from HBM. Reported as bytes of weight read per second, with the largest relative difference.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

# (name, out_features, in_features, the op fused before the projection)
LLAMA3_8B_PROJECTIONS = [
    ("qkv_proj", 6144, 4096, "rms_norm"),
    ("o_proj", 4096, 4096, "none"),
    ("gate_up_proj", 28672, 4096, "rms_norm"),
    ("down_proj", 4096, 14336, "silu_mul"),
    ("lm_head", 128256, 4096, "none"),
]
L2_BYTES = 50 << 20


def graph_ms(calls: list[Callable[[], Any]], device: torch.device, iters: int = 10) -> float:
    """Median ms per call of ``calls`` captured back to back in one CUDA graph."""
    for fn in calls:  # compile / autotune outside the capture
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    times.sort()
    return times[len(times) // 2]


def probe(device: torch.device, rows: tuple[int, ...] = (1, 2, 4), dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    from runtime import triton_gemv, triton_ops

    out = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, n, k, op in LLAMA3_8B_PROJECTIONS:
        nbytes = n * k * dtype.itemsize
        copies = max(2, -(-4 * L2_BYTES // nbytes))
        ws = [torch.randn(n, k, device=device, dtype=dtype, generator=gen) / 64 for _ in range(copies)]
        nw = torch.rand(k, device=device, dtype=dtype, generator=gen) + 0.5
        for m in rows:
            width = 2 * k if op == "silu_mul" else k
            x = torch.randn(m, width, device=device, dtype=dtype, generator=gen)
            res = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
            res_plain = res.clone()
            if op == "rms_norm":
                def fused(w: torch.Tensor) -> torch.Tensor:
                    return triton_gemv.rms_norm_linear(x, res, nw, 1e-5, w)[0]

                def plain(w: torch.Tensor) -> torch.Tensor:
                    # In place, as the engine does (the timed repeats keep adding x: same work, other values).
                    return F.linear(triton_ops.rms_norm(x, res_plain, nw, 1e-5)[0], w)
            elif op == "silu_mul":
                def fused(w: torch.Tensor) -> torch.Tensor:
                    return triton_gemv.silu_mul_linear(x, w)

                def plain(w: torch.Tensor) -> torch.Tensor:
                    return F.linear(triton_ops.silu_mul(x), w)
            else:
                def fused(w: torch.Tensor) -> torch.Tensor:
                    return triton_gemv.linear(x, w)

                def plain(w: torch.Tensor) -> torch.Tensor:
                    return F.linear(x, w)

            a, b = fused(ws[0]).float(), plain(ws[0]).float()  # the first call: res_plain still equals res
            err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
            ms_fused = graph_ms([lambda w=w: fused(w) for w in ws], device)
            ms_plain = graph_ms([lambda w=w: plain(w) for w in ws], device)
            out.append(
                dict(
                    name=name,
                    op=op,
                    rows=m,
                    fused_tbs=nbytes / (ms_fused * 1e-3) / 1e12,
                    plain_tbs=nbytes / (ms_plain * 1e-3) / 1e12,
                    fused_us=ms_fused * 1e3,
                    plain_us=ms_plain * 1e3,
                    rel_diff=err,
                )
            )
        del ws
    return out
