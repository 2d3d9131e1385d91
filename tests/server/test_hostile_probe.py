"""Issue 20's hostile probe replayed against ONE real ``servelm serve`` process on the default model.

Each fault request is sent in turn (the engine-killing sampler overflow, the amplifying bodies, user
input that used to be a 500, half-open connections); afterwards the server must be healthy, serve a
normal request with its usual answer, and hold no KV block. Each fault also has its own test; this
one proves that none of them leaves anything behind for the next.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
from proc_harness import ServeProcess

HEAD_TIMEOUT_S = 2.0


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _ask_capital(v1: str) -> str:
    r = httpx.post(
        f"{v1}/chat/completions",
        json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_every_fault_request_in_turn_leaves_the_server_whole() -> None:
    args = ("--kv-cache-memory", "128MiB", "--max-model-len", "2048", "--no-access-log",
            "--header-timeout", str(HEAD_TIMEOUT_S))  # fmt: skip
    with ServeProcess(*args) as srv:
        v1 = f"{srv.url}/v1"
        before = _ask_capital(v1)
        assert "Paris" in before
        with httpx.Client(timeout=60) as c:
            # Fault 1: the sampler overflow that killed the engine for good (and its garbage twin).
            for extra in ({"temperature": 0.9, "top_p": 0.95}, {"temperature": 0.5}):
                r = c.post(f"{v1}/completions", json={"prompt": "hi hi hi", "max_tokens": 4, "repetition_penalty": 1e-38, **extra})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 4
            # Fault 3: one request that holds the tokenizer, one that taxes every batchmate's step.
            t0 = time.monotonic()
            r = c.post(f"{v1}/completions", json={"prompt": ["hi " * 220_000] * 50, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
            assert time.monotonic() - t0 < 5.0
            r = c.post(f"{v1}/completions", json={"prompt": "hi", "max_tokens": 2, "n": 32,
                                                  "logit_bias": {str(i): 1 for i in range(49152)}})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text[:300]
            # Fault 5: user input that was a 500.
            for path, body in (
                ("/completions", {"prompt": "\ud800 hi", "max_tokens": 2}),
                ("/chat/completions", {"messages": [{"role": "user", "content": "\ud800 hi"}], "max_tokens": 2}),
                ("/responses", {"input": "\ud800 hi", "max_output_tokens": 2}),
                ("/completions", {"prompt": "hi", "max_tokens": 8, "min_tokens": 3, "structured_outputs": {"regex": ""}}),
                ("/completions", {"prompt": "hi", "max_tokens": 8, "min_tokens": 3, "stream": True, "structured_outputs": {"regex": ""}}),
            ):
                # json.dumps escapes the lone surrogate as \ud800, as a hostile client sends it.
                r = c.post(f"{v1}{path}", content=json.dumps(body), headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, r.status_code, r.text[:300])
                assert r.json()["error"]["param"], (path, r.text[:300])
            r = c.post(f"{srv.url}/tokenize", content=json.dumps({"prompt": "\ud800 hi"}), headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]

        # Fault 6: half-sent request heads are closed by the server after the head timeout.
        stalled = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(20)]
        for s in stalled:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(HEAD_TIMEOUT_S + 1.0)
        for s in stalled:
            assert s.recv(1024) == b"", "a stalled connection was still open after the head timeout"
            s.close()

        # And the server is whole: alive, answering as before, holding no KV block, no engine death.
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert _ask_capital(v1) == before
        assert _metric(srv.url, "servelm_kv_cache_usage_perc") == 0.0
        assert _metric(srv.url, "servelm_num_requests_running") == 0.0
        srv.terminate()
        assert srv.wait(timeout=30) == 0, srv.log
