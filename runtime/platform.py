"""Which platform this is: the device a configuration names, and its ``Platform``
(``runtime/cpu/platform.py`` or ``runtime/cuda/platform.py``; the interface is
``runtime/platform_interface.py``). The only module outside ``runtime/cpu`` and ``runtime/cuda`` that
asks which device this is."""

from __future__ import annotations

import torch

from servelm.runtime.platform_interface import Platform

_platforms: dict[str, Platform] = {}


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else CPU; a bare ``cuda`` becomes the current CUDA device."""
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto_device if name == "auto" else name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def platform_of(device: torch.device | str) -> Platform:
    """The platform of ``device`` (one instance per device kind). Importing a platform imports none of
    its device's packages (CUDA's are imported when first used)."""
    kind = torch.device(device).type
    found = _platforms.get(kind)
    if found is None:
        if kind == "cpu":
            from servelm.runtime.cpu.platform import CpuPlatform

            found = CpuPlatform()
        elif kind == "cuda":
            from servelm.runtime.cuda.platform import CudaPlatform

            found = CudaPlatform()
        else:
            found = Platform()
        _platforms[kind] = found
    return found


def visible_gpus(name: str) -> int | None:
    """The GPUs a configuration's device ``name`` may spread engine cores over (``--data-parallel-size``):
    None when it runs on CPU, else the CUDA devices this process sees (counted without a CUDA context:
    only the cores should hold one)."""
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name).type
    return torch.cuda.device_count() if kind == "cuda" else None
