"""The engine thread: the one thread that owns the synchronous ``Engine`` and steps it.

Handlers reach it through a thread-safe inbox (add / abort / call), applied before the next step, and
get outputs back through their ``RequestGroup``s, delivered on the event loop with
``loop.call_soon_threadsafe`` once per step (one wake-up of the event loop per step, not per token).
The thread steps while there is work and sleeps on an event when idle, so an idle server burns no
CPU. If it dies, every pending request gets ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.bridge import (
    Abort,
    Add,
    Call,
    EngineDeadError,
    EngineSnapshot,
    EngineStoppedError,
    StopChoices,
    call_soon,
    deliver,
    fail_all,
    resolve,
    resolve_futures,
)
from servelm.server.heap import HeapTrimmer
from servelm.server.request_group import RequestGroup

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_in_transient_thread(fn: Callable[[], T], name: str = "servelm-startup") -> T:
    """``fn()`` in a new thread that exits before this returns; its result, or its exception re-raised.

    For the start-up torch work of a server (weights, packing, warm-up, peak measurement) whose
    engine then steps in the engine thread. OpenMP (torch's CPU thread pool, libgomp) keeps a team
    of worker threads for every thread that ever ran a parallel region, for that thread's life. With
    the main thread's team alive beside the engine thread's, libgomp manages more threads than there
    are cores and throttles its barrier spinning to almost nothing: every one of a decode step's
    ~200 parallel regions then sleeps and wakes its worker through a futex: a decode step of the
    default model took ~1.3-1.5x as long with a second team alive (docs/benchmarks.md). A thread that
    exits takes its team with it.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)  # Ctrl-C during start-up ends the process
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


class UsedBlocks(Protocol):
    """The block manager's count the bridge publishes."""

    @property
    def num_used_blocks(self) -> int: ...


class EngineLike(Protocol):
    """The part of ``scheduler.engine.Engine`` the bridge uses (only ever from the engine thread)."""

    config: EngineConfig
    block_manager: UsedBlocks

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_adapter: Any | None = None,
        group: str | None = None,
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def stop_choice(self, request_id: str, index: int, stop: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...


class EngineThread:
    """The engine, its thread and its inbox; everything but ``submit``, ``abort``, ``stop`` and the
    read-only state runs in the engine thread."""

    def __init__(self, engine: EngineLike, heap: HeapTrimmer | None = None) -> None:
        self.engine = engine
        self.heap = heap or HeapTrimmer()
        self._lock = threading.Lock()  # guards the inbox, _pending_adds, _stop and dead
        self._inbox: list[Add | Abort | Call | StopChoices] = []
        self._pending_adds = 0  # requests in the inbox not yet handed to the engine
        self._wake = threading.Event()
        self.thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, RequestGroup] = {}  # engine thread only
        self._stop = False
        self.dead: BaseException | None = None
        self.snapshot = EngineSnapshot()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start stepping; outputs and results are delivered on ``loop``."""
        self._loop = loop
        runner = getattr(self.engine, "runner", None)
        watch = getattr(runner, "watch_workers", None)
        if watch is not None:  # tensor parallelism: a worker's death ends serving
            watch(self.fail)
        self.thread = threading.Thread(target=self._run, name="servelm-engine", daemon=True)
        self.thread.start()

    def fail(self, exc: BaseException) -> None:
        """From any thread: the engine cannot serve any more (a tensor-parallel worker died). Every
        request fails with ``exc``, ``/health`` and ``/live`` answer 503, and the process is asked to
        stop (SIGTERM: a drain with nothing left to drain) so that it exits non-zero and a supervisor
        (Kubernetes, systemd) restarts it."""
        log.error("serving stops: %s", exc)
        with self._lock:  # /health turns 503 now; the engine thread fails the requests it routes
            if self.dead is None:
                self.dead = exc
        self._wake.set()
        os.kill(os.getpid(), signal.SIGTERM)

    @property
    def dead_reason(self) -> str | None:
        return None if self.dead is None else f"{type(self.dead).__name__}: {self.dead}"

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.dead is None

    def join(self, timeout_s: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)

    def notify(self, path: str, *args: Any) -> None:
        """(In this process the caller's observer counts directly.)"""

    def submit(self, cmd: Add | Call, num_seqs: int = 0, limit: int | None = None) -> bool:
        """Put ``cmd`` in the inbox, unless it would make more than ``limit`` sequences wait (False).
        Raises ``EngineDeadError`` once the thread has died. The caller wakes the thread."""
        with self._lock:
            # Counted in sequences, like the engine's waiting queue (n choices are n sequences).
            if limit is not None and self.snapshot.num_waiting + self._pending_adds + num_seqs > limit:
                return False
            if self.dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
            self._inbox.append(cmd)
            self._pending_adds += num_seqs
        return True

    def wake(self) -> None:
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (thread-safe, non-blocking); applied before the engine's next step."""
        self._put(Abort(request_ids))

    def stop_choices(self, request_id: str, stopped: list[tuple[int, str]]) -> None:
        """Finish choices a stop string ended (``Engine.stop_choice``) before the engine's next step."""
        self._put(StopChoices(request_id, stopped))

    def _put(self, cmd: Abort | StopChoices) -> None:
        with self._lock:
            if self.dead is not None or self.thread is None:
                return
            self._inbox.append(cmd)
        self._wake.set()

    def stop(self) -> None:
        """Ask the thread to end once it has emptied its inbox; what still runs then fails."""
        with self._lock:
            self._stop = True
        self._wake.set()

    # ------------------------------------------------------------------------- in the engine thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wake.clear()
                stop = self._drain_inbox()
                if self.dead is not None:  # failed from outside (``fail``)
                    self._die(self.dead)
                    return
                if stop:
                    self._abort_all(EngineStoppedError("the server shut down before this request finished"))
                    return
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._dispatch(outputs)
                    self._publish()
                    self.heap.stepped()
                else:
                    self.heap.idle()
                    self._wake.wait()
        except BaseException as exc:  # any escape kills serving; report it everywhere
            if self.dead is None:
                log.exception("the engine thread died")
            else:
                log.error("the step failed after: %s (%s: %s)", self.dead, type(exc).__name__, exc)
            self._die(exc)
        finally:
            self._close_runner()

    def _close_runner(self) -> None:
        """Stop what the runner started beside this process (tensor-parallel workers), from the
        thread that drove its collectives."""
        close = getattr(getattr(self.engine, "runner", None), "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # stopping anyway
            log.exception("closing the runner failed")

    def _drain_inbox(self) -> bool:
        with self._lock:
            cmds, self._inbox = self._inbox, []
            stop = self._stop
        if not cmds:
            return stop
        engine = self.engine
        # (future, result, error) of each add and call, resolved on the event loop
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        for cmd in cmds:
            if isinstance(cmd, Abort):
                for rid in cmd.request_ids:
                    if self._routes.pop(rid, None) is not None:
                        engine.abort(rid)
                continue
            if isinstance(cmd, StopChoices):
                for index, string in cmd.stopped:
                    engine.stop_choice(cmd.request_id, index, string)
                continue
            if isinstance(cmd, Call):
                try:
                    results.append((cmd.future, resolve(engine, cmd.path)(*cmd.args), None))
                except Exception as exc:  # the call's own failure, reported to its caller
                    results.append((cmd.future, None, exc))
                continue
            added: list[str] = []
            error: BaseException | None = None
            for rid, ids, params in cmd.requests:
                try:
                    engine.add_request(rid, ids, params, arrival_time=cmd.arrival_time, **cmd.options)
                except Exception as exc:  # the request is bad, not the engine
                    error = exc
                    break
                added.append(rid)
                self._routes[rid] = cmd.group
            if error is not None:
                for rid in added:
                    self._routes.pop(rid, None)
                    engine.abort(rid)
            results.append((cmd.future, None, error))
        # The engine's new waiting count and the inbox's smaller one change together, so the queue
        # bound in ``submit`` never sees a request in neither or in both.
        snap = self._snapshot_now()
        with self._lock:
            self._pending_adds -= sum(p.n for c in cmds if isinstance(c, Add) for _, _, p in c.requests)
            self.snapshot = snap
        if results:
            self._call_soon(resolve_futures, results)
        return stop

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        deliveries: list[tuple[RequestGroup, RequestOutput]] = []
        for out in outputs:
            group = self._routes.get(out.request_id)
            if group is None:  # aborted meanwhile: nobody listens
                continue
            if out.finished:
                del self._routes[out.request_id]
            deliveries.append((group, out))
        if deliveries:
            self._call_soon(deliver, deliveries)

    def _snapshot_now(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=e.num_running, num_waiting=e.num_waiting, num_used_blocks=e.block_manager.num_used_blocks
        )

    def _publish(self) -> None:
        self.snapshot = self._snapshot_now()

    def _abort_all(self, exc: BaseException) -> None:
        for rid in list(self._routes):
            try:
                self.engine.abort(rid)
            except Exception:  # shutting down anyway
                log.exception("abort of %s failed during shutdown", rid)
        self._fail_everything(exc)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            if self.dead is None:  # else the first cause is the one reported (a failed step follows a dead worker)
                self.dead = exc
            cause = self.dead
        self._fail_everything(EngineDeadError(f"the engine has stopped: {type(cause).__name__}: {cause}"))

    def _fail_everything(self, exc: BaseException) -> None:
        with self._lock:
            cmds, self._inbox = self._inbox, []
            self._pending_adds = 0
        groups = {id(g): g for g in self._routes.values()}
        self._routes.clear()
        futures = [(c.future, exc) for c in cmds if isinstance(c, (Add, Call))]
        for c in cmds:
            if isinstance(c, Add):
                groups.pop(id(c.group), None)  # its add fails instead
        self._call_soon(fail_all, list(groups.values()), futures, exc)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        call_soon(self._loop, fn, *args)
