"""``servelm serve`` runs its engine in an engine-core process (the default): a real server and the
default model, its core killed or its API process killed under it.

- kill -9 of the core mid-stream: the stream ends with an error event, ``/health`` answers 503 while
  the API process stops, and it exits non-zero;
- kill -9 of the API process: the core sees its parent gone and exits within a couple of seconds;
- the split and ``--engine-in-process`` give the same greedy tokens; a stop string cuts the output
  where it starts (the API process finds it in the token ids the core sends).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from proc_harness import ServeProcess, all_exit

LONG = {"prompt": "Count: one, two,", "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out


def _core_pid(server: ServeProcess) -> int:
    assert server.proc is not None
    kids = _children(server.proc.pid)
    cores = [k for k in kids if _is_core(k)]
    assert len(cores) == 1, (kids, server.log)
    return cores[0]


def _is_core(pid: int) -> bool:
    # multiprocessing's spawned child (its resource tracker is the other child, and no core)
    return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux /proc")
def test_killing_the_core_fails_the_stream_and_stops_the_server() -> None:
    with ServeProcess() as server:
        core = _core_pid(server)
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first.wait(60)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        # /health answers 503 from when the death is seen until the server stops listening and exits.
        health: int | None = 200
        while time.monotonic() - killed < 5:
            try:
                health = httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                health = None  # it stopped listening
            if health != 200:
                break
            time.sleep(0.02)
        t.join(30)
        assert not t.is_alive()
        errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors, events[-3:]
        assert "engine" in errors[0]["error"]["message"]
        assert events[-1] == "[DONE]"
        assert health in (503, None), health
        code = server.wait(30)
        assert code != 0, server.log
        assert time.monotonic() - killed < 30
        assert "engine core exited" in server.log


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux /proc")
def test_killing_the_api_process_ends_the_core() -> None:
    with ServeProcess() as server:
        core = _core_pid(server)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        assert all_exit([core], 5), "the engine core outlived its API process"


def _greedy(server: ServeProcess) -> list[str]:
    texts = []
    for prompt in ("The capital of France is", "def fib(n):", "Once upon a time"):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        texts.append(json.dumps(r.json()["choices"][0]["logprobs"]["tokens"]))
    return texts


def _stop_strings(server: ServeProcess) -> None:
    """A stop string cuts the server's own greedy output where the string starts, streamed or not, and
    the completion's token count ends at the token that completed it (the API process finds it)."""
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "logprobs": 0}
    free = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, tokens = free["text"], free["logprobs"]["tokens"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected_tokens = next(k for k in range(1, len(tokens) + 1) if stop in "".join(tokens[:k]))
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["text"] == text[: text.index(stop)]
    assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("stop", expected_tokens)
    streamed, finish = "", None
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stop": [stop], "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += choice["text"]
                finish = choice["finish_reason"] or finish
    assert (streamed, finish) == (text[: text.index(stop)], "stop")


def test_split_and_in_process_agree() -> None:
    with ServeProcess() as split:
        _stop_strings(split)
        a = _greedy(split)
        assert split.proc is not None and len([k for k in _children(split.proc.pid) if _is_core(k)]) == 1
        split.terminate()
        assert split.wait(60) == 0, split.log
    with ServeProcess("--engine-in-process") as alone:
        b = _greedy(alone)
        assert alone.proc is not None and _children(alone.proc.pid) == []
    assert a == b
