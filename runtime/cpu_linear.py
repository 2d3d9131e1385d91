"""CPU matmuls through oneDNN with weights reordered once at load time.

Why: on this project's CPUs (AMD EPYC, AVX-512) ``F.linear`` goes to MKL's sgemm, which streams the
weights at ~12 GB/s and reaches ~65-120 GFLOP/s at 8-32 rows. The same products through oneDNN on a
weight reordered into its blocked layout once (``torch.ops.mkldnn._reorder_linear_weight``, the call
Inductor's CPU freezing pass uses) read memory at ~20-30 GB/s and reach ~170-210 GFLOP/s
(``scripts/bench_linear.py`` prints both on the default model's shapes). The packed tensor is opaque
(``torch._mkldnn`` layout): only ``linear`` below may consume it.

Results differ from ``F.linear`` only by summation order (~1e-6 relative in float32).
``SERVELM_CPU_LINEAR=torch`` switches packing off (for comparisons and as an escape hatch).
"""

from __future__ import annotations

import os

import torch

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """True when weights of ``dtype`` can be packed for oneDNN on this build and CPU."""
    if os.environ.get("SERVELM_CPU_LINEAR", "onednn").lower() == "torch":
        return False
    if dtype not in _SUPPORTED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` dense weight -> an opaque oneDNN weight for ``linear`` (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in] @ W^T (+ bias)`` with ``W`` packed by ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
