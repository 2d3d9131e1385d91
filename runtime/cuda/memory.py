"""Sizing the KV pool from GPU memory: what ``gpu_memory_utilization`` leaves after weights and activations.

Measured, not estimated: after the weights are loaded, one warm-up forward at the largest step
the scheduler can build (``max_num_batched_tokens``, logits for ``max_num_seqs`` rows) shows the
activation peak; memory outside torch's allocator (CUDA context, cuBLAS workspaces, other
processes) is read from the driver. The pool gets the rest of the allowed fraction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MiB = 2**20


class GpuMemoryError(RuntimeError):
    """The allowed fraction of GPU memory leaves nothing for the KV pool."""


@dataclass(frozen=True)
class MemoryProfile:
    """What one warm-up forward showed (bytes)."""

    total: int  # device memory
    torch_peak: int  # peak allocated by torch: weights + the warm-up's activations
    non_torch: int  # used on the device outside torch's allocator (context, workspaces, other processes)
    scratch: int  # part of the peak the warm-up allocated temporarily and the pool replaces (e.g. a scratch KV)

    def kv_budget(self, gpu_memory_utilization: float, reserve_bytes: int = 0) -> int:
        """Bytes left for the KV pool inside ``gpu_memory_utilization`` of the device."""
        allowed = int(self.total * gpu_memory_utilization)
        return allowed - (self.torch_peak - self.scratch) - self.non_torch - reserve_bytes

    def describe(self, gpu_memory_utilization: float, reserve_bytes: int = 0) -> str:
        return (
            f"GPU {self.total / MiB:.0f} MiB x {gpu_memory_utilization:.2f}: torch peak "
            f"{(self.torch_peak - self.scratch) / MiB:.0f} MiB (weights + activations), outside torch "
            f"{self.non_torch / MiB:.0f} MiB, reserved {reserve_bytes / MiB:.0f} MiB -> KV "
            f"{self.kv_budget(gpu_memory_utilization, reserve_bytes) / MiB:.0f} MiB"
        )


def profile_memory(
    warmup_fn: Callable[[], object], device: torch.device | None = None, scratch_bytes: int = 0
) -> MemoryProfile:
    """Run ``warmup_fn`` once and read the peaks (weights must already be on the device)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warmup_fn()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    # Everything in use that torch's caching allocator does not hold.
    non_torch = max(0, (total - free) - reserved)
    # Hand the warm-up's cached blocks back before the pool (one large allocation) is made.
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, torch_peak=peak, non_torch=non_torch, scratch=scratch_bytes)


def kv_budget_bytes(
    gpu_memory_utilization: float,
    warmup_fn: Callable[[], object],
    *,
    device: torch.device | None = None,
    scratch_bytes: int = 0,
    reserve_bytes: int = 0,
) -> int:
    """Bytes the KV pool may take: ``gpu_memory_utilization`` x device memory, minus weights, the
    warm-up's activation peak, memory outside torch, and ``reserve_bytes`` (e.g. for CUDA graphs).

    Raises ``GpuMemoryError`` when nothing is left.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    prof = profile_memory(warmup_fn, device, scratch_bytes)
    budget = prof.kv_budget(gpu_memory_utilization, reserve_bytes)
    log.info("%s", prof.describe(gpu_memory_utilization, reserve_bytes))
    if budget <= 0:
        raise GpuMemoryError(
            f"no GPU memory left for the KV cache: {prof.describe(gpu_memory_utilization, reserve_bytes)}; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller model"
        )
    return budget
