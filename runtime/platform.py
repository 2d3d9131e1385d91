"""The one seam per device: the only module outside ``runtime/cpu`` and ``runtime/cuda`` that asks
which device this is.

Everything above the runtime (the scheduler, the server) gets what differs by device from here, as
plain values, and never branches on ``device.type`` itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from servelm.runtime.attention.base import AttentionBackend
from servelm.runtime.model_kernels import ModelKernels

log = logging.getLogger(__name__)

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


def is_cuda(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device, for code outside the runtime (the device-check scripts)
    that times, sizes or skips work by it without asking ``device.type`` itself."""
    return device.type == "cuda"


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


# ---- the runner's kernels ----------------------------------------------------------------------


def select_attention_backend(
    device: torch.device | str,
    *,
    block_size: int,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    use_cpu_kernel: bool = True,
) -> AttentionBackend:
    """CUDA: FlashAttention, else the Triton paged fallback (``cuda.flash_backend.select_cuda_backend``).
    CPU: ``TorchAttentionBackend`` (the C++ decode kernel when it builds, unless ``use_cpu_kernel`` is
    False). CUDA-only packages are never imported on a CPU start."""
    device = torch.device(device)
    backend: AttentionBackend
    if device.type == "cuda":
        # Importing flash_backend imports neither flash_attn nor triton; constructing a backend does.
        from servelm.runtime.cuda.flash_backend import select_cuda_backend

        backend = select_cuda_backend(block_size, dtype, head_dim)
    elif device.type == "cpu":
        from servelm.runtime.cpu.torch_backend import TorchAttentionBackend

        backend = TorchAttentionBackend(block_size, use_kernel=use_cpu_kernel)
    else:
        raise ValueError(f"unsupported device {device}; expected cpu or cuda")
    log.info("attention backend: %s on %s (block size %d)", backend.name, device, block_size)
    return backend


def serves_gemma(device: torch.device) -> bool:
    """Whether Gemma's sliding windows and norms have a path here (the CPU's only)."""
    return device.type == "cpu"


def kv_dtype_supported(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether attention reads a KV cache of ``kv_dtype`` under ``dtype`` weights: the weights' own,
    or on CPU a 16-bit cache under float32 weights (the paged kernel widens it)."""
    return kv_dtype == dtype or (device.type == "cpu" and dtype == torch.float32 and kv_dtype in (torch.bfloat16, torch.float16))


def quantization_supported(device: torch.device) -> bool:
    """Whether ``--quantization`` has kernels here (weight-only int8/int4: the CPU's)."""
    return device.type == "cpu"


def quantized_kernels(device: torch.device) -> dict[str, Any]:
    """The quantized projection kernels by format (``cpu.linear.quantized_kernels``); none off CPU."""
    if device.type != "cpu":
        return {}
    from servelm.runtime.cpu import linear

    return linear.quantized_kernels()


def small_batch_splits(device: torch.device) -> tuple[int, int]:
    """Most rows for which dense torch splits the gate/up projection, and computes the head as W @ h^T
    (``cpu.linear.SPLIT_GATE_UP_MAX_ROWS`` / ``TALL_SKINNY_HEAD_MAX_ROWS``); (0, 0) off CPU."""
    if device.type != "cpu":
        return 0, 0
    from servelm.runtime.cpu import linear

    return linear.SPLIT_GATE_UP_MAX_ROWS, linear.TALL_SKINNY_HEAD_MAX_ROWS


def install_kernels(model: Any, device: torch.device, dtype: torch.dtype, quant_rows: int) -> ModelKernels:
    """Put this device's kernels into a loaded (and quantized) model: packing and compiled ops on CPU,
    fused Triton ops and few-row projections on CUDA."""
    if device.type == "cpu":
        from servelm.runtime.cpu import setup as cpu_setup

        return cpu_setup.install_kernels(model, dtype, quant_rows)
    if device.type == "cuda":
        from servelm.runtime.cuda import setup as cuda_setup

        return cuda_setup.install_kernels(model)
    return ModelKernels()


def capture_decode_graphs(runner: Any, num_blocks: int) -> Any:
    """The runner's captured decode graphs (``cuda.graphs.CudaGraphRunner``), or None where there are none."""
    if runner.device.type != "cuda":
        return None
    from servelm.runtime.cuda import setup as cuda_setup

    return cuda_setup.capture_decode_graphs(runner, num_blocks)


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor for the KV pool: on the CPU its pages become resident as they are written."""
    if device.type == "cpu":
        from servelm.runtime.cpu.memory import lazily_zeroed

        return lazily_zeroed(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def page_forgetter(device: torch.device) -> Callable[[int, int], None] | None:
    """What hands a ``zeroed_pool``'s pages back to the system by address range (None: its memory
    cannot be handed back piecewise, as a CUDA allocation cannot)."""
    if device.type == "cpu":
        from servelm.runtime.cpu.memory import forget

        return forget
    return None


def release_cached_memory(device: torch.device) -> None:
    """Hand the allocator's cached blocks back to the device (after a scratch step, before the pool is made)."""
    if is_cuda(device):
        torch.cuda.empty_cache()


def kv_budget_bytes(
    device: torch.device, utilization: float, warm_up: Callable[[], int], scratch_bytes: int, reserve_bytes: int
) -> int:
    """Bytes the KV pool may take within ``utilization`` of the device's memory (CUDA)."""
    from servelm.runtime.cuda import setup as cuda_setup

    return cuda_setup.kv_budget_bytes(device, utilization, warm_up, scratch_bytes, reserve_bytes)


def lora_kernel(device: torch.device) -> Any:
    """The compiled LoRA op (``cpu.ops.lora_kernel``), or None where there is none."""
    if device.type != "cpu":
        return None
    from servelm.runtime.cpu import ops

    return ops.lora_kernel()


# The GIL switch interval of a server driving a GPU. The engine thread releases the GIL in every CUDA
# call (staging copies, graph replay, event waits) and at Python's default 5 ms may then wait that long
# for the HTTP thread, which is busy writing hundreds of streams; the GPU idles meanwhile (the A/B on
# an H200 is in docs/cuda.md).
CUDA_SWITCH_INTERVAL_S = 2e-4


def gil_switch_interval(device: torch.device) -> float | None:
    """The ``sys.setswitchinterval`` a server on ``device`` runs with; None keeps Python's default
    (on CPU the forward itself holds the cores, and no gain was measured there)."""
    return CUDA_SWITCH_INTERVAL_S if device.type == "cuda" else None


def copies_results_async(device: torch.device) -> bool:
    """Whether a step's results go to pinned host memory without blocking, waited on by an event."""
    return device.type == "cuda"


def results_ready_event(device: torch.device) -> Any:
    """An event recorded after the copies queued so far on ``device`` (see ``copies_results_async``)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
