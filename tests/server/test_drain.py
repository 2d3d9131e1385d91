"""SIGTERM with requests that outlive ``--drain-timeout``: a real ``servelm serve`` process and the default model.

Every request the deadline cuts must still end as its protocol says a failed request ends (an error
event then ``[DONE]``, ``response.failed``, a 503), a request that finishes in time ends normally, and
the process exits 0.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest
from proc_harness import ServeProcess

DRAIN_S = 1.5
LONG = {"temperature": 0, "ignore_eos": True}  # long enough to outlive the drain by far (≥ 8 s here, int4 by default)
LONG_TOKENS = 900


class Call(threading.Thread):
    """One HTTP request in a thread: its status, raw body and when the body ended (or its exception)."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first_bytes = threading.Event()
        self.status = 0
        self.raw = b""
        self.ended = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as r:
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.raw += chunk
                    self.first_bytes.set()
            self.ended = time.monotonic()
        except BaseException as e:  # the test reports it
            self.error = e
        finally:
            self.first_bytes.set()


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r"^servelm_num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _sse_data(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n"), raw[-200:]
    return [e[len("data: ") :] for e in raw.decode().split("\n\n")[:-1]]


def _typed_events(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\n\n"), raw[-200:]
    return [json.loads(e.split("\ndata: ", 1)[1]) for e in raw.decode().split("\n\n")[:-1]]


@pytest.mark.slow  # a servelm serve process
def test_drain_deadline_ends_every_request_with_an_error_and_exits_0() -> None:
    args = (
        "--kv-cache-memory",
        "256MiB",
        "--max-model-len",
        "1024",
        "--no-access-log",
        "--drain-timeout",
        str(DRAIN_S),
    )
    with ServeProcess(*args) as srv:
        v1 = f"{srv.url}/v1"
        long_calls = {
            "completions": Call(f"{v1}/completions", {"prompt": "Count: one, two,", "max_tokens": LONG_TOKENS, "stream": True, **LONG}),
            "chat": Call(f"{v1}/chat/completions", {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": LONG_TOKENS, "stream": True, **LONG}),
            "responses": Call(f"{v1}/responses", {"input": "Count to a thousand.", "max_output_tokens": LONG_TOKENS, "stream": True, **LONG}),
            "plain": Call(f"{v1}/completions", {"prompt": "Count: one, two,", "max_tokens": LONG_TOKENS, **LONG}),
        }  # fmt: skip
        for call in long_calls.values():
            call.start()
        deadline = time.monotonic() + 120
        while _running(srv.url) < len(long_calls) or not all(
            c.first_bytes.is_set() for n, c in long_calls.items() if n != "plain"
        ):
            assert time.monotonic() < deadline, srv.log
            time.sleep(0.1)
        short = Call(f"{v1}/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True, **LONG})
        short.start()
        assert short.first_bytes.wait(60)
        signalled = time.monotonic()
        srv.terminate()
        for call in (short, *long_calls.values()):
            call.join(60)
            assert not call.is_alive()
        assert srv.wait(timeout=30) == 0, srv.log

    for name, call in {"short": short, **long_calls}.items():
        assert call.error is None, f"{name}: {call.error!r}\n{srv.log}"
    # In flight at the signal, done within the deadline: it ends as usual.
    events = _sse_data(short.raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"

    for name in ("completions", "chat"):
        call = long_calls[name]
        events = _sse_data(call.raw)
        assert events[-1] == "[DONE]", (name, events[-3:])
        err = json.loads(events[-2])
        assert err["error"]["code"] == "shutting_down", (name, err)
        assert all("error" not in json.loads(e) for e in events[:-2]), name
        assert all(json.loads(e)["choices"][0].get("finish_reason") is None for e in events[:-2]), name
    typed = _typed_events(long_calls["responses"].raw)
    assert typed[-1]["type"] == "response.failed", typed[-1]
    assert typed[-1]["response"]["status"] == "failed" and typed[-1]["response"]["error"]["message"]
    plain = long_calls["plain"]
    assert plain.status == 503, plain.raw
    assert json.loads(plain.raw)["error"]["code"] == "shutting_down"

    # Cut at servelm's deadline, not uvicorn's (which would have cancelled them without a word).
    for name, call in long_calls.items():
        assert DRAIN_S - 0.2 <= call.ended - signalled <= DRAIN_S + 3.0, (name, call.ended - signalled)
    assert "timeout graceful shutdown exceeded" not in srv.log, srv.log


@pytest.mark.slow  # a servelm serve process
def test_requests_arriving_during_the_drain_get_503_until_the_running_ones_end() -> None:
    """The listener stays open while requests run: new ones, on new and on kept-alive connections,
    get the documented 503 (OpenAI's shape, ``Retry-After``), readiness fails and liveness holds."""
    drain_s = 4.0
    args = (
        "--kv-cache-memory",
        "256MiB",
        "--max-model-len",
        "1024",
        "--no-access-log",
        "--drain-timeout",
        str(drain_s),
    )
    with ServeProcess(*args) as srv:
        v1 = f"{srv.url}/v1"
        with httpx.Client(timeout=30) as kept:
            assert kept.get(f"{srv.url}/health").status_code == 200  # a keep-alive connection from before
            long = Call(
                f"{v1}/completions", {"prompt": "Count: one, two,", "max_tokens": LONG_TOKENS, "stream": True, **LONG}
            )
            long.start()
            assert long.first_bytes.wait(60)
            signalled = time.monotonic()
            srv.terminate()
            time.sleep(0.5)
            body = {"prompt": "Hello", "max_tokens": 2}
            for r in (
                kept.post(f"{v1}/completions", json=body),
                httpx.post(f"{v1}/completions", json=body, timeout=30),
            ):
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "shutting_down" and set(r.json()["error"]) == {
                    "message",
                    "type",
                    "param",
                    "code",
                }
                assert int(r.headers["retry-after"]) >= 1
            health = httpx.get(f"{srv.url}/health", timeout=30)
            assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
            live = httpx.get(f"{srv.url}/live", timeout=30)
            assert live.status_code == 200 and live.json() == {"status": "draining"}
            assert time.monotonic() - signalled < drain_s - 1.0  # all of it while the long request ran
            long.join(60)
            assert not long.is_alive()
        assert srv.wait(timeout=30) == 0, srv.log
    assert long.error is None, f"{long.error!r}\n{srv.log}"
    events = _sse_data(long.raw)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
    assert drain_s - 0.2 <= long.ended - signalled <= drain_s + 3.0
