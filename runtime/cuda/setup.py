"""The CUDA side of a runner: fused Triton ops and few-row projections installed into a loaded model,
the decode graphs captured once the KV pool exists, and the KV budget measured from device memory."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from servelm.runtime.cuda import pdl
from servelm.runtime.cuda.graphs import CudaGraphRunner
from servelm.runtime.model_kernels import FewRowKernels, KernelHost, LayerOps, ModelKernels

if TYPE_CHECKING:
    import torch

    from servelm.runtime.attention.base import AttentionBackend

log = logging.getLogger(__name__)


class GraphHost(Protocol):
    """What the decode graphs are captured from (``runtime.runner.ModelRunner``)."""

    model: Any
    backend: AttentionBackend
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    block_size: int
    few_rows: FewRowKernels | None
    few_rows_limit: int
    few_rows_mode: str


def layer_ops() -> LayerOps:
    """Triton's residual add + RMS norm and SiLU x up, where ``fused_ops_enabled``."""
    from servelm.runtime.cuda.flash_backend import fused_ops_enabled

    if not fused_ops_enabled():
        return LayerOps()
    from servelm.runtime.cuda import triton_ops

    return LayerOps(add_rms_norm=triton_ops.rms_norm, silu_mul=triton_ops.silu_mul)


def install_kernels(model: KernelHost) -> ModelKernels:
    """The fused few-row projections, as their environment switch asks (``decode_gemv_mode``; the
    model was built with the fused Triton norms and activation where ``fused_ops_enabled``:
    ``layer_ops``)."""
    from servelm.runtime.cuda.flash_backend import decode_gemv_mode, fused_ops_enabled

    kernels = ModelKernels()
    if fused_ops_enabled():
        kernels.fused_ops = True
        kernels.few_rows_mode = decode_gemv_mode()
    if kernels.few_rows_mode != "off":
        from servelm.runtime.cuda import triton_gemv

        # Eager steps use them only when forced; graphs decide per size at capture ("auto").
        forced = kernels.few_rows_mode == "on"
        kernels.few_rows = FewRowKernels(
            triton_gemv.linear,
            triton_gemv.rms_norm_linear,
            triton_gemv.silu_mul_linear,
            max_rows=triton_gemv.MAX_ROWS if forced else 0,
        )
        model.use_few_row_kernels(kernels.few_rows)
        kernels.few_rows_limit = triton_gemv.MAX_ROWS if forced else triton_gemv.AUTO_MAX_ROWS
    return kernels


def capture_decode_graphs(runner: GraphHost, num_blocks: int) -> CudaGraphRunner:
    """Capture the runner's decode graphs (after its pool exists: the graphs read its addresses)."""
    no_pdl = pdl.unavailable_reason(runner.device) if runner.few_rows_limit else "no fused few-row projections"
    if no_pdl is not None:
        log.info("programmatic dependent launch: not tried (%s)", no_pdl)
    graphs = CudaGraphRunner(
        runner.model,
        runner.backend,
        runner.max_num_seqs,
        -(-runner.max_model_len // runner.block_size),
        runner.block_size,
        runner.device,
        few_rows=runner.few_rows,
        few_rows_max=runner.few_rows_limit,
        few_rows_ab=runner.few_rows_mode == "auto",
        pdl=no_pdl is None,
        num_kv_blocks=num_blocks,
        # Batch 1's graph ends with the head (few-row kernel or cuBLAS, as the A/B decides):
        # one kernel less outside it, and the head is part of the PDL chain.
        head=runner.model.compute_logits,
    )
    graphs.capture()
    if runner.few_rows is not None:
        from servelm.runtime.cuda import triton_gemv

        for line in triton_gemv.tuned_tiles():
            log.info("few-row projection tile: %s", line)
    return graphs


def kv_budget_bytes(
    device: torch.device, utilization: float, warm_up: Callable[[], int], scratch_bytes: int, reserve_bytes: int
) -> int:
    """Bytes the KV pool may take within ``utilization`` of the device, measured around ``warm_up``."""
    from servelm.runtime.cuda.memory import kv_budget_bytes as measure

    return measure(utilization, warm_up, device=device, scratch_bytes=scratch_bytes, reserve_bytes=reserve_bytes)
