"""The CPU platform: compiled C++ kernels where they build, a fixed KV pool in lazily zeroed pages."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from servelm.runtime.attention.base import AttentionBackend
from servelm.runtime.model_kernels import KernelHost, LayerOps, ModelKernels
from servelm.runtime.platform_interface import DeviceDefaults, Platform

log = logging.getLogger(__name__)

# The KV pool's size when none is given (there is no device memory to size it from).
CPU_DEFAULT_KV_MEMORY = 2 * 2**30
CPU_DEFAULT_BLOCK_SIZE = 16


class CpuPlatform(Platform):
    name = "cpu"
    default_dtype = torch.float32
    distributed_backend = "gloo"
    tensor_parallel_proven = True
    serves_gemma = True
    quantization = True
    scalar_argmax = True

    def __init__(self) -> None:
        from servelm.runtime.cpu import linear

        self.small_batch_splits = (linear.SPLIT_GATE_UP_MAX_ROWS, linear.TALL_SKINNY_HEAD_MAX_ROWS)

    def defaults(self, dtype: torch.dtype, head_dim: int) -> DeviceDefaults:
        return DeviceDefaults(
            max_num_batched_tokens=512,
            block_size=CPU_DEFAULT_BLOCK_SIZE,
            kv_cache_memory=CPU_DEFAULT_KV_MEMORY,
            sizes_kv_from_memory=False,
            async_scheduling=False,
            sliding_window=True,
            graph_reserve_bytes=0,
        )

    def token_bitmask_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
        from servelm.runtime.cpu import ops

        return ops.token_bitmask_kernel()

    def attention_backend(
        self, *, block_size: int, dtype: torch.dtype | None, head_dim: int | None, use_cpu_kernel: bool
    ) -> AttentionBackend:
        """``TorchAttentionBackend``: the C++ decode kernel when it builds, unless ``use_cpu_kernel`` is False."""
        from servelm.runtime.cpu.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(block_size, use_kernel=use_cpu_kernel)

    def kv_dtype_supported(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """The weights' own, or a 16-bit cache under float32 weights (the paged kernel widens it)."""
        return kv_dtype == dtype or (dtype == torch.float32 and kv_dtype in (torch.bfloat16, torch.float16))

    def quantized_kernels(self) -> dict[str, Any]:
        from servelm.runtime.cpu import linear

        return linear.quantized_kernels()

    def projection_product(self, x: torch.Tensor, weight: torch.Tensor) -> Callable[[], object]:
        """oneDNN on a packed copy of the weight, as the engine's float32 projections run, where it builds."""
        from servelm.runtime.cpu import linear

        if not linear.onednn_linear_available(x.dtype):
            return super().projection_product(x, weight)
        packed = linear.pack(weight)
        return lambda: linear.linear(x, packed, None)

    def gguf_kernel(self, qtype: Any) -> Any:
        """``cpu.gguf_kernels`` where it builds and serves ``qtype``."""
        from servelm.runtime.cpu import gguf_kernels

        return gguf_kernels.load() if qtype in gguf_kernels.KERNEL_TYPES else None

    def layer_ops(self, dtype: torch.dtype) -> LayerOps:
        """The compiled RMS norm (float32, or bfloat16 as HF rounds it), and for float32 the residual
        add + norm and SiLU x up in one call each: same values, fewer calls (``cpu.ops``)."""
        from servelm.runtime.cpu import ops

        rms_norm = ops.rms_norm_kernel() if dtype in (torch.float32, torch.bfloat16) else None
        fused = ops.fused_ops() if dtype == torch.float32 else None
        return LayerOps(rms_norm, *(fused or (None, None)))

    def install_kernels(self, model: KernelHost, dtype: torch.dtype, quant_rows: int) -> ModelKernels:
        """Packing for oneDNN and the compiled norm and fused ops (``cpu.setup``)."""
        from servelm.runtime.cpu import setup

        return setup.install_kernels(model, dtype, quant_rows)

    def zeroed_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Pages become resident as they are written (``cpu.memory.lazily_zeroed``)."""
        from servelm.runtime.cpu.memory import lazily_zeroed

        return lazily_zeroed(shape, dtype)

    def page_forgetter(self) -> Callable[[int, int], None] | None:
        from servelm.runtime.cpu.memory import forget

        return forget

    def lora_kernel(self) -> Any:
        from servelm.runtime.cpu import ops

        return ops.lora_kernel()
