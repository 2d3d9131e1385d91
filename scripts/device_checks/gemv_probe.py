"""The fused few-row projections (``runtime.cuda.triton_gemv``) against what they replace, per projection.

For each Llama-3-8B projection shape and 1, 2 and 4 rows this times, inside a CUDA graph (as a decode
step runs them, so launch latency is not counted but the gaps between kernels are):

- fused: the one Triton kernel (norm + q/k/v or gate/up; SiLU x up + down; o_proj and the head alone);
- plain: the unfused ops (``runtime.cuda.triton_ops`` norm or activation, then cuBLAS via ``F.linear``);
- fused with PDL (where ``runtime.cuda.pdl`` can run): the same graph with programmatic dependent launch,
  so each kernel's start overlaps the previous one's end, as in a decode graph kept with PDL.

Each graph cycles over several copies of the weight (more bytes than the 50 MB L2), so the weights
come from HBM. Reported as bytes of weight read per second, with the largest relative difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def probe(
    device: torch.device, rows: tuple[int, ...] = (1,), dtype: torch.dtype = torch.bfloat16
) -> list[dict[str, Any]]:
    """Rows: 1 by default (the 2- and 4-row dot tiles lost everywhere on an H200, 2026-12-01)."""
    from servelm.runtime.cuda import pdl, triton_gemv, triton_ops

    with_pdl = pdl.unavailable_reason(device) is None
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
            ms_pdl = None
            if with_pdl:
                with pdl.launching(True):
                    ms_pdl = graph_ms([lambda w=w: fused(w) for w in ws], device)
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
                    pdl_us=None if ms_pdl is None else ms_pdl * 1e3,
                )
            )
        del ws
    return out


# One-row element-wise tiles for ``sweep``: (block_n, block_k, warps, prefetch). Their loop is not
# software-pipelined (sm_90 PTX has no cp.async; num_stages changes nothing), so what varies is
# the tile, the warps, and whether the next weight tile is loaded before this one is used. Spread
# over the shapes whose float32 accumulator takes 16-64 registers a thread, the autotuner's first.
# Ordered so that a sweep cut short by its time budget has tried a spread of each.
SWEEP_TILES = [
    (8, 512, 4, False), (4, 1024, 4, False), (16, 256, 4, False), (8, 512, 4, True), (2, 2048, 8, True),
    (4, 1024, 4, True), (16, 256, 4, True), (4, 512, 2, True), (8, 1024, 8, True), (2, 1024, 2, True),
    (4, 2048, 8, True), (16, 512, 8, True), (1, 4096, 8, False), (2, 2048, 8, False), (4, 1024, 8, False),
    (8, 1024, 8, False), (16, 512, 8, False), (8, 256, 2, False), (4, 512, 2, False), (1, 2048, 4, False),
    (2, 1024, 4, False), (1, 4096, 4, True), (8, 256, 2, True),
]  # fmt: skip


def tile_of(spec: tuple[int, int, int, bool]) -> Any:
    """A ``SWEEP_TILES`` entry as the element-wise ``runtime.cuda.triton_gemv.Tile`` it stands for."""
    from servelm.runtime.cuda.triton_gemv import Tile

    block_n, block_k, warps, prefetch = spec
    return Tile(block_n, block_k, warps, 3, False, prefetch=prefetch)


def spec_of(tile: Any) -> tuple[int, int, int, bool]:
    """The inverse of ``tile_of``: how the sweep names an element-wise tile."""
    return (tile.block_n, tile.block_k, tile.warps, tile.prefetch)


def sweep(
    device: torch.device, budget_s: float = 80.0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, list[tuple[float, Any]]]:
    """Each decoder-layer projection at one row with each ``SWEEP_TILES`` tile forced (fused op
    included), timed as ``probe`` times: {projection: [(us, tile), ...] fastest first}, with the
    cuBLAS path as tile None. Stops starting new tiles after ``budget_s`` (compiles dominate)."""
    import time

    from servelm.runtime.cuda import triton_gemv, triton_ops

    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(1)
    cases = []
    for name, n, k, op in LLAMA3_8B_PROJECTIONS[:4]:
        nbytes = n * k * dtype.itemsize
        copies = max(2, -(-4 * L2_BYTES // nbytes))
        ws = [torch.randn(n, k, device=device, dtype=dtype, generator=gen) / 64 for _ in range(copies)]
        nw = torch.rand(k, device=device, dtype=dtype, generator=gen) + 0.5
        x = torch.randn(1, 2 * k if op == "silu_mul" else k, device=device, dtype=dtype, generator=gen)
        res = torch.randn(1, k, device=device, dtype=dtype, generator=gen)

        def run(
            w: torch.Tensor,
            tile: Any,
            op: str = op,
            x: torch.Tensor = x,
            res: torch.Tensor = res,
            nw: torch.Tensor = nw,
        ) -> Any:
            if tile is None:  # the unfused ops and cuBLAS
                if op == "rms_norm":
                    return F.linear(triton_ops.rms_norm(x, res.clone(), nw, 1e-5)[0], w)
                return F.linear(triton_ops.silu_mul(x) if op == "silu_mul" else x, w)
            if op == "rms_norm":
                return triton_gemv.rms_norm_linear(x, res, nw, 1e-5, w, tile=tile)[0]
            if op == "silu_mul":
                return triton_gemv.silu_mul_linear(x, w, tile=tile)
            return triton_gemv.linear(x, w, tile=tile)

        cases.append((name, ws, run))
    results: dict[str, list[tuple[float, Any]]] = {name: [] for name, _, _ in cases}
    for spec in [None, *SWEEP_TILES]:
        if time.perf_counter() - t0 > budget_s:
            break
        tile = None if spec is None else tile_of(spec)
        for name, ws, run in cases:
            try:
                us = graph_ms([lambda w=w: run(w, tile) for w in ws], device) * 1e3
            except Exception as exc:  # a tile this GPU cannot compile or launch: skip it
                print(f"  {name} {spec}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            results[name].append((us, spec))
    for v in results.values():
        v.sort(key=lambda r: r[0])
    return results
