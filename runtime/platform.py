"""The one seam per device: the only module outside ``runtime/cpu`` and ``runtime/cuda`` that asks
which device this is.

Everything above the runtime (the scheduler, the server) gets what differs by device from here, as
plain values, and never branches on ``device.type`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# CPU: the KV pool's size when none is given (there is no device memory to size it from).
CPU_DEFAULT_KV_MEMORY = 2 * 2**30
CPU_DEFAULT_BLOCK_SIZE = 16
# CUDA: memory kept out of the KV budget for the decode graphs' private pool (outputs and
# intermediates of the largest captured batch, shared by all sizes).
CUDA_GRAPH_RESERVE_BYTES = 2**28


@dataclass(frozen=True)
class DeviceDefaults:
    """What the engine takes from the device when the configuration leaves it open."""

    max_num_batched_tokens: int
    block_size: int
    # None: sized from the device memory the weights leave (``sizes_kv_from_memory``).
    kv_cache_memory: int | None
    # Weights are loaded before the pool, which is then sized from what is left, and the largest step
    # runs once at start-up (it measures the activation peak and compiles the step's kernels).
    sizes_kv_from_memory: bool
    # The forward runs in the background, so scheduling one step ahead overlaps host work with it.
    async_scheduling: bool
    # The attention backend implements sliding windows (elsewhere the context is capped at the window).
    sliding_window: bool
    # Memory kept out of the KV budget for captured graphs (0 where there are none).
    graph_reserve_bytes: int


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else CPU; a bare ``cuda`` becomes the current CUDA device."""
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto_device if name == "auto" else name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """The weights' dtype when ``auto``: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def device_defaults(device: torch.device, dtype: torch.dtype, head_dim: int) -> DeviceDefaults:
    """The defaults for serving a model of ``head_dim`` in ``dtype`` on ``device``."""
    if device.type == "cuda":
        # FlashAttention's paged KV wants large pages; the attention code knows which.
        from servelm.runtime.cuda.flash_backend import default_cuda_block_size

        return DeviceDefaults(
            max_num_batched_tokens=8192,
            block_size=default_cuda_block_size(dtype, head_dim),
            kv_cache_memory=None,
            sizes_kv_from_memory=True,
            async_scheduling=True,
            sliding_window=False,
            graph_reserve_bytes=CUDA_GRAPH_RESERVE_BYTES,
        )
    return DeviceDefaults(
        max_num_batched_tokens=512,
        block_size=CPU_DEFAULT_BLOCK_SIZE,
        kv_cache_memory=CPU_DEFAULT_KV_MEMORY,
        sizes_kv_from_memory=False,
        async_scheduling=False,
        sliding_window=True,
        graph_reserve_bytes=0,
    )


def host_to_device(
    values: Sequence[int] | Sequence[float] | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) on ``device`` without waiting for it.

    On a GPU, ``torch.tensor(values, device=...)`` copies from pageable memory and then synchronises
    the stream: the host would wait for the step's forward, which the engine overlaps with its own
    work when it schedules ahead. A copy from pinned memory is queued behind that work instead.
    """
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def has_scalar_argmax(device: torch.device) -> bool:
    """Whether torch's argmax on ``device`` is a scalar loop (the CPU's), which a vectorised max of blocks beats."""
    return device.type == "cpu"


def token_bitmask_kernel(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """The compiled ``apply_token_bitmask(logits, rows, bitmask)`` for float32 logits on ``device``, or None."""
    if device.type != "cpu":
        return None
    from servelm.runtime.cpu import ops  # (not at import: only a CPU process loads the CPU kernels)

    return ops.token_bitmask_kernel()
