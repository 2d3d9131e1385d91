"""CPU matmuls through oneDNN with weights reordered once at load time.

Why: on this project's CPUs (AMD EPYC, AVX-512) ``F.linear`` goes to MKL's sgemm, which streams the
weights at ~12 GB/s and reaches ~65-120 GFLOP/s at 8-32 rows. The same products through oneDNN on a
weight reordered into its blocked layout once (``torch.ops.mkldnn._reorder_linear_weight``, the call
Inductor's CPU freezing pass uses) read memory at ~20-30 GB/s and reach ~170-210 GFLOP/s
(``scripts/bench_linear.py`` prints both on the default model's shapes). The packed tensor is opaque
(``torch._mkldnn`` layout): only ``linear`` below may consume it.

A step of one to four rows (decode at low concurrency, the vocabulary head of a prefill step) is a
pure pass over the weights; there ``csrc/small_m_linear_cpu.cpp`` streams the dense float32 weight at
~30 GB/s where oneDNN reaches ~20. Using it means keeping the dense weight beside the packed one
(+425 MB for the default model's layers; the tied head's dense copy is the embedding anyway).

Results differ from ``F.linear`` only by summation order (~1e-6 relative in float32).
``SERVELM_CPU_LINEAR=torch`` switches both off (comparisons, escape hatch); ``=onednn`` keeps oneDNN
but not the small-batch kernel (lower memory).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from runtime.cpu_extension import CompiledExtension

log = logging.getLogger(__name__)

ENV = "SERVELM_CPU_LINEAR"  # "auto" (default) | "onednn" | "torch"
SMALL_M_SOURCE = Path(__file__).parent / "csrc" / "small_m_linear_cpu.cpp"

# (x [M, K] float32 contiguous, weight [N, K] float32 contiguous, bias [N] | None) -> [M, N]
SmallMLinear = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


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
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` dense weight -> an opaque oneDNN weight for ``linear`` (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in] @ W^T (+ bias)`` with ``W`` packed by ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")


def _check_small_m(module: ModuleType) -> str | None:
    if not module.has_avx512:
        return "built without AVX-512"
    gen = torch.Generator().manual_seed(0)
    for rows, k, bias in ((1, 64, False), (3, 40, True), (4, 200, False)):
        w = torch.randn(37, k, generator=gen)
        x = torch.randn(rows, k, generator=gen)
        b = torch.randn(37, generator=gen) if bias else None
        if not torch.allclose(module.linear_small_m(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5):
            return f"self-check failed (rows {rows}, K {k}, bias {bias})"
    return None


_small_m = CompiledExtension(
    "CPU small-batch linear kernel", "servelm_small_m_linear", lambda: SMALL_M_SOURCE, _check_small_m, log
)


def small_m_kernel() -> tuple[SmallMLinear, int] | None:
    """The compiled few-row float32 projection and the most rows it takes, or None. Never raises.

    Built on first use (cached under ``$SERVELM_CACHE/torch_extensions``); None where it cannot be
    built, the CPU lacks AVX-512, or ``SERVELM_CPU_LINEAR`` is ``onednn`` or ``torch``.
    """
    if _mode() != "auto":
        return None
    module = _small_m.get()
    if module is None:
        return None
    return module.linear_small_m, int(module.max_rows)
