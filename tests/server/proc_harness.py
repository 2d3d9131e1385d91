"""A real ``servelm serve`` process for tests that need what only a process has: signals, exit status,
uvicorn's own connection handling."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _port() -> str:
    """0 (the kernel picks a free port), or on a machine whose ports are shared out, the first free one of
    ``$SERVELM_TEST_PORTS`` ("LOW-HIGH")."""
    given = os.environ.get("SERVELM_TEST_PORTS")
    if not given:
        return "0"
    low, high = (int(p) for p in given.split("-"))
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(port)
    raise RuntimeError(f"no free port in SERVELM_TEST_PORTS={given}")


class ServeProcess:
    """``servelm serve --port 0 ARGS`` with its log collected; ``start()`` returns once it listens.

    Leaving the ``with`` block kills a process the test did not stop itself.
    """

    def __init__(self, *args: str) -> None:
        # A PYTHONPATH already set comes first: a worktree's shim package then serves its own code.
        path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(REPO)) if p)
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        env.pop("SERVELM_API_KEY", None)
        self.argv = [sys.executable, "-m", "servelm.server.cli", "serve", "--port", _port(), *args]
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.port = 0
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 300.0) -> ServeProcess:
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        assert self._ready.wait(timeout) and self.port, self.log
        return self

    def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self._ready.set()
        self._ready.set()  # it died before listening

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not: it has exited, unreaped)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def all_exit(pids: list[int], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for every process in ``pids`` to exit; whether they all did."""
    import time

    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)
