"""Connections that never finish a request head: closed after ``--header-timeout``, and at most
``--max-connections`` served at once (a real ``servelm serve`` process, raw loopback sockets)."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import httpx
import pytest
from proc_harness import ServeProcess

HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 12
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appli"


def _stalled(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(HALF_HEAD)
    return s


def _is_open(s: socket.socket) -> bool:
    """Nothing to read yet: neither data nor the server's FIN."""
    readable, _, _ = select.select([s], [], [], 0)
    return not readable


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).status_code


def test_flags_reach_uvicorns_config() -> None:
    from servelm.server.cli import _make_uvicorn_server, build_parser

    def config(*flags: str):
        return _make_uvicorn_server(None, build_parser().parse_args(["serve", *flags]), lambda: None).config

    default = config()
    assert default.http.head_timeout_s == 20.0 and default.limit_concurrency == 2048 + 1
    set_ = config("--header-timeout", "7.5", "--max-connections", "100")
    assert set_.http.head_timeout_s == 7.5 and set_.limit_concurrency == 101
    for bad in (["--header-timeout", "0"], ["--header-timeout", "x"], ["--max-connections", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


def test_stalled_heads_are_closed_and_connections_capped(tiny_llama_dir: Path) -> None:
    args = ("--model", str(tiny_llama_dir), "--kv-cache-memory", "16MiB", "--no-access-log",
            "--header-timeout", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS))  # fmt: skip
    with ServeProcess(*args) as srv:
        stalled = [_stalled(srv.port) for _ in range(MAX_CONNECTIONS - 1)]
        opened = time.monotonic()
        try:
            assert _health(srv.url) == 200  # the last connection under the cap is served
            stalled.append(_stalled(srv.port))
            # One beyond it is refused, not queued behind the stalled ones; the probes are still answered.
            assert httpx.get(f"{srv.url}/version", timeout=10).status_code == 503
            assert _health(srv.url) == 200
            assert all(_is_open(s) for s in stalled)
            assert time.monotonic() - opened < HEADER_TIMEOUT_S  # (so that "open" meant "before the timeout")
            for s in stalled:
                assert _closed_by_server(s, HEADER_TIMEOUT_S + 5)
            assert time.monotonic() - opened >= HEADER_TIMEOUT_S - 0.1
        finally:
            for s in stalled:
                s.close()
        assert _health(srv.url) == 200  # recovered once they are gone

        # A keep-alive connection gets the same bound for its next head, however slowly it drips.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = b""
            while b'{"status":"ok"}' not in got:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200")
            start = time.monotonic()
            closed = False
            for byte in HALF_HEAD:
                try:
                    s.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                if not _is_open(s):
                    closed = _closed_by_server(s, 1)
                    break
                assert time.monotonic() - start < HEADER_TIMEOUT_S + 3, "still open"
                time.sleep(0.1)
            assert closed, "the server kept a connection whose head never completed"
            assert HEADER_TIMEOUT_S - 0.1 <= time.monotonic() - start <= HEADER_TIMEOUT_S + 3
