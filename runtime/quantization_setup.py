"""Applying ``--quantization`` at start-up: refusing what this device cannot run, and ``auto``'s choice.

The quantization math and the weights' formats are ``runtime.quantization``'s; what a device can run
is ``runtime.platform``'s.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from servelm.runtime.platform import platform_of
from servelm.runtime.quantization import AUTO, GROUP, NONE, QUANTIZATIONS, QuantizedKernel

log = logging.getLogger(__name__)


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what is not implemented, at start-up, with the reason."""
    if quantization is None or quantization in (AUTO, NONE):
        return  # auto decides at load time, and says no where int4 cannot run
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; supported: {', '.join(QUANTIZATIONS)}")
    if not platform_of(device).quantization:
        raise ValueError(f"--quantization {quantization} is implemented for the CPU path only (device {device})")
    if dtype != torch.float32:
        raise ValueError(f"--quantization {quantization} takes float32 activations: use --dtype float32 (got {dtype})")


def quantize_model(
    model: Any,
    quantization: str | None,
    kernels: dict[str, tuple[QuantizedKernel, int]],
    device: torch.device,
    dtype: torch.dtype,
    widths: list[int],
) -> str | None:
    """Apply ``--quantization`` to a loaded ``CausalLM`` (before packing); returns what runs: ``"int8"``,
    ``"int4"`` or None. ``kernels``: ``cpu_linear.quantized_kernels()`` (empty: the quantized weights run
    dequantized). ``auto`` takes int4 only where it is exact for these weights and can run on its
    kernels (CPU, float32), and says in the log which it took and why."""
    if quantization is None or quantization == NONE:
        return None
    if quantization != AUTO:
        if not kernels:
            log.warning(
                "--quantization %s: the quantized kernels are unavailable here (no AVX-512, no compiler, or "
                "SERVELM_CPU_LINEAR set), so the quantized weights run dequantized: same tokens, no speed-up",
                quantization,
            )
        model.quantize(quantization, kernels)
        return quantization
    if not platform_of(device).quantization or dtype != torch.float32:
        log.info("--quantization auto: no quantization (it is for CPU float32; here %s %s)", device, dtype)
        return None
    if not kernels or any(k % GROUP for k in widths):
        why = "no quantized kernels here" if not kernels else f"input widths {widths} not all multiples of {GROUP}"
        log.info("--quantization auto: no quantization (%s)", why)
        return None
    try:
        off_grid = model.quantize_if_exact(kernels)
    except ValueError as e:  # e.g. a weight beyond float16's range: not int4's grid either
        off_grid = str(e)
    if off_grid is not None:
        log.info("--quantization auto: float32 weights (int4 would not be exact: %s is off its grid)", off_grid)
        return None
    log.info("--quantization auto: int4, exact for these weights (every projection and the head on its grid)")
    return "int4"
