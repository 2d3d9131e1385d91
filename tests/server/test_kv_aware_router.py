"""vllm-router (PyPI, Rust) with ``--policy kv_aware`` over two servelm replicas on loopback: the router
learns each replica's prefix cache from the KV events it publishes (--kv-events-config) and the
prompt tokens from /v1/(chat/)completions/render, and sends a request to the replica holding its prefix.

Each prefix is put on its replica directly, not through the router, so only the events can tell the
router where it lives; then requests of both families alternate through the router."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from proc_harness import ServeProcess

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
MODEL = "tiny"
FOLLOWERS = 4  # routed requests per prefix family


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(replica: ServeProcess, name: str) -> float:
    """A counter of the replica, summed over its labels (render calls run no request: not counted)."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def served(replicas: list[ServeProcess]) -> list[int]:
    return [int(metric(r, "servelm_request_success_total")) for r in replicas]


def log_text(log: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # without the colours


def batches_seen(log: Path, replica: ServeProcess) -> int:
    """Event batches the router took from ``replica`` (its debug log names each sequence number)."""
    return log_text(log).count(f"live sequence advanced source={replica.url} rank=0")


def wait_for(condition: Any, what: str, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}; router log: {log_text(log)[-3000:]}"
        time.sleep(0.2)


def start_router(
    replicas: list[ServeProcess], event_ports: list[int], log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", "kv_aware", "--kv-event-model", MODEL,
            "--kv-event-block-size", "16", "--log-level", "debug", "--worker-urls", *[r.url for r in replicas]]  # fmt: skip
    for r, p in zip(replicas, event_ports):
        argv += ["--kv-event-source", f"{r.url}=tcp://127.0.0.1:{p}"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log_text(log)[-3000:]
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("vllm-router did not come up")


@pytest.mark.skipif(not Path(ROUTER).exists(), reason="vllm-router is not installed (the test extra)")
def test_requests_land_on_the_replica_holding_their_prefix(tiny_llama_dir: Path, tmp_path: Path) -> None:
    event_ports = [free_port(), free_port()]
    replicas = [
        ServeProcess(
            "--model",
            str(tiny_llama_dir),
            "--served-model-name",
            MODEL,
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "512",
            "--block-size",
            "16",
            "--kv-events-config",
            f'{{"enable_kv_cache_events": true, "bind": true, "endpoint": "tcp://127.0.0.1:{p}"}}',
        )
        for p in event_ports
    ]
    router = None
    try:
        for r in replicas:
            r.start()
        log = tmp_path / "router.log"
        router, url = start_router(replicas, event_ports, log)
        # Two families, each a shared prefix of several full blocks (the tiny model's real tokenizer).
        doc = "The lighthouse keeper counted ships at dawn and wrote each name in a ledger. " * 6
        system = "You are a terse assistant for a shipping company; answer in one line. " * 6
        with httpx.Client(timeout=60) as http:
            # A PUB socket drops what it sends before a subscriber joined: publish throwaway blocks
            # (a new prompt each time, so that each is stored) until the router took a batch from each.
            attempt = iter(range(10**6))
            for r in replicas:

                def joined(r: ServeProcess = r) -> bool:
                    body = {
                        "model": MODEL,
                        "prompt": f"Warm-up {next(attempt)}: " + "one two three four " * 6,
                        "max_tokens": 1,
                    }
                    assert http.post(f"{r.url}/v1/completions", json=body).status_code == 200
                    return batches_seen(log, r) > 0

                wait_for(joined, f"no KV events from {r.url} reached the router", log)

            def complete(base: str, suffix: str) -> None:
                body = {"model": MODEL, "prompt": doc + suffix, "max_tokens": 2, "temperature": 0}
                assert http.post(f"{base}/v1/completions", json=body).status_code == 200

            def chat(base: str, question: str) -> None:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
                assert http.post(f"{base}/v1/chat/completions", json=body).status_code == 200

            # The router reads a prompt's tokens from the render endpoint: the ids generation uses.
            rendered = http.post(
                f"{replicas[0].url}/v1/completions/render", json={"model": MODEL, "prompt": doc}
            ).json()
            tokenized = http.post(f"{replicas[0].url}/tokenize", json={"model": MODEL, "prompt": doc}).json()
            assert rendered[0]["token_ids"] == tokenized["tokens"] and len(tokenized["tokens"]) >= 64

            seen = [batches_seen(log, r) for r in replicas]
            complete(replicas[0].url, "Which ship came first?")  # the document's blocks on replica 0
            chat(replicas[1].url, "Hello?")  # the system prompt's blocks on replica 1
            for r, n in zip(replicas, seen):
                wait_for(
                    lambda r=r, n=n: batches_seen(log, r) > n, f"the prefix of {r.url} did not reach the router", log
                )
            hits = [metric(r, "servelm_prefix_cache_hits_total") for r in replicas]
            landed = []
            for i in range(FOLLOWERS):
                for send, family in ((complete, 0), (chat, 1)):
                    before = served(replicas)
                    send(url, f"Question {i}: how many ships in the ledger?")
                    after = served(replicas)
                    landed.append((family, [a - b for a, b in zip(after, before)].index(1)))
        assert landed == [(0, 0), (1, 1)] * FOLLOWERS, landed
        # Each follower reused its family's cached blocks (at least 4 full blocks) on that replica.
        gained = [metric(r, "servelm_prefix_cache_hits_total") - h for r, h in zip(replicas, hits)]
        assert all(g >= FOLLOWERS * 64 for g in gained), gained
    finally:
        if router is not None:
            router.kill()
            router.wait()
        for r in replicas:
            r.__exit__()
