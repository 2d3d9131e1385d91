"""The GPU device-check script's plumbing, run on CPU with a tiny model (the real run needs an H200)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the device-check scripts end to end (an engine and a server each)

REPO = Path(__file__).resolve().parents[2]


def dry_run(tmp_path: Path, dtype: str, *extra: str) -> tuple[dict, str]:
    """The device check on CPU with a tiny model: (its JSON report, its stdout)."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/device_check.py",
            "--dry-run",
            "--device",
            "cpu",
            "--tiny",
            "--json",
            str(report),
            "--workdir",
            str(tmp_path / "work"),
            "--dtype",
            dtype,
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(report.read_text()), proc.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dry_run_on_cpu_passes_every_check(tmp_path: Path, dtype: str) -> None:
    got, _ = dry_run(tmp_path, dtype)
    assert got["ok"]
    names = {c["name"] for c in got["checks"]}
    for expected in (
        "float32 prefill logits vs HF float32",
        "chosen-token logprobs vs HF (teacher-forced)",
        "prompt logprobs vs HF (prefill rows scored)",
        "prefix cache hits on the second pass",
        "preemption happened",
        "imports nothing the GPU machine lacks",
    ):
        assert expected in names
    assert any(n.startswith("greedy ") for n in names) and any(n.startswith("chunked prefill") for n in names)
    if dtype == "bfloat16":  # judged by its distance from HF float32, next to HF bfloat16's own
        assert "torch.bfloat16 prefill logits: distance from HF float32 vs HF torch.bfloat16's own" in names
    rows = {r["name"] for r in got["throughput"]}
    assert "batch 1: ms per output token" in rows  # and the concurrent throughput and the long prefill:
    assert any(r.endswith("output tok/s") for r in rows) and any(r.startswith("prefill of one") for r in rows)
    assert not (tmp_path / "work" / "model").exists()  # the scratch model is removed


def test_skip_exact_leaves_out_the_float32_engine(tmp_path: Path) -> None:
    """A performance-minded rerun (``--skip exact``): no float32 engine, the bf16 checks and numbers still."""
    got, stdout = dry_run(tmp_path, "bfloat16", "--skip", "exact", "--skip", "throughput")
    names = {c["name"] for c in got["checks"]}
    assert got["ok"] and "float32 prefill logits vs HF float32" not in names
    assert "torch.bfloat16 prefill logits: distance from HF float32 vs HF torch.bfloat16's own" in names
    assert "load it into servelm in float32 (Engine)" not in stdout and "skipped (--skip exact)" in stdout


def test_http_check_dry_run_on_cpu_passes_every_check(tmp_path: Path) -> None:
    """The HTTP half of the device check (scripts/device_http_check.py) on CPU with a tiny model: the
    server starts from the checkout, every API check and both load runs pass, and the summary says so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with socket.socket() as s:  # a free port for the server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "scripts/device_http_check.py", "--build", "tiny", "--device", "cpu", "--out", str(tmp_path),
         "--single", "2", "--concurrent", "8", "--input-len", "32", "--output-len", "16", "--profile-seconds", "0",
         "--port", str(port)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = json.loads((tmp_path / "http_check.json").read_text())
    names = {c["name"] for c in got["checks"] if c["ok"]}
    assert len(names) == len(got["checks"]) >= 14
    assert {"4xx: prompt over max_model_len", "no KV block in use once idle", "streamed completion (SSE)"} <= names
    assert got["concurrent"]["completed"] == 16 and got["server_exit"] == 0
