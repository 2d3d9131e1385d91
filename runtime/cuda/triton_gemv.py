"""Few-row projections for decode steps, with the op before each projection fused into it.

At batch 1 a decode step of an 8B model on an H200 spent ~3.7 ms in cuBLAS GEMVs, and ~0.7 ms on
everything else in ~390 kernels: per layer two RMSNorms, a SiLU x up, and two split-K reduce kernels
cuBLAS adds to the o and down projections, each a launch and a gap. This module does a projection of
1-4 rows in one kernel that also does the op feeding it:

- ``rms_norm_linear``: residual add + RMSNorm, then the projection (q/k/v, and gate/up);
- ``silu_mul_linear``: ``silu(gate) * up`` from the fused gate/up projection, then the down projection;
- ``linear``: the projection alone (o_proj).

so a layer launches 7 kernels instead of 12. One program computes ``BLOCK_N`` output features for
every row: it streams those weight rows once, in ``BLOCK_K``-wide contiguous tiles, and multiplies
them against the input tile (recomputed from the L2-resident input, with the fused op applied). Two
tile kinds: element-wise for one row (products accumulate in float32 registers, summed once at the
end), and ``tl.dot`` with the rows padded to 16 (the tensor cores do the multiply; Triton pipelines the
weight loads). There is no split over K, hence no reduce kernel. For the norm, each program sums the
squares of the input tiles it reads anyway and applies the inverse RMS once, after the dot products
(it is the same factor for every k), so no pass over the row comes before the weights stream; program
0 writes the residual sum as it goes.

The inputs are rounded where the unfused path rounds them (``runtime.cuda.triton_ops``, i.e. Hugging
Face's Llama): ``x + residual`` to the activation dtype, ``silu(gate)`` and its product with ``up``.
The norm is the exception: HF rounds the normalised value, then its product with the weight scale, to
the activation dtype; here ``weight scale * x`` stays in float32 (rounded once for the ``tl.dot``
tiles) and ``1/RMS`` multiplies the sum. In float32 the results differ from the unfused path only by
the order of operations; in bfloat16 also by those two roundings, well inside the tolerance of the
capture-time A/B (``runtime.cuda.graphs.few_row_tolerance``).

On CUDA the tile shape is picked per (rows, N, K, op) by Triton's autotuner on first use (the
runner's warm-up forwards, before graph capture); under ``TRITON_INTERPRET=1`` (the CPU tests) one
default shape runs. Whether a decode graph uses these kernels at all is decided at capture by timing
both variants (``runtime.cuda.graphs``).

The kernel is PDL-aware (``runtime.cuda.pdl``): launched with programmatic dependent launch, a program
loads its first weight tile (prefetch tiles) before it waits for the previous kernel.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from servelm.runtime.cuda import pdl
from servelm.runtime.cuda.triton_pdl import wait_then_release

# Up to this many rows (the next power of two of the row count is a compile-time tile dimension).
MAX_ROWS = 4
# Decode graphs try the fused kernels (an A/B at capture, ``runtime.cuda.graphs``) up to this many
# rows. On an H200 one row beat cuBLAS + the unfused ops, but the dot tiles for 2 and 4 rows lost on
# every projection (docs/cuda.md), so sizes 2 and 4 would only add compiles and A/B time at start-up.
AUTO_MAX_ROWS = 1

# Ops before the projection (the kernel's PROLOGUE).
_PLAIN, _RMS_NORM, _SILU_MUL = 0, 1, 2


@triton.jit
def _decode_gemv_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    stride_ym,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # x: [M, K] (PROLOGUE 0/1) or [M, 2K] gate then up (PROLOGUE 2); w: [N, K]; y: [M, N].
    # Element-wise (one row): acc[BLOCK_N, BLOCK_K] += w * x. Dot: the rows padded to 16, and
    # acc[BLOCK_N, 16] += w @ x^T on the tensor cores (the weight tile is what streams either way).
    ROWS: tl.constexpr = 16 if USE_DOT else 1
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, ROWS)
    r_ok = r < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    if PREFETCH:
        # The element-wise loop is not software-pipelined by Triton (no num_stages there): each
        # iteration would wait a full memory round trip. Loading tile i + 1 before using tile i
        # keeps two tiles of weight in flight per program. The first is loaded before the PDL wait:
        # weights do not depend on the previous kernel.
        k_first = tl.arange(0, BLOCK_K)
        w_next = tl.load(w_rows + k_first[None, :], mask=n_ok[:, None] & (k_first < K)[None, :], other=0.0)
    wait_then_release(PDL)
    if PROLOGUE == 1:
        sq = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)  # the rows' squares, summed by column
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if PREFETCH:
            w = w_next
            k_after = k + BLOCK_K
            w_next = tl.load(w_rows + k_after[None, :], mask=n_ok[:, None] & (k_after < K)[None, :], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x_mask = r_ok[:, None] & k_ok[None, :]
        x_off = r[:, None] * stride_xm + k[None, :]
        if PROLOGUE == 2:
            gate = tl.load(x_ptr + x_off, mask=x_mask, other=0.0)
            up = tl.load(x_ptr + x_off + K, mask=x_mask, other=0.0)
            g = gate.to(tl.float32)
            # As torch: silu in float32, rounded; the product rounded again.
            act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
            xk = (act * up.to(tl.float32)).to(gate.dtype)
        else:
            xk = tl.load(x_ptr + x_off, mask=x_mask, other=0.0)
            if PROLOGUE == 1:
                if HAS_RESIDUAL:
                    rk = tl.load(res_ptr + r[:, None] * stride_rm + k[None, :], mask=x_mask, other=0.0)
                    xk = (xk.to(tl.float32) + rk.to(tl.float32)).to(xk.dtype)
                    if pid == 0:
                        tl.store(res_out_ptr + r[:, None] * stride_rom + k[None, :], xk, mask=x_mask)
                hf = xk.to(tl.float32)
                sq += hf * hf
                nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                xk = nw[None, :] * hf  # times 1/RMS after the sum
        if USE_DOT:
            acc = tl.dot(w, tl.trans(xk.to(w.dtype)), acc, input_precision=DOT_PRECISION)
        else:
            acc += w.to(tl.float32) * xk.to(tl.float32)
    if USE_DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=1)[:, None]
    if PROLOGUE == 1:
        # Padding rows (r >= M) read zeros: their sum is 0 and so is their output.
        y = y * tl.math.rsqrt(tl.sum(sq, axis=1) / K + eps)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(
        y_ptr + r[None, :] * stride_ym + n[:, None], y.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & r_ok[None, :]
    )


class Tile(NamedTuple):
    """A launch shape: ``block_n`` output features per program, ``block_k``-wide weight tiles."""

    block_n: int
    block_k: int
    warps: int
    stages: int  # software-pipelining depth of the dot tiles' loads (the element-wise loop has none)
    dot: bool  # tl.dot with the rows padded to 16 (any row count); else element-wise (one row)
    prefetch: bool = False  # element-wise: load the next weight tile before using this one

    def kwargs(self) -> dict[str, Any]:
        return dict(USE_DOT=self.dot, BLOCK_N=self.block_n, BLOCK_K=self.block_k, PREFETCH=self.prefetch)

    def config(self) -> Any:
        return triton.Config(self.kwargs(), num_warps=self.warps, num_stages=self.stages)


# Tiles the autotuner tries. Element-wise, one row only: the float32 accumulator is
# block_n x block_k, 32 registers a thread at 4 warps; sm_90 builds (ptxas) use 56-96 registers, no
# spills (one: 12 bytes, the norm with prefetch at 4 x 1024), 16-byte loads. Dot (any row count,
# padded to 16): software-pipelined weight loads.
ELEMENTWISE_TILES = [
    Tile(8, 512, 4, 3, False),
    Tile(4, 1024, 4, 3, False),
    Tile(16, 256, 4, 3, False),
    Tile(8, 512, 4, 3, False, prefetch=True),
    Tile(2, 2048, 8, 3, False, prefetch=True),
]
DOT_TILES = [Tile(16, 256, 4, 4, True), Tile(32, 256, 4, 3, True), Tile(64, 128, 4, 4, True)]
# What runs untuned (under the interpreter, or off CUDA): one element-wise tile, one small dot tile.
DEFAULT_ELEMENTWISE = ELEMENTWISE_TILES[0]
DEFAULT_DOT = Tile(16, 64, 4, 1, True)


def _configs(rows_pad: int) -> list[Any]:
    tiles = (ELEMENTWISE_TILES if rows_pad == 1 else []) + DOT_TILES
    return [t.config() for t in tiles]


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    # Element-wise tiles take one row; more rows take the dot tiles.
    return _configs(kwargs["M_PAD"])


def _bench(fn: Any, quantiles: Any = None) -> Any:
    # Short: the kernels take 5-60 us; autotuning runs once per shape at start-up.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


_tuned = triton.autotune(
    configs=_configs(1),
    key=["M_PAD", "N", "K", "PROLOGUE", "HAS_RESIDUAL", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
)(_decode_gemv_kernel)


def tuned_tiles() -> list[str]:
    """What the autotuner picked so far, one line per (rows padded, N, K, op) key, for logs."""
    ops = {_PLAIN: "linear", _RMS_NORM: "rms_norm+linear", _SILU_MUL: "silu_mul+linear"}
    lines = []
    for key, cfg in sorted(getattr(_tuned, "cache", {}).items(), key=lambda kv: str(kv[0])):
        m_pad, n, k, prologue = key[:4]
        kw = cfg.kwargs
        kind = "dot" if kw.get("USE_DOT") else "element-wise" + (", prefetch" if kw.get("PREFETCH") else "")
        lines.append(
            f"{ops.get(prologue, prologue)} rows<={m_pad} {n}x{k}: {kw.get('BLOCK_N')}x{kw.get('BLOCK_K')} "
            f"{kind}, {cfg.num_warps} warps"
        )
    return lines


def _autotuned(x: torch.Tensor) -> bool:
    """Whether the autotuner picks the tile: CUDA tensors, outside Triton's interpreter."""
    return x.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "") != "1"


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prologue: int,
    k: int,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    force_tile: Tile | None = None,
) -> torch.Tensor:
    rows = x.shape[0]
    n = weight.shape[0]
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"decode GEMV takes 1..{MAX_ROWS} rows, got {rows}")
    if weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, {k}] with unit column stride")
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    rows_pad = triton.next_power_of_2(rows)
    res = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else x
    args = (
        x,
        res,
        res_out,
        norm_weight if norm_weight is not None else weight,
        weight,
        bias if bias is not None else weight,
        y,
        rows,
        n,
        k,
        x.stride(0),
        res.stride(0),
        res_out.stride(0),
        weight.stride(0),
        y.stride(0),
        eps,
    )
    consts = dict(
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        M_PAD=rows_pad,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **pdl.launch_kwargs(),
    )
    if force_tile is not None or not _autotuned(x):
        tile = force_tile or (DEFAULT_ELEMENTWISE if rows_pad == 1 else DEFAULT_DOT)
        if not tile.dot and rows_pad != 1:
            raise ValueError(f"an element-wise tile takes one row, got {rows}")
        if tile.dot and tile.prefetch:
            raise ValueError("prefetch is for element-wise tiles (the dot tiles' loads are pipelined by num_stages)")
        _decode_gemv_kernel[(triton.cdiv(n, tile.block_n),)](
            *args, **consts, **tile.kwargs(), num_warps=tile.warps, num_stages=tile.stages
        )
    else:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **consts)
    return y


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# Each function takes ``tile``: a fixed ``Tile`` instead of the tuned one, for tests and probes.


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, tile: Tile | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 1..MAX_ROWS rows."""
    x = _unit_stride(x)
    return _launch(x, weight, bias, _PLAIN, x.shape[1], force_tile=tile)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: Tile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(x + residual) * norm_weight, weight, bias), x + residual)``; without a
    residual the second result is ``x`` itself. The sum is a new tensor: the inputs are not written."""
    x = _unit_stride(x)
    residual_out = None
    if residual is not None:
        residual = _unit_stride(residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        residual_out = torch.empty_like(x)
    y = _launch(x, weight, bias, _RMS_NORM, x.shape[1], residual, residual_out, norm_weight, eps, force_tile=tile)
    return y, (residual_out if residual_out is not None else x)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, tile: Tile | None = None
) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)`` with ``gate_up`` ``[T, 2 * I]`` (gate columns first)."""
    gate_up = _unit_stride(gate_up)
    return _launch(gate_up, weight, bias, _SILU_MUL, gate_up.shape[1] // 2, force_tile=tile)
