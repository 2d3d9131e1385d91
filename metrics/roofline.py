"""Peak compute and memory bandwidth of the serving device: the denominators of MFU and MBU.

On CPU the peaks are measured at start-up (a matmul of the row count a batched decode step runs,
through the same oneDNN path the engine's projections take, and a large tensor copy), because a
datasheet number means little for a shared 2-core VM. One reading is noisy both ways (a busy host
under-reads; a VM moved to another host, or a lucky cache, can over-read twice over), so the last
``PEAK_HISTORY`` readings per (CPU model, thread count, torch version) are kept in
``$SERVELM_CACHE/cpu_peaks.json`` and a start-up reports their median, its own reading included.
On NVIDIA data-centre GPUs the datasheet values are used (dense bf16/fp16 tensor-core FLOP/s and
HBM bandwidth) since that is the ceiling utilisation is conventionally quoted against; unknown
cards are measured.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable

import torch

from servelm.runtime.capacity import DEVICE_PRESETS
from servelm.runtime.model_files import cache_dir
from servelm.runtime.platform import platform_of

log = logging.getLogger(__name__)

# Start-up readings of the CPU peaks remembered per CPU setting; their median is reported.
PEAK_HISTORY = 9

# Substrings of ``torch.cuda.get_device_name()`` -> (dense bf16 FLOP/s, bandwidth bytes/s).
# Order matters: more specific names first ("h100 nvl" before "h100").
_GPU_DATASHEETS: tuple[tuple[str, tuple[float, float]], ...] = (
    ("h200", (DEVICE_PRESETS["h200"].peak_flops, DEVICE_PRESETS["h200"].bandwidth_bytes_s)),
    ("h100 nvl", (835e12, 3.9e12)),
    ("h100 pcie", (756e12, 2.0e12)),
    ("h100", (DEVICE_PRESETS["h100-80g"].peak_flops, DEVICE_PRESETS["h100-80g"].bandwidth_bytes_s)),
    ("a100-sxm4-40gb", (312e12, 1.555e12)),
    ("a100-pcie-40gb", (312e12, 1.555e12)),
    ("a100", (DEVICE_PRESETS["a100-80g"].peak_flops, DEVICE_PRESETS["a100-80g"].bandwidth_bytes_s)),
)


def _best_rate(fn: Callable[[], object], work: float, budget_s: float, min_reps: int = 3) -> float:
    """Run ``fn`` repeatedly for about ``budget_s`` (at least ``min_reps`` times); best work/second."""
    fn()  # warm-up: first-call allocation and thread-pool start-up are not the steady state
    best = 0.0
    reps = 0
    deadline = time.perf_counter() + budget_s
    while reps < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if dt > 0:
            best = max(best, work / dt)
        reps += 1
    return best


def measure_cpu_peaks(budget_s: float = 0.5) -> tuple[float, float]:
    """Measured (FLOP/s, bytes/s) of this CPU with torch's current thread count, in about ``budget_s``.

    FLOP/s: a float32 product of 128 rows (a batched decode step's shape; fewer rows run slower here)
    as the CPU platform's projections compute it (oneDNN on a packed weight where it builds). Bytes/s: a copy between two 64 MiB tensors, counted as bytes read plus written.
    """
    m, k, n = 128, 2048, 2048
    a = torch.randn(m, k)
    w = torch.randn(n, k)
    matmul = platform_of("cpu").projection_product(a, w)
    flops = _best_rate(matmul, 2.0 * m * k * n, budget_s * 0.45)

    numel = 16 * 2**20  # 64 MiB of fp32: far beyond any last-level cache
    src = torch.ones(numel)
    dst = torch.empty(numel)
    bandwidth = _best_rate(lambda: dst.copy_(src), 2.0 * numel * 4, budget_s * 0.45, min_reps=2)
    return flops, bandwidth


def _cpu_key() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def _upper_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def median_cpu_peaks(measure: Callable[[], tuple[float, float]] = measure_cpu_peaks) -> tuple[float, float]:
    """``measure()`` now, remembered with this CPU setting's last readings; their median (each of FLOP/s
    and bytes/s) is what is reported.

    The median lifts a start-up that ran while the host was busy to the usual value, and no single
    outlier, low or high, moves it. The cache is best effort: an unwritable ``$SERVELM_CACHE`` just
    means no memory; a record in another format is replaced.
    """
    flops, bandwidth = measure()
    path = cache_dir() / "cpu_peaks.json"
    key = _cpu_key()
    try:
        table = json.loads(path.read_text()) if path.is_file() else {}
        readings = [(float(f), float(b)) for f, b in table.get(key, {}).get("readings", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        table, readings = {}, []
    readings = (readings + [(flops, bandwidth)])[-PEAK_HISTORY:]
    table[key] = {"readings": readings}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.debug("cannot remember CPU peaks in %s: %s", path, exc)
    peaks = (_upper_median([f for f, _ in readings]), _upper_median([b for _, b in readings]))
    if peaks != (flops, bandwidth):
        log.info(
            "CPU peaks measured now %.0f GFLOP/s, %.1f GB/s; using the median of the last %d start-ups "
            "%.0f GFLOP/s, %.1f GB/s",
            flops / 1e9,
            bandwidth / 1e9,
            len(readings),
            peaks[0] / 1e9,
            peaks[1] / 1e9,
        )
    return peaks


def measure_cuda_peaks(device: int | str | torch.device = "cuda", budget_s: float = 1.0) -> tuple[float, float]:
    """Measured (bf16 matmul FLOP/s, device-copy bytes/s) of a CUDA device."""
    dev = torch.device(device)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            torch.cuda.synchronize(dev)

        return run

    flops = _best_rate(synced(lambda: torch.matmul(a, b)), 2.0 * n**3, budget_s / 2)
    numel = 256 * 2**20  # 512 MiB of bf16
    src = torch.ones(numel, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bandwidth = _best_rate(synced(lambda: dst.copy_(src)), 2.0 * numel * 2, budget_s / 2)
    return flops, bandwidth


def gpu_peaks(device_name: str) -> tuple[float, float]:
    """Datasheet (dense bf16 FLOP/s, bytes/s) for A100/H100/H200 by device name; others are measured."""
    name = device_name.lower()
    for key, peaks in _GPU_DATASHEETS:
        if key in name:
            return peaks
    if not torch.cuda.is_available():
        raise ValueError(f"no datasheet peaks for {device_name!r} and no CUDA device to measure")
    return measure_cuda_peaks()


def device_peaks(device: str | torch.device) -> tuple[float, float]:
    """(FLOP/s, bytes/s) for the device the engine runs on: measured on CPU, datasheet on known GPUs.

    ``"auto"`` (the CLI default) means CUDA when available, else CPU, as the engine resolves it.
    ``SERVELM_PEAK_FLOPS`` / ``SERVELM_PEAK_BANDWIDTH`` (numbers, e.g. ``2e11``) override either value:
    a measurement taken while the host is busy under-reads the peak and over-reads MFU/MBU.
    """
    flops_env, bw_env = os.environ.get("SERVELM_PEAK_FLOPS"), os.environ.get("SERVELM_PEAK_BANDWIDTH")
    if flops_env and bw_env:
        return float(flops_env), float(bw_env)
    flops, bandwidth = _device_peaks(device)
    return float(flops_env or flops), float(bw_env or bandwidth)


def _device_peaks(device: str | torch.device) -> tuple[float, float]:
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        return gpu_peaks(torch.cuda.get_device_name(dev))
    return median_cpu_peaks()
