"""The API process's side of an engine-core process (``server.engine_core``): a bridge with the same
surface as ``server.engine_thread.EngineThread``, so ``AsyncEngine`` serves either.

Requests go out as they are submitted (from the event loop's thread); the event loop reads what the
core sends (its socket's descriptor is one of the loop's readers), routes each step's outputs to their
``RequestGroup``s and resolves the futures of adds and calls. A watcher thread waits on the core's
exit (as its parent, or through a pidfd in an API process after the first): if it was not asked to
stop, every request fails with ``EngineDeadError`` at once, ``/health`` answers 503, and this process
is asked to stop (SIGTERM) and exits 1.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import select
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from servelm.scheduler.config import EngineConfig
from servelm.server import core_protocol as p
from servelm.server.async_engine import AsyncEngine
from servelm.server.bridge import (
    Add,
    Call,
    EngineDeadError,
    EngineSnapshot,
    EngineStoppedError,
    call_soon,
    deliver,
    fail_all,
    resolve_futures,
)
from servelm.server.engine_info import EngineInfo, load_api_tokenizer
from servelm.server.request_group import RequestGroup

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine core could not start (its reason, as the core reported it)."""


def start_engine_core(config: EngineConfig, log_level: str = "info", api_servers: int = 1) -> AsyncEngine:
    """An ``AsyncEngine`` over an engine built in an engine-core process, with this process's own copy
    of its tokenizer; returns once the engine is ready. ``api_servers``: API processes the core will
    answer (this one is the first). Raises ``EngineStartError``."""
    core = EngineProcess(config=config, log_level=log_level, api_servers=api_servers)
    info = core.launch()
    return _over(core, info)


def join_engine_core(address: CoreAddress, info: EngineInfo) -> AsyncEngine:
    """An ``AsyncEngine`` over the running engine core at ``address`` (an API process after the first)."""
    return _over(EngineProcess(address), info)


def _over(core: EngineProcess, info: EngineInfo) -> AsyncEngine:
    try:
        tokenizer = load_api_tokenizer(info)
    except Exception as e:
        core.stop()
        core.join(10.0)
        raise EngineStartError(f"the API process cannot load the tokenizer from {info.tokenizer_path}: {e}") from e
    return AsyncEngine(bridge=core, info=info, tokenizer=tokenizer)


@dataclass(frozen=True)
class CoreAddress:
    """How an API process reaches the engine core: the core's input socket, the API process's own output
    socket, its index among the API processes, and the core's pid (to see it exit)."""

    inbox: str
    outbox: str
    client: int
    pid: int


class EngineProcess:
    """This API process's end of an engine core's sockets; the first API process also owns the core process.

    ``EngineProcess(config=...)`` (the first API process) spawns the core with ``launch``;
    ``EngineProcess(address)`` (an API process after the first) talks to a core already running.
    """

    def __init__(
        self,
        address: CoreAddress | None = None,
        *,
        config: EngineConfig | None = None,
        log_level: str = "info",
        api_servers: int = 1,
    ) -> None:
        self.process: Any = None  # the core, when this process owns it
        self._dir: str | None = None
        if address is None:
            assert config is not None, "EngineProcess needs a config (to start a core) or a core's address"
            self._dir = tempfile.mkdtemp(prefix="servelm-core-")  # 0700: only this user reaches the sockets
            outboxes = [f"ipc://{self._dir}/out{i}" for i in range(api_servers)]
            address = CoreAddress(f"ipc://{self._dir}/in", outboxes[0], 0, 0)
            spawn = multiprocessing.get_context("spawn")  # never fork a process that has loaded torch
            from servelm.server.engine_core import run_engine_core

            # Not a daemon: a tensor-parallel core starts worker processes of its own.
            self.process = spawn.Process(
                target=run_engine_core, args=(config, address.inbox, outboxes, log_level), name="servelm-engine-core"
            )
            self.outboxes = outboxes
        self.address = address
        self._client_frame = str(address.client).encode()
        self._zmq = zmq.Context()
        self._push = self._zmq.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy core
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address.inbox)  # (queued until the core binds it)
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(address.outbox)
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe; abort may come from any thread
        self._lock = threading.Lock()  # routes, futures, pending adds, dead
        self._routes: dict[str, tuple[RequestGroup, list[int]]] = {}
        self._futures: dict[int, tuple[asyncio.Future[Any], list[str], int]] = {}  # seq -> (future, ids, sequences)
        self._seq = itertools.count()
        self._pending_adds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_fd: int | None = None
        self._stopping = False
        self._core_exited = False
        self._threads: list[threading.Thread] = []
        self.before_stop: list[Callable[[], None]] = []  # the first API process: wait for the others
        self.dead: BaseException | None = None
        self.snapshot = EngineSnapshot()

    def address_of(self, client: int) -> CoreAddress:
        """The address an API process after the first is given (only the owner knows them)."""
        return CoreAddress(self.address.inbox, self.outboxes[client], client, self.process.pid)

    # ------------------------------------------------------------------------------- life cycle

    def launch(self) -> EngineInfo:
        """Start the core and wait until its engine is built; its facts. Raises ``EngineStartError``."""
        assert self.process is not None
        self.process.start()
        # Before multiprocessing's own exit hook, which would wait for ever for a core nobody stopped
        # (the core waits for this process to exit).
        atexit.register(self.close)
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while True:
            if dict(poller.poll(500)):
                tag, payload = self._pull.recv_multipart()
                if tag == p.READY:
                    return p.loads(payload)  # type: ignore[no-any-return]
                if tag == p.DIED:
                    self._reap()
                    raise EngineStartError(str(p.received_error(p.loads(payload))))
            elif not self.process.is_alive():
                self._reap()
                raise EngineStartError(f"the engine core exited with status {self.process.exitcode} while starting")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """(On ``loop``'s thread.) The core's messages are read on the event loop itself: one wake-up per
        step and no hop between threads (a receiver thread's hop showed in the one-stream ITL)."""
        self._loop = loop
        fd = int(self._pull.getsockopt(zmq.FD))
        self._reader_fd = fd
        loop.add_reader(fd, self._readable)
        loop.call_soon(self._readable)  # (what came before: ZMQ's descriptor signals changes, not messages)
        t = threading.Thread(target=self._watch, name="servelm-core-watch", daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def running(self) -> bool:
        core_alive = self.process.is_alive() if self.process is not None else not self._core_exited
        return bool(self._threads) and core_alive and self.dead is None

    @property
    def dead_reason(self) -> str | None:
        return None if self.dead is None else f"{type(self.dead).__name__}: {self.dead}"

    def stop(self) -> None:
        """The owner: wait for the other API processes, then ask the core to exit; the others: abort what
        they still run there. What still runs fails (``EngineStoppedError``)."""
        if self.process is not None:
            for wait in self.before_stop:
                wait()
        with self._lock:
            self._stopping = True
            mine = list(self._routes)
        try:
            if asyncio.get_running_loop() is self._loop:
                self._stop_reading()
        except RuntimeError:  # no loop runs in this thread (a close after it ended)
            pass
        if self.process is not None:
            self._send(p.STOP, b"")
        elif mine:
            self._send(p.ABORT, p.encode_ids(mine))
        self._fail_everything(EngineStoppedError("the server shut down before this request finished"))

    def close(self) -> None:
        """Stop the core if it still runs (idempotent; at exit, after a server that never started...)."""
        if self.process is not None and self.process.is_alive() and not self._stopping:
            self.stop()
        if self._zmq.closed:
            return
        self.join(10.0)

    def join(self, timeout_s: float) -> None:
        """The owner: wait for the core to exit, and end it if it does not; then close the sockets."""
        if self.process is None:
            self._reap()
            return
        self.process.join(timeout_s)
        if self.process.is_alive():
            log.warning("the engine core did not stop in %.0f s: terminating it", timeout_s)
            self.process.kill()
            self.process.join(5.0)
        self._reap()

    def _reap(self) -> None:
        with self._lock:
            self._stopping = True
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2.0)
        if self._zmq.closed:
            return
        self._push.close(0)
        self._pull.close(0)
        self._zmq.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------------- the bridge's calls

    def submit(self, cmd: Add | Call, num_seqs: int = 0, limit: int | None = None) -> bool:
        """Send ``cmd``, unless it would make more than ``limit`` sequences wait (False)."""
        if isinstance(cmd, Add):  # (before anything is registered: a request that cannot be sent leaves nothing)
            requests = [(rid, prompt, p.sendable_params(params)) for rid, prompt, params in cmd.requests]
            payload = p.dumps((cmd.arrival_time, cmd.options, requests))
        else:
            payload = p.dumps((cmd.path, cmd.args))
        with self._lock:
            if limit is not None and self.snapshot.num_waiting + self._pending_adds + num_seqs > limit:
                return False
            if self.dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
            seq = next(self._seq)
            if isinstance(cmd, Add):
                ids = [r[0] for r in cmd.requests]
                for rid, prompt, _ in cmd.requests:
                    self._routes[rid] = (cmd.group, prompt)
                self._pending_adds += num_seqs
                self._futures[seq] = (cmd.future, ids, num_seqs)
            else:
                self._futures[seq] = (cmd.future, [], 0)
        self._send(p.ADD if isinstance(cmd, Add) else p.CALL, p.dumps((seq, payload)))
        return True

    def client_gone(self, client: int) -> None:
        """The owner: API process ``client`` died; the core aborts its requests."""
        self._send(p.CLIENT_GONE, str(client).encode())

    def notify(self, path: str, *args: Any) -> None:
        """A call nobody waits for (a metrics count)."""
        if self.dead is None:
            self._send(p.CALL, p.dumps((-1, p.dumps((path, args)))))

    def wake(self) -> None:  # (sending is the wake-up)
        pass

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            if self.dead is not None:
                return
            for rid in request_ids:
                self._routes.pop(rid, None)
        self._send(p.ABORT, p.encode_ids(request_ids))

    def stop_choices(self, request_id: str, stopped: list[tuple[int, str]]) -> None:
        """Finish choices a stop string ended here (``Engine.stop_choice`` in the core)."""
        if self.dead is None:
            self._send(p.STOP_CHOICES, p.encode_stopped(request_id, stopped))

    def _send(self, tag: bytes, payload: bytes) -> None:
        with self._send_lock:
            try:
                # Never blocks with the core connected (no high-water mark); without it (dead, or not yet
                # there) a PUSH socket would block for ever: the request fails through the death path.
                self._push.send_multipart([tag, self._client_frame, payload], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # (zmq.Again included) no core, or closed at shutdown
                log.debug("send to the engine core failed: %s", e)

    # ---------------------------------------------------------------------- on the event loop's thread

    def _readable(self) -> None:
        try:
            while not self._pull.closed and int(self._pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                tag, payload = self._pull.recv_multipart(zmq.NOBLOCK)
                self._on_message(tag, payload)
        except zmq.ZMQError:  # closed at shutdown
            pass
        except Exception:
            log.exception("reading the engine core's messages failed")
            self._die(EngineDeadError("the API process lost its engine core's messages"))

    def _stop_reading(self) -> None:
        loop, fd = self._loop, self._reader_fd
        if loop is not None and fd is not None and not loop.is_closed():
            self._reader_fd = None
            loop.remove_reader(fd)

    def _on_message(self, tag: bytes, payload: bytes) -> None:
        if tag == p.OUTPUTS:
            deliveries = []
            with self._lock:
                routes = self._routes
                snapshot, outputs = p.decode_outputs(payload, lambda rid: r[1] if (r := routes.get(rid)) else [])
                for out in outputs:
                    route = routes.get(out.request_id)
                    if route is None:  # aborted meanwhile: nobody listens
                        continue
                    if out.finished:
                        del routes[out.request_id]
                    deliveries.append((route[0], out))
                self.snapshot = EngineSnapshot(*snapshot)
            if deliveries:
                deliver(deliveries)
        elif tag == p.REPLY:
            seq, result, error, snapshot = p.loads(payload)
            error = p.received_error(error)
            with self._lock:
                fut, ids, num_seqs = self._futures.pop(seq, (None, [], 0))
                self._pending_adds -= num_seqs
                if error is not None:
                    for rid in ids:
                        self._routes.pop(rid, None)
                self.snapshot = EngineSnapshot(*snapshot)
            if fut is not None:
                resolve_futures([(fut, result, error)])
        elif tag == p.DIED:
            reason = p.received_error(p.loads(payload))
            with self._lock:
                if self.dead is None:
                    self.dead = EngineDeadError(f"the engine core failed: {reason}")

    # -------------------------------------------------------------------------- the watcher thread

    def _watch(self) -> None:
        if self.process is not None:
            self.process.join()
            code = self.process.exitcode
        else:  # not this process's child: a pidfd turns readable when it exits
            code = None
            try:
                fd = os.pidfd_open(self.address.pid)
            except ProcessLookupError:
                fd = -1
            if fd >= 0:
                select.select([fd], [], [])
                os.close(fd)
            self._core_exited = True
        if self._stopping:
            return
        said = f"status {code}" if code is not None else "an unknown status"
        self._die(EngineDeadError(f"the engine core exited with {said}"))
        log.error("serving stops: %s", self.dead_reason)
        os.kill(os.getpid(), signal.SIGTERM)  # a drain with nothing to drain; the exit status says it died

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = exc
            cause = self.dead
        self._fail_everything(EngineDeadError(f"the engine has stopped: {cause}"))

    def _fail_everything(self, exc: BaseException) -> None:
        with self._lock:
            groups = {id(g): g for g, _ in self._routes.values()}
            self._routes.clear()
            futures = [(fut, exc) for fut, _, _ in self._futures.values()]
            self._futures.clear()
            self._pending_adds = 0
        self._call_soon(fail_all, list(groups.values()), futures, exc)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        call_soon(self._loop, fn, *args)
