"""The bridge between asyncio (HTTP handlers) and the synchronous, single-threaded ``Engine``.

One engine thread owns the engine. Handlers talk to it through a thread-safe inbox (add / abort) and
get outputs back on per-request asyncio queues, delivered with ``loop.call_soon_threadsafe`` once
per engine step (one wake-up of the event loop per step, not per token). The thread steps while
there is work and sleeps on an event when idle, so an idle server burns no CPU.

Failure handling is the point of this module:
- a consumer that goes away (client disconnect, cancellation) aborts its requests; the abort is
  applied before the next engine step, so their KV blocks are freed within one step;
- if the engine thread dies, every pending request gets ``EngineDeadError`` and new ones are
  refused at once (``/health`` turns 503) instead of hanging;
- more than ``max_waiting_requests`` waiting -> ``QueueFullError`` (503 + Retry-After upstream);
- ``begin_drain`` (on the signal) stops accepting and gives running requests until a deadline; the
  ones still running then end with ``EngineStoppedError`` through their own output queues, so each
  handler answers as a failed request of its API does; ``shutdown`` then stops the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol, Sequence, TypeVar

from servelm.metrics.observer import NullObserver, Observer
from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_in_transient_thread(fn: Callable[[], T], name: str = "servelm-startup") -> T:
    """``fn()`` in a new thread that exits before this returns; its result, or its exception re-raised.

    For the start-up torch work of a server (weights, packing, warm-up, peak measurement) whose
    engine then steps in the engine thread. OpenMP (torch's CPU thread pool, libgomp) keeps a team
    of worker threads for every thread that ever ran a parallel region, for that thread's life. With
    the main thread's team alive beside the engine thread's, libgomp manages more threads than there
    are cores and throttles its barrier spinning to almost nothing: every one of a decode step's
    ~200 parallel regions then sleeps and wakes its worker through a futex. Measured on 2 cores with
    the default model at batch 1: 24.5 ms per step with the engine thread's team alone, 31-36 ms with
    a second team alive. A thread that exits takes its team with it.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)  # Ctrl-C during start-up ends the process
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


class EngineLike(Protocol):
    """The part of ``scheduler.engine.Engine`` the bridge uses (only ever from the engine thread)."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...


class EngineDeadError(RuntimeError):
    """The engine thread has stopped after an unexpected error; nothing can be served."""


class EngineStoppedError(RuntimeError):
    """The server is shutting down and accepts no new requests (or the drain deadline passed)."""


class QueueFullError(RuntimeError):
    """Too many requests are already waiting."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} requests are waiting")
        self.limit = limit


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters as of the last step, published by the engine thread for other threads to read."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0


@dataclass
class _Add:
    group: "RequestGroup"
    requests: list[tuple[str, list[int], SamplingParams]]
    arrival_time: float
    future: asyncio.Future[None]
    options: dict[str, Any]  # Engine.add_request's keywords (lora_name, cache_salt, priority) given for the group


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Run ``fn(engine)`` in the engine thread between steps (adapter loading...)."""

    fn: Callable[[Any], Any]
    future: asyncio.Future[Any]


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), read as one stream of outputs.

    Iterate it to get ``RequestOutput``s in engine order until every request has finished; an error
    delivered by the engine thread is raised from the iteration. ``close()`` (sync, safe in
    ``finally`` blocks during cancellation) aborts whatever has not finished.
    """

    def __init__(self, owner: "AsyncEngine") -> None:
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.request_ids: list[str] = []
        self._unfinished: set[str] = set()
        self._closed = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            self.close()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
            if not self._unfinished:
                self.close()
        return item

    def fail(self, exc: BaseException) -> None:
        """End the group with ``exc`` after what was already delivered, aborting its unfinished requests."""
        if self._closed or not self._unfinished:
            return
        self._owner.abort(sorted(self._unfinished))  # (the reader clears _unfinished when it meets exc)
        self._put(exc)

    def close(self) -> None:
        """Abort the unfinished requests (if any) and release the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._owner.abort(sorted(self._unfinished))
            self._unfinished.clear()
        self._owner._groups.discard(self)
        if not self._owner._groups:
            self._owner._idle.set()


class AsyncEngine:
    """Runs an engine in its own thread and exposes it to asyncio code.

    ``start()`` must be called from the event loop that will consume outputs (the app's lifespan does).
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        max_waiting_requests: int | None = None,
        observer: Observer | None = None,
        tokenizer_threads: int = 1,
    ) -> None:
        self.engine = engine
        cfg = getattr(engine, "config", None)
        self.max_waiting_requests = (
            max_waiting_requests if max_waiting_requests is not None else getattr(cfg, "max_waiting_requests", 1024)
        )
        self.observer: Observer = observer or NullObserver()
        self._lock = threading.Lock()  # guards the inbox, _pending_adds and _dead
        self._inbox: list[_Add | _Abort | _Call] = []
        self._pending_adds = 0  # requests in the inbox not yet handed to the engine
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, RequestGroup] = {}  # engine thread only
        self._groups: set[RequestGroup] = set()  # event-loop thread only
        self._idle = asyncio.Event()
        self._accepting = True
        self._drain_task: asyncio.Task[None] | None = None
        self._stop = False
        self._dead: BaseException | None = None
        self.snapshot = EngineSnapshot()
        # Tokenization and chat templating run here, never on the event loop. One thread: the
        # tokenizer's Rust object must not be mutated from two threads at once.
        self._executor = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="servelm-tok")

    # ------------------------------------------------------------------------------- life cycle

    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="servelm-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs (``/health``)."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def dead_reason(self) -> str | None:
        return None if self._dead is None else f"{type(self._dead).__name__}: {self._dead}"

    def stop_accepting(self) -> None:
        """New requests get ``EngineStoppedError`` from now on (first step of a graceful shutdown)."""
        self._accepting = False

    def begin_drain(self, timeout_s: float) -> None:
        """Stop accepting and start the drain clock now; safe in a signal handler (schedules, never awaits).

        The drain must start on the signal: uvicorn waits for its request tasks (and then cancels them,
        mid-body) before it runs the lifespan shutdown that calls ``shutdown``.
        """
        self.stop_accepting()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._start_drain, timeout_s)

    def _start_drain(self, timeout_s: float) -> asyncio.Task[None]:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(timeout_s))
        return self._drain_task

    async def _drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for in-flight requests; end the rest with "the server is shutting down"."""
        self.stop_accepting()
        if not self._groups:
            return
        log.info("draining %d in-flight request(s) (up to %.1f s)", len(self._groups), timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return
        except asyncio.TimeoutError:
            pass
        log.warning("drain deadline passed; ending %d request(s) with a 'server shutting down' error", len(self._groups))
        exc = EngineStoppedError("the server is shutting down: the drain deadline passed")
        for group in list(self._groups):
            group.fail(exc)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain (or finish the drain ``begin_drain`` started) within ``timeout_s``, then stop the engine thread."""
        await self._start_drain(timeout_s)
        with self._lock:
            self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------------------------- request API

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (tokenization, templating) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")

    async def add(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        arrival_time: float | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
    ) -> RequestGroup:
        """Hand requests to the engine as one group (computed with the LoRA adapter ``lora_name``, their
        prefix-cache blocks salted with ``cache_salt``, at ``priority``, when given); returns once the
        engine accepted them all.

        Raises what ``Engine.add_request`` raises (``InvalidParameterError`` for a bad request; the
        earlier requests of the group are then aborted), ``QueueFullError``, ``EngineStoppedError``
        or ``EngineDeadError``.
        """
        self._check_accepting()
        assert self._loop is not None
        group = RequestGroup(self)
        fut: asyncio.Future[None] = self._loop.create_future()
        given = (("lora_name", lora_name), ("cache_salt", cache_salt), ("priority", priority))
        options = {k: v for k, v in given if v is not None}
        cmd = _Add(group, list(requests), arrival_time if arrival_time is not None else time.monotonic(), fut, options)
        num_seqs = sum(p.n for _, _, p in cmd.requests)
        with self._lock:
            # Counted in sequences, like the engine's waiting queue (n choices are n sequences).
            waiting = self.snapshot.num_waiting + self._pending_adds
            if waiting + num_seqs > self.max_waiting_requests:
                rejected = True
            else:
                rejected = False
                if self._dead is not None:
                    raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
                self._inbox.append(cmd)
                self._pending_adds += num_seqs
        if rejected:
            self.observer.on_request_rejected()
            raise QueueFullError(self.max_waiting_requests)
        group.request_ids = [r[0] for r in cmd.requests]
        group._unfinished = set(group.request_ids)
        self._groups.add(group)
        self._idle.clear()
        self._wake.set()
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                group._unfinished.clear()  # refused by the engine thread: nothing of it is left there
            # else cancelled while waiting: close() aborts whatever the engine thread may have added.
            group.close()
            raise
        return group

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; the request is aborted if the consumer stops early."""
        group = await self.add([(request_id, prompt_token_ids, params)], arrival_time)
        try:
            async for out in group:
                yield out
        finally:
            group.close()

    async def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(engine)`` in the engine thread, between two steps; its result or its exception."""
        self._check_accepting()
        assert self._loop is not None
        fut: asyncio.Future[T] = self._loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
            self._inbox.append(_Call(fn, fut))
        self._wake.set()
        return await fut

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (thread-safe, non-blocking); applied before the engine's next step."""
        if not request_ids:
            return
        with self._lock:
            if self._dead is not None or self._thread is None:
                return
            self._inbox.append(_Abort(list(request_ids)))
        self._wake.set()

    # --------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wake.clear()
                stop = self._drain_inbox()
                if stop:
                    self._abort_all(EngineStoppedError("the server shut down before this request finished"))
                    return
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._dispatch(outputs)
                    self._publish()
                else:
                    self._wake.wait()
        except BaseException as exc:  # noqa: BLE001 - any escape kills serving; report it everywhere
            log.exception("the engine thread died")
            self._die(exc)

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
            if isinstance(cmd, _Abort):
                for rid in cmd.request_ids:
                    if self._routes.pop(rid, None) is not None:
                        engine.abort(rid)
                continue
            if isinstance(cmd, _Call):
                try:
                    results.append((cmd.future, cmd.fn(engine), None))
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
        # bound in ``add`` never sees a request in neither or in both.
        snap = self._snapshot_now()
        with self._lock:
            self._pending_adds -= sum(p.n for c in cmds if isinstance(c, _Add) for _, _, p in c.requests)
            self.snapshot = snap
        if results:
            self._call_soon(self._resolve, results)
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
            self._call_soon(self._deliver, deliveries)

    def _snapshot_now(self) -> EngineSnapshot:
        e: Any = self.engine
        bm = getattr(e, "block_manager", None)
        return EngineSnapshot(
            num_running=int(getattr(e, "num_running", 0)),
            num_waiting=int(getattr(e, "num_waiting", 0)),
            num_used_blocks=int(getattr(bm, "num_used_blocks", 0)) if bm is not None else 0,
        )

    def _publish(self) -> None:
        self.snapshot = self._snapshot_now()

    def _abort_all(self, exc: BaseException) -> None:
        for rid in list(self._routes):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("abort of %s failed during shutdown", rid)
        self._fail_everything(exc)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
        self._fail_everything(EngineDeadError(f"the engine has stopped: {type(exc).__name__}: {exc}"))

    def _fail_everything(self, exc: BaseException) -> None:
        with self._lock:
            cmds, self._inbox = self._inbox, []
            self._pending_adds = 0
        groups = {id(g): g for g in self._routes.values()}
        self._routes.clear()
        futures = [(c.future, exc) for c in cmds if isinstance(c, (_Add, _Call))]
        for c in cmds:
            if isinstance(c, _Add):
                groups.pop(id(c.group), None)  # its add fails instead
        self._call_soon(self._fail, list(groups.values()), futures, exc)

    # ----------------------------------------------------------------- event-loop side callbacks

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    @staticmethod
    def _resolve(results: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
        for fut, value, error in results:
            if fut.done():
                continue
            if error is None:
                fut.set_result(value)
            else:
                fut.set_exception(error)

    @staticmethod
    def _deliver(deliveries: list[tuple[RequestGroup, RequestOutput]]) -> None:
        for group, out in deliveries:
            group._put(out)

    @staticmethod
    def _fail(
        groups: list[RequestGroup],
        futures: list[tuple[asyncio.Future[None], BaseException]],
        exc: BaseException,
    ) -> None:
        for g in groups:
            g._put(exc)
        for fut, e in futures:
            if not fut.done():
                fut.set_exception(e)
