"""The CUDA platform: FlashAttention (or Triton), captured decode graphs, a KV pool sized from device
memory, results copied back without blocking. CUDA-only packages are imported only when used."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from servelm.runtime.attention.base import AttentionBackend
from servelm.runtime.model_kernels import KernelHost, LayerOps, ModelKernels
from servelm.runtime.platform_interface import DeviceDefaults, Platform

# Memory kept out of the KV budget for the decode graphs' private pool (outputs and intermediates of
# the largest captured batch, shared by all sizes).
CUDA_GRAPH_RESERVE_BYTES = 2**28
# The GIL switch interval of a server driving a GPU. The engine thread releases the GIL in every CUDA
# call (staging copies, graph replay, event waits) and at Python's default 5 ms may then wait that long
# for the HTTP thread, which is busy writing hundreds of streams; the GPU idles meanwhile (the A/B on
# an H200 is in docs/cuda.md).
CUDA_SWITCH_INTERVAL_S = 2e-4


class CudaPlatform(Platform):
    name = "cuda"
    default_dtype = torch.bfloat16
    distributed_backend = "nccl"
    # NCCL is chosen for CUDA, but no CUDA run has ever checked tensor parallelism.
    tensor_parallel_proven = False
    copies_results_async = True
    gil_switch_interval = CUDA_SWITCH_INTERVAL_S

    def defaults(self, dtype: torch.dtype, head_dim: int) -> DeviceDefaults:
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

    def host_to_device(
        self,
        values: Sequence[int] | Sequence[float] | torch.Tensor,
        device: torch.device,
        dtype: torch.dtype = torch.int64,
    ) -> torch.Tensor:
        """``torch.tensor(values, device=...)`` copies from pageable memory and then synchronises the
        stream: the host would wait for the step's forward, which the engine overlaps with its own work
        when it schedules ahead. A copy from pinned memory is queued behind that work instead."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(device, non_blocking=True)

    def attention_backend(
        self, *, block_size: int, dtype: torch.dtype | None, head_dim: int | None, use_cpu_kernel: bool
    ) -> AttentionBackend:
        """FlashAttention, else the Triton paged fallback (``flash_backend.select_cuda_backend``)."""
        # Importing flash_backend imports neither flash_attn nor triton; constructing a backend does.
        from servelm.runtime.cuda.flash_backend import select_cuda_backend

        return select_cuda_backend(block_size, dtype, head_dim)

    def layer_ops(self, dtype: torch.dtype) -> LayerOps:
        """The fused Triton norms and activation (``cuda.setup.layer_ops``)."""
        from servelm.runtime.cuda import setup

        return setup.layer_ops()

    def install_kernels(self, model: KernelHost, dtype: torch.dtype, quant_rows: int) -> ModelKernels:
        """Fused Triton ops and few-row projections (``cuda.setup``)."""
        from servelm.runtime.cuda import setup

        return setup.install_kernels(model)

    def capture_decode_graphs(self, runner: Any, num_blocks: int) -> Any:
        from servelm.runtime.cuda import setup

        return setup.capture_decode_graphs(runner, num_blocks)

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def kv_budget_bytes(
        self,
        device: torch.device,
        utilization: float,
        warm_up: Callable[[], int],
        scratch_bytes: int,
        reserve_bytes: int,
    ) -> int:
        from servelm.runtime.cuda.memory import kv_budget_bytes as measure

        return measure(utilization, warm_up, device=device, scratch_bytes=scratch_bytes, reserve_bytes=reserve_bytes)

    def results_ready_event(self, device: torch.device) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
