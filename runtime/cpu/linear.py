"""CPU matmuls through oneDNN with weights reordered once at load time.

Why: on this project's CPUs (AMD EPYC, AVX-512) ``F.linear`` goes to MKL's sgemm, which streams the
weights at ~12 GB/s and reaches ~65-120 GFLOP/s at 8-32 rows. The same products through oneDNN on a
weight reordered into its blocked layout once (``torch.ops.mkldnn._reorder_linear_weight``, the call
Inductor's CPU freezing pass uses) read memory at ~20-30 GB/s and reach ~170-210 GFLOP/s
(``scripts/bench_linear.py`` prints both on the default model's shapes). The packed tensor is opaque
(``torch._mkldnn`` layout): only ``linear`` below may consume it.

A step of one to four rows (decode at low concurrency, the vocabulary head of a prefill step) is a
pure pass over the weights; there ``csrc/cpu_ops.cpp`` (``runtime.cpu.ops``) streams the dense float32 weight at
~30 GB/s where oneDNN reaches ~20. Using it means keeping the dense weight beside the packed one
(+425 MB for the default model's layers; the tied head's dense copy is the embedding anyway).

Results differ from ``F.linear`` only by summation order (~1e-6 relative in float32).
``SERVELM_CPU_LINEAR=torch`` switches both off (comparisons, escape hatch); ``=onednn`` keeps oneDNN
but not the small-batch kernel (lower memory).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from servelm.runtime.cpu import ops as cpu_ops
from servelm.runtime.cpu.ops import FewRowLinearInt8
from servelm.runtime.model_kernels import FewRowLinear

__all__ = [
    "ENV",
    "FewRowLinear",
    "few_row_int8_kernel",
    "few_row_kernel",
    "linear",
    "onednn_linear_available",
    "pack",
    "quantized_kernels",
]

ENV = "SERVELM_CPU_LINEAR"  # "auto" (default) | "onednn" | "torch"

# Small-batch matmul shapes that MKL's sgemm handles badly (measured with scripts/bench_runner.py's
# setup): the fused gate/up projection is faster as two matmuls at a few rows (up to 25% at 4-8 rows),
# and the vocabulary projection of a few rows is faster as W @ h^T than as h @ W^T (up to 45% at 4
# rows). Fixed when the model is built (``CpuPlatform.small_batch_splits``), so forward() never asks the
# device. Only used when the weights are not packed for oneDNN (``pack``), faster than either.
SPLIT_GATE_UP_MAX_ROWS = 16
TALL_SKINNY_HEAD_MAX_ROWS = 8


def _mode() -> str:
    return os.environ.get(ENV, "auto").strip().lower() or "auto"


_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """True when weights of ``dtype`` can be packed for oneDNN on this build and CPU."""
    if _mode() == "torch":
        return False
    if dtype not in _SUPPORTED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` dense weight -> an opaque oneDNN weight for ``linear`` (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in] @ W^T (+ bias)`` with ``W`` packed by ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")


def few_row_kernel(dtype: torch.dtype = torch.float32) -> tuple[FewRowLinear, int] | None:
    """The compiled few-row projection for ``dtype`` weights and the most rows it takes, or None.

    float32 needs AVX-512, bfloat16 AVX512-BF16. None where ``runtime.cpu.ops`` cannot be built or
    the CPU lacks those, or when ``SERVELM_CPU_LINEAR`` is ``onednn`` or ``torch``. Never raises.
    """
    if _mode() != "auto" or dtype not in (torch.float32, torch.bfloat16):
        return None
    module = cpu_ops.load_avx512()
    if module is None or (dtype == torch.bfloat16 and not module.has_avx512_bf16):
        return None
    return module.linear_few_row, int(module.max_rows)


def few_row_int8_kernel() -> tuple[FewRowLinearInt8, int] | None:
    """The compiled few-row projection over int8 weights (``--quantization int8``) and its row limit,
    or None (as ``few_row_kernel``: no AVX-512, no build, or ``SERVELM_CPU_LINEAR`` set). Never raises."""
    if _mode() != "auto":
        return None
    module = cpu_ops.load_avx512()
    if module is None:
        return None
    return module.linear_few_row_int8, int(module.int8_max_rows)


def quantized_kernels() -> dict[str, tuple[Callable[..., torch.Tensor], int]]:
    """The compiled few-row kernels of the quantized schemes (``runtime.quantization``), by scheme, with
    their row limit: per-row int8, int4 groups, int8 groups. Empty where ``few_row_int8_kernel`` is None."""
    int8 = few_row_int8_kernel()
    module = cpu_ops.load_avx512()
    if int8 is None or module is None:
        return {}
    rows = int(module.int8_max_rows)
    return {
        "int8": int8,
        "int4": (module.linear_few_row_int4, rows),
        "int8_groups": (module.linear_few_row_int8_grouped, rows),
    }
