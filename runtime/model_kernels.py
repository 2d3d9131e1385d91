"""What a device put into a loaded model, as a plain value the runner keeps and reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ModelKernels:
    """Which device kernels ``install_kernels`` put into a model (the runner reports and reuses them)."""

    packed_linears: bool = False  # CPU: projections packed for oneDNN
    small_m_linear: Any = None  # CPU: (few-row dense kernel, its most rows), when used
    fused_ops: bool = False  # CUDA: Triton norms, activation and RoPE
    few_rows: Any = None  # CUDA: the fused few-row projections (``FewRowKernels``)
    few_rows_mode: str = "off"  # CUDA: "on", "auto" (graphs A/B them per size) or "off"
    few_rows_limit: int = 0  # most rows the fused few-row projections take
