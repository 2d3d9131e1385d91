"""The GPU device-check script's plumbing, run on CPU with a tiny model (the real run needs an H200)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_on_cpu_passes_every_check(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "scripts/device_check.py", "--dry-run", "--device", "cpu", "--tiny", "--json", str(report),
         "--workdir", str(tmp_path / "work")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = json.loads(report.read_text())
    assert got["ok"]
    names = {c["name"] for c in got["checks"]}
    for expected in (
        "prefill logits vs HF",
        "chosen-token logprobs vs HF (teacher-forced)",
        "prefix cache hits on the second pass",
        "preemption happened",
        "imports nothing the GPU machine lacks",
    ):
        assert expected in names
    assert any(n.startswith("greedy ") for n in names) and any(n.startswith("chunked prefill") for n in names)
    assert len(got["throughput"]) == 3  # batch-1 latency, concurrent throughput, long prefill
    assert not (tmp_path / "work" / "model").exists()  # the scratch model is removed
