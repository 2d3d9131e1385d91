"""``servelm bench`` against a small OpenAI-compatible streaming server on loopback."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import FakeState, serve

from servelm.bench import loadgen as bench
from servelm.bench.datasets import count_tokens, load_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return load_tokenizer(default_model_dir)


@pytest.fixture
def fake(tokenizer) -> Iterator[Callable[..., tuple[str, FakeState]]]:
    """``fake(**state_fields)`` -> (base URL, state) of a running fake server, stopped after the test."""
    with ExitStack() as stack:

        def start(**kw: Any) -> tuple[str, FakeState]:
            state = FakeState(tokenizer=tokenizer, **kw)
            return stack.enter_context(serve(state)), state

        yield start


def run_bench(default_model_dir: Path, *argv: str) -> int:
    return bench.main(["--tokenizer", str(default_model_dir), "--disable-tqdm", *argv])


def test_completions_with_ignore_eos(fake, default_model_dir: Path, tmp_path: Path, capsys) -> None:
    url, state = fake(first_token_delay=0.03, token_delay=0.004)
    out = tmp_path / "r.json"
    rc = run_bench(default_model_dir, "--base-url", url, "--num-prompts", "12", "--input-len", "40",
                   "--output-len", "10", "--range-ratio", "0.5", "--ignore-eos", "--seed", "7",
                   "--result-json", str(out))  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):"):  # fmt: skip
        assert line in printed
    r = json.loads(out.read_text())
    assert r["completed"] == 12 and r["failed"] == 0 and r["model"] == "fake-model"
    # What the server was sent: streaming with usage, ignore_eos, the drawn lengths, the listed model.
    assert len(state.received) == 12
    for body in state.received:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["model"] == "fake-model" and body["temperature"] == 0.0
    rng = random.Random(7)
    want_in = [rng.randint(20, 60) for _ in range(12)]
    want_out = [rng.randint(5, 15) for _ in range(12)]
    assert sorted(count_tokens(tokenizer_of(state), b["prompt"]) for b in state.received) == sorted(want_in)
    # Token counts come from the usage chunk: exact with ignore_eos.
    assert sorted(q["output_len"] for q in r["requests"]) == sorted(want_out)
    assert sorted(q["prompt_len"] for q in r["requests"]) == sorted(want_in)
    assert r["total_output_tokens"] == sum(want_out) and r["total_input_tokens"] == sum(want_in)
    for q in r["requests"]:
        assert q["success"] and q["usage_reported"]
        assert q["ttft"] >= 0.03 and q["latency"] > q["ttft"]
        assert len(q["itl"]) == q["output_len"] - 1
        assert q["tpot"] == pytest.approx((q["latency"] - q["ttft"]) / (q["output_len"] - 1))
        assert q["tpot"] >= 0.003
    assert r["mean_ttft_ms"] >= 30 and r["p99_ttft_ms"] >= r["median_ttft_ms"]
    assert 3 <= r["median_itl_ms"] < 100
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["config"]["request_rate"] is None  # inf is not JSON


def tokenizer_of(state: FakeState):
    return state.tokenizer


def test_chat_without_ignore_eos_stops_at_eos(fake, default_model_dir: Path, tmp_path: Path) -> None:
    url, state = fake(eos_after=3, first_token_delay=0.02)
    out = tmp_path / "r.json"
    rc = run_bench(default_model_dir, "--base-url", url + "/v1", "--endpoint", "chat", "--num-prompts", "4",
                   "--input-len", "16", "--output-len", "8", "--model", "given", "--result-json", str(out))  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert all(b["model"] == "given" and "ignore_eos" not in b for b in state.received)
    assert all(b["messages"][0]["role"] == "user" for b in state.received)
    assert [q["output_len"] for q in r["requests"]] == [3] * 4
    # The role-only first chunk is not the first token: TTFT includes the server's first-token delay.
    assert all(q["ttft"] >= 0.02 for q in r["requests"])
    assert all(q["prompt_len"] == 16 + 5 for q in r["requests"])  # the fake adds 5 "template" tokens


def test_max_concurrency_is_respected(fake, default_model_dir: Path) -> None:
    url, state = fake(token_delay=0.01)
    rc = run_bench(default_model_dir, "--base-url", url, "--num-prompts", "8", "--input-len", "8",
                   "--output-len", "5", "--ignore-eos", "--max-concurrency", "2")  # fmt: skip
    assert rc == 0
    assert state.max_in_flight == 2


def test_poisson_arrivals_follow_the_rate(fake, default_model_dir: Path) -> None:
    url, state = fake(first_token_delay=0.001, token_delay=0.001)
    rc = run_bench(default_model_dir, "--base-url", url, "--num-prompts", "8", "--input-len", "8",
                   "--output-len", "2", "--request-rate", "20", "--seed", "11")  # fmt: skip
    assert rc == 0
    rng = random.Random(11)  # the schedule the benchmark draws: 7 gaps between 8 requests
    expected = sum(rng.expovariate(20) for _ in range(7))
    span = state.arrivals[-1] - state.arrivals[0]
    assert expected * 0.8 - 0.02 < span < expected + 0.5


def test_failures_are_counted(fake, default_model_dir: Path, tmp_path: Path, capsys) -> None:
    url, _ = fake(fail_every=3)
    out = tmp_path / "r.json"
    rc = run_bench(default_model_dir, "--base-url", url, "--num-prompts", "9", "--input-len", "8",
                   "--output-len", "3", "--result-json", str(out), "--max-concurrency", "1")  # fmt: skip
    assert rc == 1
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 3
    assert any("HTTP 500" in e for e in r["errors"])
    assert "Failed requests:" in capsys.readouterr().out


def test_without_usage_tokens_are_counted_locally(fake, default_model_dir: Path, tmp_path: Path, tokenizer) -> None:
    url, _ = fake(send_usage=False)
    out = tmp_path / "r.json"
    rc = run_bench(default_model_dir, "--base-url", url, "--num-prompts", "2", "--input-len", "8",
                   "--output-len", "4", "--ignore-eos", "--result-json", str(out))  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    generated = " t0 t1 t2 t3"
    assert all(not q["usage_reported"] for q in r["requests"])
    assert [q["output_len"] for q in r["requests"]] == [count_tokens(tokenizer, generated)] * 2
    assert [q["prompt_len"] for q in r["requests"]] == [8, 8]


def test_compare_two_servers_and_plot(fake, default_model_dir: Path, tmp_path: Path, capsys) -> None:
    fast, _ = fake(token_delay=0.004)
    slow, slow_state = fake(token_delay=0.02)
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    rc = run_bench(default_model_dir, "--base-url", fast, "--compare-base-url", slow, "--num-prompts", "6",
                   "--input-len", "8", "--output-len", "6", "--ignore-eos", "--result-json", str(out),
                   "--plot", str(png))  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Comparison" in printed and "B/A" in printed
    r = json.loads(out.read_text())
    assert r["base_url"] == fast and r["compare"]["base_url"] == slow
    # The same workload went to both servers.
    assert r["total_output_tokens"] == r["compare"]["total_output_tokens"] == 36
    assert r["total_input_tokens"] == r["compare"]["total_input_tokens"]
    assert len(slow_state.received) == 6
    assert r["ratio"]["median_tpot_ms"] > 2.0
    assert r["ratio"]["median_tpot_ms"] == pytest.approx(r["compare"]["median_tpot_ms"] / r["median_tpot_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_is_an_error(default_model_dir: Path, capsys) -> None:
    from fake_openai_server import free_port

    rc = run_bench(default_model_dir, "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1")
    assert rc == 2
    assert "servelm bench" in capsys.readouterr().err


def test_cli_registration() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    bench.add_parser(sub)
    args = parser.parse_args(["bench", "--num-prompts", "3", "--request-rate", "2.5", "--endpoint", "chat"])
    assert args.func is bench.run and args.num_prompts == 3 and args.request_rate == 2.5
    assert args.base_url == "http://127.0.0.1:8000"
    r = subprocess.run(
        [sys.executable, "-m", "servelm.bench.loadgen", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "--compare-base-url" in r.stdout
