"""Two servelm replicas (real processes, a tiny random Llama) behind the routers people scale out with:
vllm-router and sglang-router (PyPI), each with ``cache_aware`` and ``round_robin``. Completions, chat, responses,
streaming, n>1, the routers' own fields and an abort mid-stream go through each; then a shared-prefix
workload (8 system prompts x 16 users) shows what ``cache_aware`` buys in prefix-cache hits.

The replicas' KV pools hold about six of the eight system prompts each: under ``round_robin`` every
replica sees all eight and evicts, under ``cache_aware`` each sees about half and keeps them.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proc_harness import ServeProcess

ROUTERS = ("vllm", "sglang")
POLICIES = ("cache_aware", "round_robin")
MODEL = "tiny"
# 128 blocks of 16 tokens per replica: ~6 of the workload's ~20-block system prompts, and one 512-token request.
REPLICA_ARGS = (
    "--served-model-name", MODEL, "--num-threads", "1", "--kv-cache-memory", "1536KiB",
    "--max-model-len", "512", "--no-access-log", "--seed", "0",
)  # fmt: skip
http = httpx.Client(timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RouterUnavailable(Exception):
    """This router cannot run here (not installed: PyPI has no wheel for the platform; or its binary fails)."""


def _router_argv(router: str, policy: str, port: int, workers: list[str]) -> list[str]:
    if router == "vllm":
        exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
        if exe is None:
            raise RouterUnavailable(
                "vllm-router is not installed (PyPI has Linux wheels only; pip install -e '.[test]')"
            )
        return [
            exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
            "--prometheus-port", str(_free_port()),
        ]  # fmt: skip
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise RouterUnavailable(
            "sglang-router is not installed (no wheel for Linux aarch64; pip install -e '.[test]')"
        ) from None
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers, "--policy", policy, "--prometheus-port", str(_free_port()),
    ]  # fmt: skip


class Router:
    """A router process over the replicas, its output in a log file."""

    def __init__(self, router: str, policy: str, workers: list[str], log: Path) -> None:
        self.name = f"{router}-{policy}"
        self.port = _free_port()
        self.log = log
        argv = _router_argv(router, policy, self.port, workers)
        try:
            self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
        except OSError as e:  # a binary built for another platform
            raise RouterUnavailable(f"{router}-router cannot run here: {e}") from None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                output = self.log.read_text()[-2000:]
                if "Exec format error" in output or "GLIBC" in output:
                    raise RouterUnavailable(f"{self.name} cannot run on this platform: {output}")
                raise AssertionError(f"{self.name} exited {self.proc.returncode}: {output}")
            try:
                r = http.post(f"{self.url}/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 1})
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not ready in {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[list[ServeProcess]]:
    procs = [ServeProcess("--model", str(tiny_llama_dir), *REPLICA_ARGS) for _ in range(2)]
    starts = [threading.Thread(target=p.start) for p in procs]  # the two load side by side
    try:
        for t in starts:
            t.start()
        for t in starts:
            t.join()
        for p in procs:
            assert p.port, p.log
        yield procs
    finally:
        for p in procs:
            p.__exit__()


class Routers:
    """The routers started for the module, and why the others could not start."""

    def __init__(self) -> None:
        self.started: dict[str, Router] = {}
        self.unavailable: dict[str, str] = {}

    def url(self, name: str) -> str:
        if name in self.unavailable:
            pytest.skip(self.unavailable[name])
        return self.started[name].url


@pytest.fixture(scope="module")
def routers(replicas: list[ServeProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    """Each router with each policy, started once for the module over the same two replicas."""
    logs = tmp_path_factory.mktemp("routers")
    workers = [r.url for r in replicas]
    out = Routers()
    try:
        for router in ROUTERS:
            for policy in POLICIES:
                try:
                    r = Router(router, policy, workers, logs / f"{router}-{policy}.log")
                except RouterUnavailable as e:
                    out.unavailable[f"{router}-{policy}"] = str(e)
                else:
                    out.started[r.name] = r
        for name, r in list(out.started.items()):
            try:
                r.wait_ready()
            except RouterUnavailable as e:
                out.unavailable[name] = str(e)
        yield out
    finally:
        for r in out.started.values():
            r.stop()


def _metric(replicas: list[ServeProcess], name: str, label: str = "") -> float:
    """``name`` summed over the replicas and over its label sets (those with ``label``, e.g. 'reason="aborted"')."""
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? (\S+)$", re.M)
    total = 0.0
    for rep in replicas:
        text = http.get(f"{rep.url}/metrics").text
        total += sum(float(m.group(1)) for m in pattern.finditer(text) if label in m.group(0))
    return total


def _wait_idle(replicas: list[ServeProcess], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(replicas, "servelm_num_requests_running") or _metric(replicas, "servelm_kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the replicas still run requests or hold KV blocks"
        time.sleep(0.05)


ALL = [f"{r}-{p}" for r in ROUTERS for p in POLICIES]
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("name", ALL)
def test_completions_chat_streaming_and_n_through_the_router(routers: Routers, name: str) -> None:
    url = routers.url(name)
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 6, "gateway_hint": 1}
    r = http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "trace-1"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["id"].startswith("cmpl-")
    assert r.headers["x-request-id"] == "trace-1"
    # Ignored and named, through the router; the router's own fields (no_stop_trim...) are known ones.
    assert r.headers["x-servelm-ignored-fields"] == "gateway_hint"
    r = http.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4, "n": 2})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 8
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"completion_tokens":5' in events[-2]
    r = http.post(f"{url}/v1/responses", json={"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("router", ROUTERS)
def test_stop_strings_are_kept_when_the_router_says_no_stop_trim(routers: Routers, router: str) -> None:
    url = routers.url(f"{router}-round_robin")  # both replicas: the same greedy tokens
    base = {"model": MODEL, "prompt": "The weather today", "max_tokens": 12, "temperature": 0}
    text = http.post(f"{url}/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    head = text[: text.index(stop)]
    for keep, expected in ((False, head), (True, head + stop)):
        choice = http.post(f"{url}/v1/completions", json={**base, "stop": [stop], "no_stop_trim": keep}).json()[
            "choices"
        ][0]
        assert (choice["text"], choice["finish_reason"]) == (expected, "stop")


@pytest.mark.parametrize("name", ALL)
def test_an_abort_mid_stream_reaches_the_replica(routers: Routers, replicas: list[ServeProcess], name: str) -> None:
    _wait_idle(replicas)
    aborted = _metric(replicas, "servelm_request_failure_total", 'reason="aborted"')
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 450, "ignore_eos": True, "stream": True}
    with http.stream("POST", f"{routers.url(name)}/v1/chat/completions", json=body) as s:
        lines = s.iter_lines()
        assert [next(lines) for _ in range(6)]  # tokens flow: the request runs on a replica
        assert _metric(replicas, "servelm_num_requests_running") == 1
    _wait_idle(replicas)  # running back to 0, every KV block back
    assert _metric(replicas, "servelm_request_failure_total", 'reason="aborted"') == aborted + 1


WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
]


def _shared_prefix_hits(url: str, replicas: list[ServeProcess], tag: str) -> float:
    """8 system prompts x 16 users, in a fixed shuffled order, 4 at a time: the prefix-cache hit tokens
    it added on the replicas. ``tag`` starts every system prompt so no earlier run's blocks match."""
    systems = [f"[{tag}] You are assistant {i}. " + " ".join(random.Random(i).choices(WORDS, k=200)) for i in range(8)]
    work = [(s, u) for s in range(8) for u in range(16)]
    random.Random(7).shuffle(work)

    def one(item: tuple[int, int]) -> None:
        s, u = item
        messages = [
            {"role": "system", "content": systems[s]},
            {"role": "user", "content": f"User {u} asks about topic {s}."},
        ]
        r = http.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text

    _wait_idle(replicas)
    before = _metric(replicas, "servelm_prefix_cache_hits_total")
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, work))
    return _metric(replicas, "servelm_prefix_cache_hits_total") - before


@pytest.mark.parametrize("router", ROUTERS)
def test_cache_aware_routing_gets_more_prefix_hits_than_round_robin(
    routers: Routers, replicas: list[ServeProcess], router: str
) -> None:
    hits = {p: _shared_prefix_hits(routers.url(f"{router}-{p}"), replicas, f"{router}-{p}") for p in POLICIES}
    print(f"\n{router}-router, 8 system prompts x 16 users: prefix-cache hit tokens summed over 2 replicas: {hits}")
    assert hits["cache_aware"] > hits["round_robin"], hits
