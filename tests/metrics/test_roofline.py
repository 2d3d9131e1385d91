"""Device peaks: measured on CPU quickly, datasheet values for the GPUs we name."""

from __future__ import annotations

import json
import time

import pytest
import torch

from servelm.metrics.roofline import device_peaks, gpu_peaks, measure_cpu_peaks


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
    from servelm.metrics.roofline import device_peaks

    monkeypatch.setenv("SERVELM_PEAK_FLOPS", "2e11")
    monkeypatch.setenv("SERVELM_PEAK_BANDWIDTH", "2.6e10")
    assert device_peaks("cpu") == (2e11, 2.6e10)


def test_cpu_peaks_report_the_median_of_recent_start_ups(monkeypatch, tmp_path) -> None:
    """A busy start-up under-reads the peaks and a lucky one over-reads them: neither may stick."""
    from servelm.metrics.roofline import PEAK_HISTORY, median_cpu_peaks

    monkeypatch.setenv("SERVELM_CACHE", str(tmp_path))
    assert median_cpu_peaks(lambda: (2e11, 3e10)) == (2e11, 3e10)  # first start: what it measured
    assert median_cpu_peaks(lambda: (2.2e11, 3.6e10)) == (2.2e11, 3.6e10)  # two readings: the higher
    assert median_cpu_peaks(lambda: (5e10, 9e10)) == (2e11, 3.6e10)  # a busy FLOP/s and an outlier copy
    assert median_cpu_peaks(lambda: (2.1e11, 3.4e10)) == (2.1e11, 3.6e10)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)  # another setting: its own record
        assert median_cpu_peaks(lambda: (1e11, 2e10)) == (1e11, 2e10)
    finally:
        torch.set_num_threads(before)
    for _ in range(PEAK_HISTORY):  # the machine changed for good: old readings age out
        median_cpu_peaks(lambda: (4e11, 5e10))
    assert median_cpu_peaks(lambda: (1e9, 1e9)) == (4e11, 5e10)
    # The format of earlier versions (one best value kept forever) is replaced, not trusted.
    (tmp_path / "cpu_peaks.json").write_text(json.dumps({_key(): {"flops": 9e11, "bandwidth": 9e10}}))
    assert median_cpu_peaks(lambda: (2e11, 3e10)) == (2e11, 3e10)
    (tmp_path / "cpu_peaks.json").write_text("not json")  # a damaged record is ignored, then replaced
    assert median_cpu_peaks(lambda: (1e9, 1e9)) == (1e9, 1e9)


def _key() -> str:
    from servelm.metrics.roofline import _cpu_key

    return _cpu_key()


def test_cpu_peak_flops_measure_the_engine_matmul_path(monkeypatch) -> None:
    """The engine's projections go through oneDNN on packed weights (MKL's sgemm is ~1.7x slower on
    this project's CPUs): the denominator must come from that path, or MFU reads above 1."""
    from servelm.runtime.cpu import linear as cpu_linear

    if not cpu_linear.onednn_linear_available(torch.float32):
        pytest.skip("no oneDNN linear in this torch build")
    calls: list[tuple[int, ...]] = []
    real = cpu_linear.linear

    def counting(x, packed, bias):
        calls.append(tuple(x.shape))
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_linear, "linear", counting)
    measure_cpu_peaks(budget_s=0.1)
    assert calls and set(calls) == {(128, 2048)}
