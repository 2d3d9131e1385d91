"""Choosing the attention backend for a device, once at start-up."""

from __future__ import annotations

import logging

import torch

from servelm.runtime.attention.base import AttentionBackend

log = logging.getLogger(__name__)


def select_backend(
    device: torch.device | str,
    *,
    block_size: int,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    use_cpu_kernel: bool = True,
) -> AttentionBackend:
    """CUDA: FlashAttention when it can serve (installed, fp16/bf16, head_dim, ``block_size``), else
    the Triton paged fallback with a warning saying why. CPU: ``TorchAttentionBackend`` (the C++ decode
    kernel when it builds, unless ``use_cpu_kernel`` is False). ``dtype``/``head_dim`` refine the CUDA
    check when given. CUDA-only packages are never imported on a CPU start.
    """
    device = torch.device(device)
    backend: AttentionBackend
    if device.type == "cuda":
        # Importing flash_backend imports neither flash_attn nor triton; constructing a backend does.
        from servelm.runtime.cuda.flash_backend import FlashAttentionBackend, TritonPagedBackend

        if dtype is not None and head_dim is not None:
            why_not = FlashAttentionBackend.supports(dtype, head_dim, block_size)
        else:
            why_not = FlashAttentionBackend.supports(torch.bfloat16, 128, block_size)
        flash: AttentionBackend | None = None
        if why_not is None:
            try:
                flash = FlashAttentionBackend(block_size)
            except Exception as exc:  # installed but not loadable: built for another torch / CUDA, say
                why_not = f"it is installed but does not load: {type(exc).__name__}: {exc}"
        if flash is None:
            log.warning("not using flash-attn (%s); using the Triton paged-attention fallback", why_not)
        backend = flash if flash is not None else TritonPagedBackend(block_size)
    elif device.type == "cpu":
        from servelm.runtime.cpu.torch_backend import TorchAttentionBackend

        backend = TorchAttentionBackend(block_size, use_kernel=use_cpu_kernel)
    else:
        raise ValueError(f"unsupported device {device}; expected cpu or cuda")
    log.info("attention backend: %s on %s (block size %d)", backend.name, device, block_size)
    return backend
