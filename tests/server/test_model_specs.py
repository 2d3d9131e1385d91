"""The models a server serves, from its flags and its models file (server/model_specs.py,
server/cli_models.py): ids, aliases, per-model flags, keep_alive as Ollama reads it, the memory
estimate, and the one-model command line left as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servelm.scheduler.config import EngineConfig
from servelm.server.cli import build_parser, engine_config_from_args
from servelm.server.cli_models import model_specs
from servelm.server.model_specs import ModelSpecError, estimate_memory, parse_keep_alive


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(0, 0.0), ("0", 0.0), (-1, None), ("-1", None), ("-5m", None), (300, 300.0), ("5m", 300.0), ("1h30m", 5400.0),
     ("300ms", 0.3), ("2.5s", 2.5), (1.5, 1.5)],
)  # fmt: skip
def test_keep_alive_reads_as_ollamas(value: Any, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m5", "", True, None])
def test_keep_alive_refuses_what_is_no_duration(value: Any) -> None:
    with pytest.raises(ModelSpecError):
        parse_keep_alive(value)


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


def test_one_model_flag_is_the_one_model_server_as_before() -> None:
    args = _args("--model", "/m", "--served-model-name", "x")
    assert args.model == "/m" and args.more_models == []
    assert engine_config_from_args(args).model == "/m"


def test_models_from_flags_and_file(tmp_path: Path) -> None:
    gguf = tmp_path / "b.gguf"
    gguf.write_bytes(b"\0" * 1000)
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 3000)
    (folder / "tokenizer.json").write_bytes(b"\0" * 500)  # not weights
    file = tmp_path / "models.yaml"
    file.write_text(
        f"memory_budget: 3GiB\nmodels:\n  - id: cee\n    path: {folder}\n    aliases: [c1, 'c:latest']\n"
        "    keep_alive: 10m\n    kv_cache_memory: 1MiB\n    quantization: int8\n    tool_call_parser: hermes\n"
    )
    args = _args(
        "--model",
        "/a",
        "--model",
        str(gguf),
        "--models-file",
        str(file),
        "--keep-alive",
        "30s",
        "--kv-cache-memory",
        "2MiB",
    )
    assert args.model == "/a" and args.more_models == [str(gguf)]
    specs, budget = model_specs(args, engine_config_from_args(args))
    assert budget == 3 * 2**30
    assert [s.id for s in specs] == ["a", "b", "cee"]
    a, b, c = specs
    assert (a.config.model, a.config.served_model_name, a.keep_alive_s) == ("/a", "a", 30.0)
    assert b.config.kv_cache_memory == 2 * 2**20 and b.memory_bytes == 1000 + 2 * 2**20
    assert c.aliases == ("c1", "c:latest") and c.keep_alive_s == 600.0
    assert (c.config.kv_cache_memory, c.config.quantization) == (2**20, "int8")
    assert c.options["tool_call_parser"] == "hermes" and a.options["tool_call_parser"] is None
    assert c.memory_bytes == 3000 + 2**20  # the weight files and the KV pool; the tokenizer is not counted


def test_a_models_file_with_a_mistake_says_which(tmp_path: Path) -> None:
    file = tmp_path / "m.yaml"
    file.write_text("models:\n  - path: /x\n    kv_cach_memory: 1MiB\n")
    with pytest.raises(ModelSpecError, match=r"models\[0\]: unknown key 'kv_cach_memory'"):
        model_specs(_args("--models-file", str(file)), EngineConfig())
    file.write_text("models:\n  - path: /x\n  - path: /y/x\n")
    with pytest.raises(ModelSpecError, match="two models are named 'x'"):
        model_specs(_args("--models-file", str(file)), EngineConfig())
    file.write_text("models: 3\n")
    with pytest.raises(ModelSpecError, match="expected a list of models"):
        model_specs(_args("--models-file", str(file)), EngineConfig())


def test_an_encoder_counts_no_kv_pool(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    config = EngineConfig(model=str(tmp_path), kv_cache_memory=2**20)
    assert estimate_memory(config, lambda _p: True) == 100
    assert estimate_memory(config, lambda _p: False) == 100 + 2**20


def test_serve_refuses_a_bad_models_file_before_loading(serve_app: Any, tmp_path: Path) -> None:
    file = tmp_path / "m.yaml"
    file.write_text("models:\n  - path: /x\n    keep_alive: soon\n")
    assert serve_app("--models-file", str(file), status=1) is None
