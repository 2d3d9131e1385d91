"""The CPU's kernels installed into a loaded model: oneDNN-packed projections, the few-row kernel,
the compiled RMSNorm and the fused residual-add + norm and SiLU x up ops."""

from __future__ import annotations

import torch

from servelm.runtime.cpu import linear as cpu_linear
from servelm.runtime.cpu.packed import packed_methods
from servelm.runtime.model_kernels import KernelHost, ModelKernels


def install_kernels(model: KernelHost, dtype: torch.dtype, quant_rows: int) -> ModelKernels:
    """Pack the dense projections for oneDNN where this torch build can (the norms and activations
    were built with the compiled ops: ``CpuPlatform.layer_ops``); ``quant_rows``: the rows a quantized
    kernel already serves."""
    packed = cpu_linear.onednn_linear_available(dtype)
    few_row = None
    if packed:
        # With a quantized kernel serving few-row steps, the dense float copies are not needed.
        few_row = None if quant_rows else cpu_linear.few_row_kernel(dtype)
        model.use_base_methods(packed_methods(few_row), keep_weights=few_row is not None)
    return ModelKernels(packed_linears=packed, few_row_linear=few_row)
