"""Weight-only int8 quantization for the CPU path (``--quantization int8``).

Why: a decode step of a few rows is a pass over every weight, so on CPU its time is the weight
bytes over the memory bandwidth (538 MB of float32 for the default model: ~20 ms a token here). int8
weights are a quarter of those bytes; ``csrc/cpu_ops.cpp``'s ``linear_small_m_int8`` streams them and
multiplies in float32.

Scheme: symmetric, one float32 scale per output row (``scale = max |w_row| / 127``, ``q = round(w /
scale)`` in [-127, 127]); activations stay float32. Every projection and the vocabulary head are
quantized; the token embedding stays float32 (a lookup reads one row per token, and a tied head gets
its own quantized copy). The float32 weights are then replaced by their dequantized values ``q *
scale``, so the paths for more rows (oneDNN, torch) compute with the same weights as the int8 kernel:
results differ between them only by float32 summation order, as they do unquantized. Tokens do differ
from the float32 model's: this is an approximation the user opts into.
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("int8",)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` int8, ``[N]`` float32 scale), symmetric per row.

    A row of zeros gets scale 1 (and zeros): nothing to represent, and no division by zero."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_rows takes a [N, K] weight, got {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale[:, None]`` in ``dtype``: the weight the quantized model computes with."""
    return (q.float() * scale[:, None]).to(dtype)


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what is not implemented, at start-up, with the reason."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; supported: {', '.join(QUANTIZATIONS)}")
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} is implemented for the CPU path only (device {device})")
    if dtype != torch.float32:
        raise ValueError(f"--quantization {quantization} takes float32 activations: use --dtype float32 (got {dtype})")
