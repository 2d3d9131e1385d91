"""A probe for the next GPU run: would a Triton GEMV beat cuBLAS on the decode projections?

At batch 1 the H200 spent 3.66 ms per forward in cuBLAS GEMVs for 13.96 GB of weights. That is
3.8 TB/s on average, but only 3.1-3.4 TB/s on the two small projections (q/k/v and o), which also
add split-K reduce kernels. The batch-1 target (1.25x of weights / 4.8 TB/s) needs them faster.
This times a plain streaming kernel against ``F.linear`` on the Llama-3-8B projection shapes, at
1, 2 and 4 rows and a few tile shapes, and reports bytes read per second. The engine does not use
this kernel: it is an experiment whose numbers decide whether it should.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

# (name, out_features, in_features) of one Llama-3-8B layer's projections, and the vocabulary head.
LLAMA3_8B_PROJECTIONS = [
    ("qkv_proj", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 28672, 4096),
    ("down_proj", 4096, 14336),
    ("lm_head", 128256, 4096),
]
# (BLOCK_N, BLOCK_K at 1 row, num_warps, num_stages); BLOCK_K shrinks as rows grow (registers).
CONFIGS = [(8, 512, 4, 3), (16, 256, 4, 4), (32, 128, 4, 4), (64, 128, 8, 3)]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program = BLOCK_N output features for every row: each weight row is read once, in
    # BLOCK_K-wide contiguous pieces, and multiplied against all (at most M_PAD) rows of x.
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv(
    x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 256, num_warps: int = 4, num_stages: int = 4
) -> torch.Tensor:
    """``x @ w.T`` for a few rows of ``x`` (``[M, K]``, M <= 16) against ``w`` ``[N, K]``."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must share K with unit column strides")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        M_PAD=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def probe(device: torch.device, rows: tuple[int, ...] = (1, 2, 4)) -> list[dict[str, Any]]:
    """For each projection shape and row count: cuBLAS (``F.linear``) vs the best tile config of
    ``gemv``, in TB/s of weights read. ``triton.testing.do_bench`` times single launches with CUDA
    events and clears the L2 cache between them, so the weights really come from HBM."""
    from triton.testing import do_bench

    out = []
    for name, n, k in LLAMA3_8B_PROJECTIONS:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        nbytes = n * k * 2
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ms_cublas = do_bench(lambda: torch.nn.functional.linear(x, w), warmup=10, rep=50, return_mode="median")
            ref = torch.nn.functional.linear(x, w).float()
            best = None
            for bn, bk, warps, stages in CONFIGS:
                cfg = (bn, max(32, bk // triton.next_power_of_2(m)), warps, stages)
                got = gemv(x, w, *cfg).float()
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                ms = do_bench(lambda c=cfg: gemv(x, w, *c), warmup=10, rep=50, return_mode="median")
                if best is None or ms < best[0]:
                    best = (ms, cfg, err)
            assert best is not None
            out.append(
                dict(
                    name=name,
                    rows=m,
                    cublas_tbs=nbytes / (ms_cublas * 1e-3) / 1e12,
                    triton_tbs=nbytes / (best[0] * 1e-3) / 1e12,
                    config=best[1],
                    max_rel_err=best[2],
                )
            )
    return out
