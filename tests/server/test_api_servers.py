"""``--api-server-count 2``: two API processes in front of one engine core, a real server and the
default model. Both answer on the one port; killing the second leaves the first serving (the core
aborts what the dead one had running); SIGTERM stops them all with status 0."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from proc_harness import ServeProcess, alive, all_exit

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from /proc")


def _children(pid: int) -> list[int]:
    return [int(k) for task in Path(f"/proc/{pid}/task").iterdir() for k in (task / "children").read_text().split()]


def _spawned(pid: int) -> list[int]:
    # multiprocessing's spawned children: the engine core and the second API process (not the resource tracker)
    return [k for k in _children(pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers={"Connection": "close"})


def _api_process(pids: list[int]) -> int:
    """The second API process among the spawned children (it listens on a TCP socket; the core does not)."""
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        inodes = {os.readlink(fds / fd) for fd in os.listdir(fds) if os.readlink(fds / fd).startswith("socket:")}
        tcp = Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()
        listening = {line.split()[9] for line in tcp.splitlines()[1:] if line.split()[3] == "0A"}
        if any(i[len("socket:[") : -1] in listening for i in inodes):
            return pid
    raise AssertionError(f"no listening API process among {pids}")


def test_two_api_processes_share_the_port_and_survive_each_other() -> None:
    with ServeProcess("--api-server-count", "2") as server:
        assert server.proc is not None
        deadline = time.monotonic() + 120
        while server.log.count("servelm listening on") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # (the second logs its own line once it serves)
        spawned = _spawned(server.proc.pid)
        assert len(spawned) == 2, server.log
        second = _api_process(spawned)
        core = next(p for p in spawned if p != second)
        # Both listen: new connections are spread by the kernel; every one is answered the same.
        texts = {_complete(server.url, "The capital of France is").json()["choices"][0]["text"] for _ in range(12)}
        assert len(texts) == 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "servelm_num_requests_running" in metrics

        os.kill(second, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "API process 1 exited" not in server.log and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "API process 1 exited" in server.log, server.log
        for _ in range(8):
            assert _complete(server.url, "Hello").status_code == 200
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert alive(core)

        server.terminate()
        assert server.wait(60) == 0, server.log
        assert all_exit([core], 10)


def test_sigterm_stops_every_api_process_and_the_core() -> None:
    with ServeProcess("--api-server-count", "3") as server:
        assert server.proc is not None
        deadline = time.monotonic() + 120
        while server.log.count("servelm listening on") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        spawned = _spawned(server.proc.pid)
        assert len(spawned) == 3, server.log
        assert _complete(server.url, "Hi").status_code == 200
        server.terminate()
        assert server.wait(60) == 0, server.log
        assert all_exit(spawned, 10)
