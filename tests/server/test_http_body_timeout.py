"""Connections that never finish a request body: answered 408 and closed after ``--body-timeout``,
while ``/health``, ``/live`` and ``/metrics`` still answer beyond ``--max-connections`` (a real
``servelm serve`` process, raw loopback sockets)."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from proc_harness import ServeProcess

BODY_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 6
DRIP_EVERY_S = 0.5
# A full head announcing a body that never comes whole: by length, chunked, and on a route that
# answers without reading it (405), where only the timer ends the connection.
HEADS = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n{",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
    b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n{",
    b"POST /live HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4096\r\n\r\n{",
)


class Dripper:
    """One connection that sent a whole head and then drips its body, a byte each ``DRIP_EVERY_S``."""

    def __init__(self, port: int, head: bytes) -> None:
        self.head = head
        self.chunked = b"chunked" in head
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(head)
        self.sock.setblocking(False)
        self.received = b""
        self.closed_at: float | None = None

    def drip(self) -> None:
        if self.closed_at is None:
            try:
                self.sock.send(b"1\r\n \r\n" if self.chunked else b" ")
            except (BrokenPipeError, ConnectionResetError, BlockingIOError):
                pass

    def poll(self) -> None:
        while self.closed_at is None:
            try:
                chunk = self.sock.recv(65536)
            except BlockingIOError:
                return
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed_at = time.monotonic()
            self.received += chunk


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(2))


def _status_and_body(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _one_response(s: socket.socket) -> bytes:
    """One whole response (by its Content-Length) from a kept-alive connection, nothing of the next."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    _, headers, body = _status_and_body(raw)
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        raw, body = raw + chunk, body + chunk
    return raw


def test_body_timeout_flag_reaches_the_protocol() -> None:
    from servelm.server.cli import _make_uvicorn_server, build_parser

    def config(*flags: str):
        return _make_uvicorn_server(None, build_parser().parse_args(["serve", *flags]), lambda: None).config

    assert config().http.body_timeout_s == 60.0
    assert config("--body-timeout", "2.5").http.body_timeout_s == 2.5
    for bad in (["--body-timeout", "0"], ["--body-timeout", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


def test_dripped_bodies_get_408_and_close_while_probes_answer(tiny_llama_dir: Path) -> None:
    args = ("--model", str(tiny_llama_dir), "--kv-cache-memory", "16MiB", "--no-access-log",
            "--body-timeout", str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS))  # fmt: skip
    with ServeProcess(*args) as srv:
        drippers = [Dripper(srv.port, HEADS[i % len(HEADS)]) for i in range(MAX_CONNECTIONS)]
        opened = time.monotonic()
        try:
            probes = 0
            # Every connection under the cap is held: the probes still answer (each on a connection of
            # its own beyond the cap, closed after its answer), other requests get uvicorn's 503.
            while any(d.closed_at is None for d in drippers):
                assert time.monotonic() - opened < BODY_TIMEOUT_S + 5, [d.received for d in drippers]
                for d in drippers:
                    d.drip()
                    d.poll()
                if time.monotonic() - opened < BODY_TIMEOUT_S - 0.5:
                    for path in ("/health", "/live"):
                        r = httpx.get(f"{srv.url}{path}", timeout=10)
                        assert r.status_code == 200 and r.json()["status"] == "ok", (path, r.status_code, r.text)
                        assert r.headers["connection"] == "close"
                        probes += 1
                    assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 503
                time.sleep(DRIP_EVERY_S)
            assert probes >= 4
        finally:
            for d in drippers:
                d.sock.close()
        for d in drippers:
            assert d.closed_at is not None
            # Dripped bytes did not extend the deadline, counted from the head.
            assert BODY_TIMEOUT_S - 0.2 <= d.closed_at - opened <= BODY_TIMEOUT_S + 2.0, (d.head, d.closed_at - opened)
            status, headers, body = _status_and_body(d.received)
            if d.head.startswith(b"POST /live"):
                assert status == 405, d.received  # answered at once, then held only until the deadline
                continue
            assert status == 408, d.received
            assert headers["connection"] == "close"
            error = json.loads(body)
            if d.head.startswith(b"POST /v1/messages"):
                assert error["type"] == "error" and error["error"]["message"], error
            else:
                assert set(error["error"]) == {"message", "type", "param", "code"}, error
                assert error["error"]["code"] == "request_timeout", error

        # On a kept-alive connection each request's body gets its own deadline, from its own head.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            body = b'{"prompt": "hello"}'
            s.sendall(
                b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            first = _one_response(s)
            assert first.startswith(b"HTTP/1.1 200"), first
            time.sleep(BODY_TIMEOUT_S * 0.75)
            s.sendall(HEADS[0])
            head_sent = time.monotonic()
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
            assert raw.startswith(b"HTTP/1.1 408"), raw
            assert BODY_TIMEOUT_S - 0.2 <= time.monotonic() - head_sent <= BODY_TIMEOUT_S + 1.0

        # Nothing was left behind: a normal request is served and no KV block is held.
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert _metric(srv.url, "servelm_kv_cache_usage_perc") == 0.0
        assert _metric(srv.url, "servelm_num_requests_running") == 0.0
        assert "Exception in ASGI application" not in srv.log, srv.log
        srv.terminate()
        assert srv.wait(timeout=30) == 0, srv.log
        assert "Waiting for background tasks" not in srv.log, srv.log  # no handler was left waiting


def test_probes_beyond_the_cap_cannot_hold_connections(tiny_llama_dir: Path) -> None:
    """The exemption serves small body-less GETs only, and closes their connections, so it holds nothing."""
    args = ("--model", str(tiny_llama_dir), "--kv-cache-memory", "16MiB", "--no-access-log", "--max-connections", "2")
    with ServeProcess(*args) as srv:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(2)]
        try:
            for s in held:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            time.sleep(0.3)
            for probe in (
                b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                b"HEAD /live HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
            ):
                with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                    s.sendall(probe + probe)  # a second, pipelined request is not answered
                    raw = b""
                    while chunk := s.recv(65536):
                        raw += chunk
                    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
                    assert raw.count(b"HTTP/1.1 ") == 1, raw[:200]
            # Not exempt beyond the cap: a body, another method, another path.
            for request in (
                b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n ",
                b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
                b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n",
            ):
                with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                    s.sendall(request)
                    raw = b""
                    while chunk := s.recv(65536):
                        raw += chunk
                    assert raw.startswith(b"HTTP/1.1 503"), (request, raw[:200])
        finally:
            for s in held:
                s.close()
        # Nothing runs: SIGTERM ends the process at once, not after --drain-timeout (30 s).
        signalled = time.monotonic()
        srv.terminate()
        assert srv.wait(timeout=30) == 0, srv.log
        assert time.monotonic() - signalled < 5.0
