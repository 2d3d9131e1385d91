"""What differs by device, as one interface: each device's ``Platform`` (``runtime/cpu/platform.py``,
``runtime/cuda/platform.py``) answers it, and ``runtime.platform.platform_of`` says which one runs.

Code outside ``runtime/cpu`` and ``runtime/cuda`` asks its device's platform and never branches on
the device itself. The base class holds the answers of a device with none of the extras (no compiled
kernels, no graphs, memory that cannot be handed back piecewise); a platform overrides what it has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from servelm.runtime.attention.base import AttentionBackend
from servelm.runtime.model_kernels import KernelHost, LayerOps, ModelKernels


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


class Platform:
    """One device kind's defaults, kernels and memory; ``runtime.platform.platform_of`` picks it."""

    name = "none"
    default_dtype: torch.dtype = torch.float32  # the weights' dtype when ``auto``
    distributed_backend = "gloo"  # torch.distributed's backend between processes on this device
    # Whether tensor parallelism has run here (a platform where it never has refuses it).
    tensor_parallel_proven = False
    serves_gemma = False  # Gemma's sliding windows and norms have a path here
    quantization = False  # ``--quantization`` (weight-only int8/int4) has kernels here
    # torch's argmax is a scalar loop here, which a vectorised max of blocks beats.
    scalar_argmax = False
    # A step's results go to pinned host memory without blocking, waited on by ``results_ready_event``.
    copies_results_async = False
    # The ``sys.setswitchinterval`` a server here runs with; None keeps Python's default.
    gil_switch_interval: float | None = None
    # Most rows for which dense torch splits the gate/up projection, and computes the head as W @ h^T.
    small_batch_splits: tuple[int, int] = (0, 0)

    def defaults(self, dtype: torch.dtype, head_dim: int) -> DeviceDefaults:
        """The defaults for serving a model of ``head_dim`` in ``dtype`` here."""
        raise NotImplementedError(f"no defaults for {self.name}")

    def host_to_device(
        self,
        values: Sequence[int] | Sequence[float] | torch.Tensor,
        device: torch.device,
        dtype: torch.dtype = torch.int64,
    ) -> torch.Tensor:
        """Host values (a list, or a CPU tensor) on ``device``, without waiting for it where it can."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        return t.to(device)

    def token_bitmask_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
        """The compiled ``apply_token_bitmask(logits, rows, bitmask)`` for float32 logits, or None."""
        return None

    def attention_backend(
        self, *, block_size: int, dtype: torch.dtype | None, head_dim: int | None, use_cpu_kernel: bool
    ) -> AttentionBackend:
        """The paged attention this device runs."""
        raise ValueError(f"unsupported device {self.name}; expected cpu or cuda")

    def kv_dtype_supported(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether attention reads a KV cache of ``kv_dtype`` under ``dtype`` weights."""
        return kv_dtype == dtype

    def quantized_kernels(self) -> dict[str, Any]:
        """The quantized projection kernels by format (``--quantization``); none by default."""
        return {}

    def projection_product(self, x: torch.Tensor, weight: torch.Tensor) -> Callable[[], object]:
        """``x @ weight.T`` as this device's projections compute it, ready to run again and again (the
        roofline's FLOP/s probe)."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        wt = weight.t()
        return lambda: torch.matmul(x, wt, out=out)

    def gguf_kernel(self, qtype: Any) -> Any:
        """The compiled module that multiplies GGUF blocks of ``qtype`` as stored, or None (the
        dequantize-a-tile path serves every format)."""
        return None

    def layer_ops(self, dtype: torch.dtype) -> LayerOps:
        """The norm and activation kernels a model in ``dtype`` is built with here (none: torch's)."""
        return LayerOps()

    def install_kernels(self, model: KernelHost, dtype: torch.dtype, quant_rows: int) -> ModelKernels:
        """Put this device's kernels into a loaded (and quantized) model."""
        return ModelKernels()

    def capture_decode_graphs(self, runner: Any, num_blocks: int) -> Any:
        """The runner's captured decode graphs, or None where there are none."""
        return None

    def zeroed_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero-filled tensor for the KV pool."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def page_forgetter(self) -> Callable[[int, int], None] | None:
        """What hands a ``zeroed_pool``'s pages back to the system by address range (None: its memory
        cannot be handed back piecewise)."""
        return None

    def release_cached_memory(self) -> None:
        """Hand the allocator's cached blocks back to the device (after a scratch step, before the pool)."""

    def kv_budget_bytes(
        self,
        device: torch.device,
        utilization: float,
        warm_up: Callable[[], int],
        scratch_bytes: int,
        reserve_bytes: int,
    ) -> int:
        """Bytes the KV pool may take within ``utilization`` of the device's memory."""
        raise NotImplementedError(f"{self.name} does not size the KV pool from device memory")

    def lora_kernel(self) -> Any:
        """The compiled LoRA op, or None where there is none."""
        return None

    def results_ready_event(self, device: torch.device) -> Any:
        """An event recorded after the copies queued so far on ``device`` (see ``copies_results_async``)."""
        raise NotImplementedError(f"{self.name} copies results synchronously")

    def synchronize(self, device: torch.device) -> None:
        """Wait for the work queued on ``device`` (timing code)."""
