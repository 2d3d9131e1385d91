"""The API process's side of an engine-core process (``server.engine_core``): a bridge with the same
surface as ``server.engine_thread.EngineThread``, so ``AsyncEngine`` serves either.

Requests go out as they are submitted (from the event loop's thread); a receiver thread reads what
the core sends, routes each step's outputs to their ``RequestGroup``s and resolves the futures of
adds and calls, then hands them to the event loop in one callback per message. A watcher thread
waits on the core's exit: if it was not asked to stop, every request fails with ``EngineDeadError``
at once, ``/health`` answers 503, and this process is asked to stop (SIGTERM) and exits 1.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from typing import Any

import zmq

from servelm.scheduler.config import EngineConfig
from servelm.server import core_protocol as p
from servelm.server.async_engine import AsyncEngine
from servelm.server.engine_info import EngineInfo, load_api_tokenizer
from servelm.server.engine_thread import (
    Add,
    Call,
    EngineDeadError,
    EngineSnapshot,
    EngineStoppedError,
    deliver,
    fail_all,
    resolve_futures,
)
from servelm.server.request_group import RequestGroup

log = logging.getLogger(__name__)

RECV_POLL_MS = 200  # the receiver looks for its own stop this often


class EngineStartError(RuntimeError):
    """The engine core could not start (its reason, as the core reported it)."""


def start_engine_core(config: EngineConfig, log_level: str = "info") -> AsyncEngine:
    """An ``AsyncEngine`` over an engine built in an engine-core process, with this process's own copy
    of its tokenizer; returns once the engine is ready. Raises ``EngineStartError``."""
    core = EngineProcess(config, log_level)
    info = core.launch()
    try:
        tokenizer = load_api_tokenizer(info)
    except Exception as e:
        core.stop()
        core.join(10.0)
        raise EngineStartError(f"the API process cannot load the tokenizer from {info.tokenizer_path}: {e}") from e
    return AsyncEngine(bridge=core, info=info, tokenizer=tokenizer)


class EngineProcess:
    """An engine core in a child process, and this process's end of its sockets."""

    def __init__(self, config: EngineConfig, log_level: str = "info") -> None:
        self._dir = tempfile.mkdtemp(prefix="servelm-core-")  # 0700: only this user reaches the sockets
        self._zmq = zmq.Context()
        self._push = self._zmq.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy core
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(f"ipc://{self._dir}/in")
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(f"ipc://{self._dir}/out")
        spawn = multiprocessing.get_context("spawn")  # never fork a process that has loaded torch
        from servelm.server.engine_core import run_engine_core

        # Not a daemon: a tensor-parallel core starts worker processes of its own.
        self.process = spawn.Process(
            target=run_engine_core,
            args=(config, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", log_level),
            name="servelm-engine-core",
        )
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe; abort may come from any thread
        self._lock = threading.Lock()  # routes, futures, pending adds, dead
        self._routes: dict[str, tuple[RequestGroup, list[int]]] = {}
        self._futures: dict[int, tuple[asyncio.Future[Any], list[str], int]] = {}  # seq -> (future, ids, sequences)
        self._seq = itertools.count()
        self._pending_adds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.dead: BaseException | None = None
        self.snapshot = EngineSnapshot()

    # ------------------------------------------------------------------------------- life cycle

    def launch(self) -> EngineInfo:
        """Start the core and wait until its engine is built; its facts. Raises ``EngineStartError``."""
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
                    info: EngineInfo = p.loads(payload)
                    return info
                if tag == p.DIED:
                    self._reap()
                    raise EngineStartError(str(p.received_error(p.loads(payload))))
            elif not self.process.is_alive():
                self._reap()
                raise EngineStartError(f"the engine core exited with status {self.process.exitcode} while starting")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for target, name in ((self._receive, "servelm-core-recv"), (self._watch, "servelm-core-watch")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def running(self) -> bool:
        return bool(self._threads) and self.process.is_alive() and self.dead is None

    @property
    def dead_reason(self) -> str | None:
        return None if self.dead is None else f"{type(self.dead).__name__}: {self.dead}"

    def stop(self) -> None:
        """Ask the core to exit; what still runs there fails (``EngineStoppedError``)."""
        with self._lock:
            self._stopping = True
        self._send(p.STOP, b"")
        self._fail_everything(EngineStoppedError("the server shut down before this request finished"))

    def close(self) -> None:
        """Stop the core if it still runs (idempotent; at exit, after a server that never started...)."""
        if self.process.is_alive() and not self._stopping:
            self.stop()
        if self._zmq.closed:
            return
        self.join(10.0)

    def join(self, timeout_s: float) -> None:
        """Wait for the core to exit; end it if it does not, then close the sockets."""
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

    def notify(self, path: str, *args: Any) -> None:
        """A call nobody waits for (a metrics count)."""
        if self.dead is None:
            self._send(p.CALL, p.dumps((-1, p.dumps((path, args)))))

    def wake(self) -> None:
        """(Sending is the wake-up.)"""

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            if self.dead is not None:
                return
            for rid in request_ids:
                self._routes.pop(rid, None)
        self._send(p.ABORT, p.encode_ids(request_ids))

    def _send(self, tag: bytes, payload: bytes) -> None:
        with self._send_lock:
            try:
                # Never blocks with the core connected (no high-water mark); without it (dead, or not yet
                # there) a PUSH socket would block for ever: the request fails through the death path.
                self._push.send_multipart([tag, payload], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # (zmq.Again included) no core, or closed at shutdown
                log.debug("send to the engine core failed: %s", e)

    # ------------------------------------------------------------------------ the receiver thread

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        try:
            while not self._stopping:
                if not dict(poller.poll(RECV_POLL_MS)):
                    continue
                while True:
                    try:
                        tag, payload = self._pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(tag, payload)
        except zmq.ZMQError:  # closed at shutdown
            pass
        except Exception:
            log.exception("the engine core's receiver failed")
            self._die(EngineDeadError("the API process lost its engine core's messages"))

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
                self._call_soon(deliver, deliveries)
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
                self._call_soon(resolve_futures, [(fut, result, error)])
        elif tag == p.DIED:
            reason = p.received_error(p.loads(payload))
            with self._lock:
                if self.dead is None:
                    self.dead = EngineDeadError(f"the engine core failed: {reason}")

    # -------------------------------------------------------------------------- the watcher thread

    def _watch(self) -> None:
        self.process.join()
        if self._stopping:
            return
        code = self.process.exitcode
        self._die(EngineDeadError(f"the engine core exited with status {code}"))
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
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass
