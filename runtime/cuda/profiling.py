"""What the torch profiler saw run on the GPU: the device check's kernel timings read it."""

from __future__ import annotations

from typing import Any


def gpu_kernel_events(prof: Any) -> list[Any]:
    """The events of ``prof`` (a finished ``torch.profiler.profile``) that ran on a CUDA device."""
    return [e for e in prof.events() if e.device_type.name == "CUDA"]
