"""``servelm`` command line: argument parsing, and a real ``servelm serve`` process stopped by SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from servelm.scheduler.config import EngineConfig
from servelm.server.cli import build_parser, engine_config_from_args, main, parse_size

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1048576", 1048576),
        ("64 mib", 64 * 2**20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "two GiB", "5XB", "-1", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_serve_args_build_one_engine_config() -> None:
    args = build_parser().parse_args(
        [
            "serve", "--model", "/m", "--served-model-name", "m1", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--kv-cache-memory", "512MiB", "--gpu-memory-utilization", "0.5",
            "--block-size", "32", "--dtype", "bfloat16", "--device", "cpu", "--no-enable-prefix-caching", "--swa-full",
            "--scheduling-policy", "static", "--max-waiting-requests", "7", "--enforce-eager", "--async-scheduling",
            "--num-threads", "2", "--api-key", "k", "--port", "0",
        ]
    )  # fmt: skip
    cfg = engine_config_from_args(args)
    assert cfg == EngineConfig(
        model="/m",
        served_model_name="m1",
        dtype="bfloat16",
        device="cpu",
        block_size=32,
        kv_cache_memory=512 * 2**20,
        gpu_memory_utilization=0.5,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        swa_full=True,
        scheduling_policy="static",
        max_waiting_requests=7,
        enforce_eager=True,
        async_scheduling=True,
        num_threads=2,
    )
    assert args.api_key == "k" and args.port == 0
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8000)
    assert engine_config_from_args(defaults) == EngineConfig()
    # Scheduling ahead: unset means the device decides (on for CUDA); either way can be forced.
    assert engine_config_from_args(defaults).async_scheduling is None
    off = build_parser().parse_args(["serve", "--no-async-scheduling"])
    assert engine_config_from_args(off).async_scheduling is False
    for scheme in ("int8", "int4", "auto"):
        assert (
            engine_config_from_args(build_parser().parse_args(["serve", "--quantization", scheme])).quantization
            == scheme
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert (
        engine_config_from_args(build_parser().parse_args(["serve", "--speculative-config", spec])).speculative_config
        == spec
    )
    for bad in ("{", '{"method": "eagle"}', '{"num_speculative_tokens": 0}'):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--speculative-config", bad])
    events = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
    assert (
        engine_config_from_args(build_parser().parse_args(["serve", "--kv-events-config", events])).kv_events_config
        == events
    )
    # Events bind where HTTP listens unless the endpoint says otherwise.
    for argv, host in ((["serve"], "127.0.0.1"), (["serve", "--host", "::1"], "::1")):
        cfg = engine_config_from_args(
            build_parser().parse_args([*argv, "--kv-events-config", '{"enable_kv_cache_events": true}'])
        )
        assert cfg.host == host
    for bad in ("{", '{"enable_kv_cache_events": true, "end_point": "tcp://*:1"}', '{"publisher": "kafka"}'):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--kv-events-config", bad])


def test_lora_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "sql=/a/sql", '{"name": "poet", "path": "/a/poet", "base_model_name": "x"}',
         "--lora-modules", "x=/p=q", "--max-loras", "2", "--max-lora-rank", "32"]
    )  # fmt: skip
    cfg = engine_config_from_args(args)
    assert cfg.lora_modules == (("sql", "/a/sql"), ("poet", "/a/poet"), ("x", "/p=q"))
    assert cfg.enable_lora and (cfg.max_loras, cfg.max_lora_rank) == (2, 32)  # --lora-modules implies --enable-lora
    assert cfg.max_cpu_loras is None  # the engine takes --max-loras
    assert engine_config_from_args(build_parser().parse_args(["serve", "--max-cpu-loras", "8"])).max_cpu_loras == 8
    assert args.allow_runtime_lora_updating is False
    assert engine_config_from_args(build_parser().parse_args(["serve", "--enable-lora"])).enable_lora
    for bad in (
        ["--lora-modules", "noequals"],
        ["--lora-modules", "=/p"],
        ["--lora-modules", '{"name": 1}'],
        ["--max-loras", "0"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    monkeypatch.setenv("SERVELM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert build_parser().parse_args(["serve"]).allow_runtime_lora_updating is True
    assert build_parser().parse_args(["serve", "--no-allow-runtime-lora-updating"]).allow_runtime_lora_updating is False


def test_the_cli_offers_what_the_runtime_implements_without_importing_torch() -> None:
    from servelm.runtime.quantization import QUANTIZATIONS
    from servelm.server import cli

    assert cli.QUANTIZATIONS == QUANTIZATIONS
    code = "import sys, server.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[2])).returncode == 0


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVELM_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in (
        "--model", "--served-model-name", "--api-key", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
        "--kv-cache-memory", "--gpu-memory-utilization", "--block-size", "--dtype", "--device",
        "--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduling-policy", "--max-waiting-requests",
        "--enforce-eager", "--async-scheduling", "--no-async-scheduling", "--quantization", "--num-threads",
        "--log-level", "--host", "--port", "--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank",
        "--allow-runtime-lora-updating", "--drain-timeout", "--header-timeout", "--max-connections",
    ):  # fmt: skip
        assert re.search(rf"{re.escape(opt)}\b", out), opt
    assert main([]) == 2  # no subcommand: usage, non-zero


def test_bench_and_plan_are_wired(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("bench", "plan"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "unavailable" not in capsys.readouterr().out


@pytest.mark.slow  # a servelm serve process
def test_sigterm_during_stream_finishes_it_and_exits_0() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("SERVELM_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "servelm.server.cli", "serve", "--port", "0", "--kv-cache-memory", "64MiB",
         "--max-model-len", "512", "--no-access-log", "--drain-timeout", "60"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    port: list[int] = []
    ready = threading.Event()

    def read_log() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        assert ready.wait(300) and port, "".join(lines)
        url = f"http://127.0.0.1:{port[0]}"
        log_text = "".join(lines)
        assert re.search(r"\d+ blocks x 16 tokens", log_text), log_text  # the capacity line
        body = {"prompt": "Count: one, two,", "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(chunks) == 32  # every token arrived
        # New requests are refused once the signal landed (socket closed, or 503 on a live connection).
        try:
            late = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        assert proc.wait(timeout=60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)


def test_serve_builds_the_engine_in_a_thread_that_is_gone_before_serving(
    monkeypatch: pytest.MonkeyPatch, server_tokenizer
) -> None:
    """The start-up torch work (engine, CPU peaks) runs in a thread that exits: a thread that ran
    OpenMP keeps its worker team for life, and a second team beside the engine thread's made every
    batch-1 decode step ~30% slower on 2 cores (libgomp stops spinning at its barriers)."""
    from srv_harness import FakeEngine

    import servelm.scheduler.engine
    import servelm.server.app
    import servelm.server.cli as cli
    from servelm.runtime.capacity import CapacityError

    seen: dict[str, threading.Thread] = {}

    def fake_engine(config: EngineConfig, observer=None, **_: object):
        seen["engine"] = threading.current_thread()
        if config.max_model_len == 999:
            raise CapacityError("too big")
        return FakeEngine(server_tokenizer)

    def fake_observer(engine):
        seen["observer"] = threading.current_thread()
        return None

    class NoServer:
        started = True

        def run(self) -> None:
            seen["serve"] = threading.current_thread()

    monkeypatch.setattr(servelm.scheduler.engine, "Engine", fake_engine)
    monkeypatch.setattr(servelm.server.app, "create_prometheus_observer", fake_observer)
    monkeypatch.setattr(cli, "_make_uvicorn_server", lambda app, args, on_stop: NoServer())
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # keep the test session's handlers
    args = build_parser().parse_args(["serve", "--port", "0", "--engine-in-process"])
    assert args.func(args) == 0
    assert seen["engine"] is seen["observer"]
    assert seen["engine"] is not threading.main_thread() and not seen["engine"].is_alive()
    assert seen["serve"] is threading.current_thread()
    # A start-up failure in that thread still ends the command with its message and status 1.
    args = build_parser().parse_args(["serve", "--port", "0", "--engine-in-process", "--max-model-len", "999"])
    assert args.func(args) == 1
