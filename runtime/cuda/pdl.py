"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and newer).

In a batch-1 decode graph every kernel is short (2-60 us) and starts only once the kernel before it
has completed: its programs are then placed, issue their first loads and wait a memory round trip
while the GPU idles, and the previous kernel's last programs ran with most SMs already idle. A kernel
launched with PDL (the launch attribute "programmatic stream serialization") may be placed while the
previous one still runs: its programs load what does not depend on that kernel (a projection's first
weight tile), then block in ``griddepcontrol.wait`` until the previous kernel has completed and its
writes are visible. Each kernel allows the next one to launch (``griddepcontrol.launch_dependents``)
once it has passed its own wait, so at most one kernel waits ahead of the running one.

Why it is safe: a PDL kernel reads nothing another kernel of the step writes, and writes nothing,
before its wait; the wait returns when the previous kernel has completed, and that kernel could only
complete after its own wait, i.e. after the kernel before it, and so on. Weights are never written
during a step. A kernel launched without the attribute is fully serialised, as before, and the wait
is a no-op in a kernel launched without it.

The switch is read at each launch (``launch_kwargs``): the CUDA-graph runner captures the fused batch-1
graph with and without it (``launching(True)``) and keeps the PDL graph only when it replays faster and
its outputs equal the other's bit for bit (a race would show there). Eager launches never use it.
This module imports no Triton: the kernels' side is ``runtime.cuda.triton_pdl``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch

_active = False


def unavailable_reason(device: torch.device) -> str | None:
    """Why decode graphs cannot try PDL on ``device`` (None: they can). ``SERVELM_PDL=0`` turns it off."""
    if os.environ.get("SERVELM_PDL", "").strip().lower() in ("0", "false", "no", "off"):
        return "turned off by SERVELM_PDL"
    if device.type != "cuda":
        return "not a CUDA device"
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return "Triton runs interpreted"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        cuda_extra = importlib.import_module("triton.language.extra.cuda")
    except ImportError:
        cuda_extra = None
    if not all(hasattr(cuda_extra, f) for f in ("gdc_wait", "gdc_launch_dependents")):
        return "this Triton has no grid dependency control (triton.language.extra.cuda.gdc_wait)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.x (PDL needs 9.0 or newer)"
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 3):
        return f"CUDA {torch.version.cuda} (graphs keep PDL edges from 12.3 on)"
    return None


def active() -> bool:
    """Whether kernels launched now get the PDL attribute."""
    return _active


@contextlib.contextmanager
def launching(on: bool = True) -> Iterator[None]:
    """Launch the PDL-aware kernels with (``on``) or without the attribute inside this block."""
    global _active
    saved = _active
    _active = on
    try:
        yield
    finally:
        _active = saved


_ON: dict[str, Any] = {"PDL": True, "launch_pdl": True}
_OFF: dict[str, Any] = {"PDL": False}


def launch_kwargs() -> dict[str, Any]:
    """What a PDL-aware Triton kernel's launch adds (``**launch_kwargs()``; do not modify it): its
    ``PDL`` constexpr, and Triton's launch option. Called at every launch, so nothing is built here."""
    return _ON if _active else _OFF
