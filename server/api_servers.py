"""``--api-server-count N``: N API processes in front of one engine core, for the CPU that HTTP, JSON and
tokenizing cost at high concurrency (vLLM's ``--api-server-count``).

The first API process (the one ``servelm serve`` started) spawns the engine core, then the N-1 others
once the core is ready, handing each the engine's facts and its own socket to the core. Each binds
the same port with SO_REUSEPORT, so the kernel spreads new connections across them; each loads its
own tokenizer and serves every route (``/metrics`` asks the core, so any of them answers the same).

The first process watches the others: one that dies is logged and the core aborts its requests; the
others go on. A signal to the first drains it and is passed on to the others, and the core is stopped
only once they have all exited. The others see the core exit through a pidfd (it is not their child),
and stop with exit status 1 as the first does.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from servelm.server.async_engine import AsyncEngine
from servelm.server.cli_serve import run_api_process, serve_api
from servelm.server.data_parallel import CoresAddress, DataParallelEngines
from servelm.server.engine_info import EngineInfo
from servelm.server.engine_process import CoreAddress, EngineProcess

log = logging.getLogger(__name__)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other API processes may bind too (SO_REUSEPORT)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    return sock


class APIProcesses:
    """The API processes after the first: started, watched, stopped."""

    def __init__(
        self,
        target: Callable[..., None],
        args: argparse.Namespace,
        core: EngineProcess | DataParallelEngines,
        info: EngineInfo,
    ):
        self.target, self.args, self.core, self.info = target, args, core, info
        self.processes: list[Any] = []
        self.stopping = False

    def start(self, port: int) -> None:
        spawn = multiprocessing.get_context("spawn")
        args = argparse.Namespace(**{**vars(self.args), "port": port, "func": None})
        for i in range(1, self.args.api_server_count):
            proc = spawn.Process(
                target=_api_process_main,
                args=(self.target, args, self.core.address_of(i), self.info),
                name=f"servelm-api-{i}",
            )
            proc.start()
            self.processes.append(proc)
        threading.Thread(target=self._watch, name="servelm-api-watch", daemon=True).start()

    def _watch(self) -> None:
        alive = {p.sentinel: (i + 1, p) for i, p in enumerate(self.processes)}
        while alive:
            for sentinel in wait(list(alive)):
                client, proc = alive.pop(sentinel)
                proc.join()
                if not self.stopping:
                    log.error("API process %d exited with status %s; the others go on", client, proc.exitcode)
                    self.core.client_gone(client)

    def terminate(self) -> None:
        """Pass a drain on (SIGTERM)."""
        self.stopping = True
        for proc in self.processes:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    def join(self, timeout_s: float) -> None:
        self.terminate()
        for proc in self.processes:
            proc.join(timeout_s)
            if proc.is_alive():
                log.warning("API process %s did not stop in %.0f s: killing it", proc.name, timeout_s)
                proc.kill()
                proc.join(5.0)


def serve_behind_api_processes(
    args: argparse.Namespace, async_engine: AsyncEngine, chat_template: str | None, make_server: Callable[..., Any]
) -> int:
    """The first API process: start the others, then serve as one of them."""
    core = async_engine.bridge
    assert isinstance(core, (EngineProcess, DataParallelEngines))
    sock = reuse_port_socket(args.host, args.port)
    others = APIProcesses(run_api_process, args, core, async_engine.info)
    others.start(sock.getsockname()[1])
    core.before_stop.append(lambda: others.join(max(0.0, args.drain_timeout) + 15.0))
    return serve_api(args, async_engine, chat_template, None, make_server, sock, others.terminate)


def _api_process_main(
    target: Callable[..., None], args: argparse.Namespace, address: CoreAddress | CoresAddress, info: EngineInfo
) -> None:
    # Its own process group: a terminal's Ctrl-C reaches the first API process, which passes the drain
    # on; a second signal here would cut the drain short (uvicorn's force exit).
    os.setpgrp()
    target(args, address, info, reuse_port_socket(args.host, args.port))
