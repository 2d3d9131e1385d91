"""What ``--tensor-parallel-size`` refuses at start-up, by name, before any worker is spawned, and
how it plans the KV pool (each rank's budget; its pool holds 1/N of a token's KV heads)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.runtime.capacity import kv_bytes_per_token, plan_capacity
from servelm.runtime.config import ModelConfig, UnsupportedModelError
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.startup import start_up

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


def refused(model_dir: Path, **fields: Any) -> str:
    """The message ``start_up`` refuses this configuration with (it must raise before spawning)."""
    config = EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=4 * MiB, max_model_len=128, **fields)
    with pytest.raises((UnsupportedModelError, ValueError)) as e:
        start_up(config)
    return str(e.value)


def test_refused_by_name_before_workers_start(
    tiny_model_dir: Callable[[str], Path], default_model_dir: Path, tmp_path: Path
) -> None:
    from servelm.runtime.gguf.folder import SOURCE_FILE

    tiny = tiny_model_dir("llama")  # 4 heads, 2 KV heads
    assert "LoRA adapters (--enable-lora, --lora-modules) are not supported with --tensor-parallel-size" in refused(
        tiny, tensor_parallel_size=2, enable_lora=True
    )
    assert "LoRA" in refused(tiny, tensor_parallel_size=2, lora_modules=(("a", str(tmp_path)),))
    # (auto, the default, is not refused: under tensor parallelism it quantizes nothing; test_tp_serve)
    for q in ("int8", "int4"):
        assert f"--quantization {q} is not supported with tensor parallelism" in refused(
            tiny, tensor_parallel_size=2, quantization=q
        )
    assert "has 2 KV heads, not divisible by 4" in refused(tiny, tensor_parallel_size=4)
    assert "has 9 attention heads, not divisible by 2" in refused(default_model_dir, tensor_parallel_size=2)
    assert "must be at least 1" in refused(tiny, tensor_parallel_size=0)
    gguf_folder = tmp_path / "as-gguf"
    gguf_folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (gguf_folder / name).write_bytes((tiny / name).read_bytes())
    (gguf_folder / SOURCE_FILE).write_text(json.dumps({"path": str(tmp_path / "model.gguf")}))
    assert "GGUF weights are not supported with tensor parallelism" in refused(gguf_folder, tensor_parallel_size=2)


def test_cuda_is_refused_as_unproven(tiny_model_dir: Callable[[str], Path]) -> None:
    from servelm.runtime.distributed.launcher import backend_for
    from servelm.runtime.distributed.sharding import check_tensor_parallel

    assert (backend_for(torch.device("cuda")), backend_for(torch.device("cpu"))) == ("nccl", "gloo")
    cfg = ModelConfig.from_dir(tiny_model_dir("llama"))
    with pytest.raises(UnsupportedModelError, match=r"CUDA .*unproven"):
        check_tensor_parallel(cfg, 2, device=torch.device("cuda"))


def test_the_kv_budget_is_each_ranks(tiny_model_dir: Callable[[str], Path]) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir("llama"))
    whole = kv_bytes_per_token(cfg, torch.float32)
    one = plan_capacity(cfg, torch.float32, 4 * MiB, 16, 128)
    two = plan_capacity(cfg, torch.float32, 4 * MiB, 16, 128, tensor_parallel_size=2)
    assert (one.kv_bytes_per_token, two.kv_bytes_per_token) == (whole, whole // 2)
    assert two.num_blocks == 2 * one.num_blocks == 2 * (4 * MiB // (whole * 16))
    assert two.num_blocks * 16 * two.kv_bytes_per_token <= 4 * MiB  # one rank's pool fits its budget
    assert "per rank x 2 ranks" in two.describe() and "rank" not in one.describe()


@pytest.mark.slow  # a fresh Python process
def test_the_cli_refuses_lora_under_tp_and_exits_1(tiny_model_dir: Callable[[str], Path]) -> None:
    argv = [sys.executable, "-m", "servelm.server.cli", "serve", "--model", str(tiny_model_dir("llama")), "-tp", "2",
            "--enable-lora", "--kv-cache-memory", "4MiB", "--port", "0"]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert (
        "cannot start: LoRA adapters (--enable-lora, --lora-modules) are not supported with --tensor-parallel-size"
        in proc.stderr
    )


def test_a_dead_worker_is_reported_with_its_exit_status_when_it_is_reaped_late() -> None:
    """A worker's sentinel closes as its files close, a moment before the kernel lets its exit status
    be reaped (CI saw "exit status unknown" for a SIGKILL): the watcher waits for the status."""
    import os
    import threading
    import types

    from servelm.runtime.distributed.launcher import TensorParallelGroup

    class LateReapedWorker:
        """The sentinel is already readable; the exit status appears only once joined."""

        def __init__(self) -> None:
            read, write = os.pipe()
            os.close(write)  # the read end is at EOF: readable, as a dead process's sentinel
            self.sentinel, self.pid, self._code = read, 4242, None

        @property
        def exitcode(self) -> int | None:
            return self._code

        def join(self, timeout: float | None = None) -> None:
            self._code = -9

    worker = LateReapedWorker()
    deaths: list[BaseException] = []
    group = types.SimpleNamespace(
        workers=[worker], _closing=threading.Event(), failure=None, on_worker_death=deaths.append
    )
    try:
        TensorParallelGroup._watch(group)
    finally:
        os.close(worker.sentinel)
    assert deaths and "tensor-parallel worker rank 1 (pid 4242) died (killed by signal 9)" in str(deaths[0]), deaths
