"""``scripts/bench_engine.py`` (``make bench``) splits step time into the runner's part and the engine's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "scripts" / "bench_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_engine", module)
    spec.loader.exec_module(module)
    return module


def test_runner_time_and_batch_sizes_are_measured(tiny_llama_dir: Path) -> None:
    bench = load_bench()
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 * 2**20, max_model_len=256))
    wl = bench.Workload("t", prompt_lens=[12, 20, 7, 30], output_lens=[5, 9, 3, 6], max_num_seqs=4)
    r = bench.run_engine(engine, wl, seed=0)
    assert r["out_tokens"] == 23
    # Step 1 prefills all four; the batch then shrinks as requests end (after 3, 5, 6 and 9 tokens).
    assert r["mean_batch"] == (4 * 3 + 3 * 2 + 2 * 1 + 1 * 3) / 9
    assert 0 < r["model_s"] < r["total_s"] and 0 <= r["overhead_pct"] < 100
    assert "launch" not in vars(engine.runner) and "sample" not in vars(engine.runner)  # unwrapped again
