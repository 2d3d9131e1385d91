"""The CPU's kernels installed into a loaded model: oneDNN-packed projections, the few-row kernel,
the compiled RMSNorm and the fused residual-add + norm and SiLU x up ops."""

from __future__ import annotations

from typing import Any

import torch

from servelm.runtime.cpu import linear as cpu_linear
from servelm.runtime.cpu import ops as cpu_ops
from servelm.runtime.cpu.packed import packed_methods
from servelm.runtime.model_kernels import ModelKernels


def install_kernels(model: Any, dtype: torch.dtype, quant_rows: int) -> ModelKernels:
    """Pack the dense projections for oneDNN where this torch build can, and route norms and
    activations through the compiled ops; ``quant_rows``: the rows a quantized kernel already serves."""
    packed = cpu_linear.onednn_linear_available(dtype)
    small_m = None
    if packed:
        # With a quantized kernel serving few-row steps, the dense float copies are not needed.
        small_m = None if quant_rows else cpu_linear.small_m_kernel(dtype)
        model.use_base_methods(packed_methods(small_m), keep_weights=small_m is not None)
    rms_norm = cpu_ops.rms_norm_kernel() if dtype in (torch.float32, torch.bfloat16) else None
    if rms_norm is not None:
        model.use_cpu_rms_norm(rms_norm)
    fused = cpu_ops.fused_ops() if dtype == torch.float32 else None
    if fused is not None:
        # One compiled call for each residual add + norm and for SiLU x up: same values, fewer calls.
        model.use_fused_ops(*fused)
    return ModelKernels(packed_linears=packed, small_m_linear=small_m)
