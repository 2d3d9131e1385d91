"""Device peaks: measured on CPU quickly, datasheet values for the GPUs we name."""

from __future__ import annotations

import time

import pytest
import torch

from metrics.roofline import device_peaks, gpu_peaks, measure_cpu_peaks


def test_cpu_peaks_are_measured_quickly_and_plausibly() -> None:
    t0 = time.perf_counter()
    flops, bw = measure_cpu_peaks()
    elapsed = time.perf_counter() - t0
    # Under 1 s on an idle machine; other work shares these cores during a test run.
    assert elapsed < 2.0
    # Any CPU torch runs on does well over 1 GFLOP/s and 1 GB/s; nothing does 100 TFLOP/s or 1 TB/s.
    assert 1e9 < flops < 1e14
    assert 1e9 < bw < 1e12


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H200", (989e12, 4.8e12)),
        ("NVIDIA H100 80GB HBM3", (989e12, 3.35e12)),
        ("NVIDIA H100 PCIe", (756e12, 2.0e12)),
        ("NVIDIA A100-SXM4-80GB", (312e12, 2.039e12)),
        ("NVIDIA A100-SXM4-40GB", (312e12, 1.555e12)),
    ],
)
def test_gpu_datasheet_peaks(name: str, expected: tuple[float, float]) -> None:
    assert gpu_peaks(name) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="an unknown card is measured when CUDA is present")
def test_unknown_gpu_without_cuda_is_an_error() -> None:
    with pytest.raises(ValueError, match="no datasheet peaks"):
        gpu_peaks("NVIDIA GeForce GTX 1080")


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto resolves to CUDA here")
def test_auto_device_on_cpu_measures_the_cpu() -> None:
    flops, bw = device_peaks("auto")
    assert flops > 1e9 and bw > 1e9


def test_environment_overrides_the_measured_peaks(monkeypatch):
    from metrics.roofline import device_peaks

    monkeypatch.setenv("SERVELM_PEAK_FLOPS", "2e11")
    monkeypatch.setenv("SERVELM_PEAK_BANDWIDTH", "2.6e10")
    assert device_peaks("cpu") == (2e11, 2.6e10)
