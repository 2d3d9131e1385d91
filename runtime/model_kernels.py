"""What a device put into a loaded model, as plain values the runner keeps and reports, and the
few-row kernels' interface, which the model calls and a device fills."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# The few-row dense projection a CPU fills (``cpu.ops``): (x [M, K] float32 contiguous, weight [N, K]
# float32 contiguous, bias [N] | None) -> [M, N].
FewRowLinear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# A compiled RMS norm: (x [..., H] contiguous, weight [H], eps) -> [..., H]; float32, or bfloat16 as HF
# rounds it.
NormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


# Residual add + RMS norm in one kernel: (x, residual | None, weight, eps) -> (norm(x + residual), x + residual).
FusedRmsNorm = Callable[
    [torch.Tensor, "torch.Tensor | None", torch.Tensor, float], "tuple[torch.Tensor, torch.Tensor | None]"
]


@dataclass(frozen=True)
class LayerOps:
    """The norm and activation kernels a device builds a model's layers with (``Platform.layer_ops``),
    chosen before the model is built; None where torch's own ops run."""

    rms_norm: NormKernel | None = None  # every RMS norm (CPU: float32, or bfloat16 where it rounds as HF)
    add_rms_norm: FusedRmsNorm | None = None  # the hidden-size norms, with the residual add before them
    silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # SiLU(gate) x up of a SiLU MLP


class KernelHost(Protocol):
    """What a device's ``install_kernels`` gives a loaded model (``models.llama.CausalLM``): the
    base projection method made from each weight, and the fused few-row projections."""

    def use_base_methods(self, make: Callable[[torch.Tensor], Any], keep_weights: bool) -> None: ...

    def use_few_row_kernels(self, kernels: FewRowKernels) -> None: ...


@dataclass
class ModelKernels:
    """Which device kernels ``install_kernels`` put into a model (the runner reports and reuses them)."""

    packed_linears: bool = False  # CPU: projections packed for oneDNN
    few_row_linear: Any = None  # CPU: (few-row dense kernel, its most rows), when used
    fused_ops: bool = False  # CUDA: Triton norms, activation and RoPE
    few_rows: Any = None  # CUDA: the fused few-row projections (``FewRowKernels``)
    few_rows_mode: str = "off"  # CUDA: "on", "auto" (graphs A/B them per size) or "off"
    few_rows_limit: int = 0  # most rows the fused few-row projections take


@dataclass
class FewRowKernels:
    """Projections of a few rows with the op before each fused in (``runtime.cuda.triton_gemv`` on CUDA).

    A forward of at most ``max_rows`` tokens uses them; ``max_rows`` is read at every forward, so the
    CUDA-graph runner can capture each batch size with them (``max_rows >= size``) or without (0).
    """

    # (x, weight, bias) -> F.linear(x, weight, bias)
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # (x, residual | None, norm weight, eps, weight, bias) -> (linear(norm(x + residual)), x + residual)
    rms_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (gate_up [T, 2I], weight, bias) -> linear(silu(gate) * up)
    silu_mul_linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    max_rows: int = 0

    def applies(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows
