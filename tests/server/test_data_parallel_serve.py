"""``--data-parallel-size 2``: two engine cores behind one API process, a real server and the default model.

Greedy outputs equal one core's; requests land on both cores (``/metrics`` labels each core's series);
a prompt whose first blocks were seen before meets its prefix cache on the same core; a client that
disconnects frees its blocks; kill -9 of one core fails every stream and the server exits non-zero.
With ``--api-server-count 2`` both API processes reach both cores. One server serves the tests in order;
the last one kills it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proc_harness import ServeProcess, all_exit
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from /proc")

PROMPTS = ("The capital of France is", "def fib(n):", "Once upon a time", "The best way to learn")
# Longer than the affinity blocks (4 x 16 tokens): what follows them does not change the core.
PREFIX = "You are a careful assistant. " * 12
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}


def _greedy(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        texts.append(json.dumps(r.json()["choices"][0]["logprobs"]["tokens"]))
    return texts


def _per_engine(url: str, name: str) -> dict[str, float]:
    """A metric's value summed per ``engine`` label."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name and "engine" in s.labels:
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def _cores(pid: int) -> list[int]:
    kids = [int(k) for task in Path(f"/proc/{pid}/task").iterdir() for k in (task / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def one_core() -> list[str]:
    with ServeProcess() as server:
        texts = _greedy(server.url)
        server.terminate()
        assert server.wait(60) == 0, server.log
    return texts


@pytest.fixture(scope="module")
def dp(one_core: list[str]) -> Iterator[ServeProcess]:
    with ServeProcess("--data-parallel-size", "2") as server:
        yield server


def test_two_cores_answer_as_one(dp: ServeProcess, one_core: list[str]) -> None:
    assert dp.proc is not None and len(_cores(dp.proc.pid)) == 2, dp.log
    assert "engine core 0: CPUs" in dp.log and "engine core 1: CPUs" in dp.log
    assert _greedy(dp.url) == one_core
    served = _per_engine(dp.url, "servelm_request_success_total")
    assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == len(PROMPTS)
    # A stop string is found in this process, and the core running the request is told to finish it.
    for _ in range(2):  # (one request on each core)
        body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "stop": ["answer"]}
        choice = httpx.post(f"{dp.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and "answer" not in choice["text"], choice


def test_a_shared_prefix_meets_its_cache_on_the_same_core(dp: ServeProcess) -> None:
    cached = []
    for tail in ("First question: why?", "Second question: how?", "Third question: when?"):
        body = {"prompt": PREFIX + tail, "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{dp.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # One-at-a-time requests without a shared prefix take the cores in turn; these all meet the first's blocks.
    assert cached[0] == 0 and cached[1] >= 64 and cached[2] >= 64, cached
    hits = _per_engine(dp.url, "servelm_prefix_cache_hits_total")
    assert sorted(hits.values())[0] == 0 and sorted(hits.values())[1] >= 128, hits


def test_a_client_that_disconnects_frees_its_blocks(dp: ServeProcess) -> None:
    with httpx.stream("POST", f"{dp.url}/v1/completions", json={**LONG, "prompt": "Count: one, two,"}, timeout=60) as r:
        for n, line in enumerate(r.iter_lines()):
            if line.startswith("data: ") and n > 6:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        usage = _per_engine(dp.url, "servelm_kv_cache_usage_perc")
        running = _per_engine(dp.url, "servelm_num_requests_running")
        if set(usage) == {"0", "1"} and not any(usage.values()) and not any(running.values()):
            break
        time.sleep(0.2)
    assert not any(usage.values()) and not any(running.values()), (usage, running)


def test_two_api_processes_in_front_of_two_cores() -> None:
    with ServeProcess("--data-parallel-size", "2", "--api-server-count", "2") as server:
        assert server.proc is not None
        deadline = time.monotonic() + 180
        while server.log.count("servelm listening on") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        spawned = _cores(server.proc.pid)
        assert len(spawned) == 3, server.log  # two cores and the second API process
        for i in range(8):
            body = {"prompt": f"Hello number {i}", "max_tokens": 4, "temperature": 0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120, headers={"Connection": "close"})
            assert r.status_code == 200, r.text
        served = _per_engine(server.url, "servelm_request_success_total")
        assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
        server.terminate()
        assert server.wait(90) == 0, server.log
        assert all_exit(spawned, 10)


def test_killing_one_core_fails_every_stream_and_stops_the_server(dp: ServeProcess) -> None:
    assert dp.proc is not None
    events: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        body = {**LONG, "prompt": f"Stream {i}: one, two,"}
        try:
            with httpx.stream("POST", f"{dp.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[6:])
                        started[i].set()
        except httpx.HTTPError as e:  # the connection cut is an error too
            events[i].append(json.dumps({"error": {"message": f"engine connection: {e}"}}))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    assert all(s.wait(120) for s in started)
    running = _per_engine(dp.url, "servelm_num_requests_running")
    assert running == {"0": 1.0, "1": 1.0}, running  # one stream on each core
    os.kill(_cores(dp.proc.pid)[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
    for ev in events:
        errors = [json.loads(e) for e in ev if e != "[DONE]" and "error" in json.loads(e)]
        assert errors, ev[-3:]
        assert "engine" in errors[0]["error"]["message"]
    assert dp.wait(60) != 0, dp.log
    assert "engine core" in dp.log
