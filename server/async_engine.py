"""The bridge between asyncio (HTTP handlers) and the synchronous, single-threaded ``Engine``.

The engine steps in its own thread (``server.engine_thread``); handlers hand it requests here and read
each HTTP request's outputs as one ``RequestGroup`` (``server.request_group``).

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
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from servelm.metrics.observer import NullObserver, Observer
from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.bridge import (
    Add,
    Call,
    EngineDeadError,
    EngineSnapshot,
    EngineStoppedError,
    resolve,
)
from servelm.server.engine_info import EngineInfo, engine_info
from servelm.server.engine_thread import EngineLike, EngineThread
from servelm.server.heap import HeapTrimmer
from servelm.server.output_text import RequestText, TextDecoders
from servelm.server.request_group import RequestGroup

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineLike",
    "EngineSnapshot",
    "EngineStoppedError",
    "QueueFullError",
    "RequestGroup",
]


class QueueFullError(RuntimeError):
    """Too many requests are already waiting."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} requests are waiting")
        self.limit = limit


class Bridge(Protocol):
    """What carries requests to an engine and its outputs back: ``EngineThread`` (the engine steps in a
    thread of this process) or ``server.engine_process.EngineProcess`` (it steps in a process of its own)."""

    dead: BaseException | None
    snapshot: EngineSnapshot

    @property
    def running(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def submit(self, cmd: Add | Call, num_seqs: int = 0, limit: int | None = None) -> bool: ...

    def notify(self, path: str, *args: Any) -> None: ...

    def wake(self) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def stop_choices(self, request_id: str, stopped: list[tuple[int, str]]) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout_s: float) -> None: ...


class _CountRejected:
    """The observer of a server whose engine is in another process: the one count made here goes there."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge

    def on_step(self, stats: Any) -> None:
        pass

    def on_request_finished(self, stats: Any) -> None:
        pass

    def on_request_rejected(self) -> None:
        self._bridge.notify("on_request_rejected")


class AsyncEngine:
    """An engine (stepping in a thread of this process, or in an engine-core process) exposed to asyncio code.

    ``AsyncEngine(engine)``: ``engine`` steps in a thread here. ``AsyncEngine(bridge=..., info=...,
    tokenizer=...)``: the bridge carries requests to an engine elsewhere, ``info`` its facts.
    ``start()`` must be called from the event loop that will consume outputs (the app's lifespan does).
    """

    def __init__(
        self,
        engine: EngineLike | None = None,
        *,
        bridge: Bridge | None = None,
        info: EngineInfo | None = None,
        tokenizer: Any = None,
        max_waiting_requests: int | None = None,
        observer: Observer | None = None,
        tokenizer_threads: int = 1,
        heap: HeapTrimmer | None = None,
    ) -> None:
        self.engine = engine  # None when it runs in another process
        self._info = info
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if bridge is None:
            assert engine is not None, "AsyncEngine needs an engine or a bridge"
            bridge = EngineThread(engine, heap)
            self.observer: Observer = observer or NullObserver()
        else:
            self.observer = observer or _CountRejected(bridge)
        config = engine.config if engine is not None else info.config if info is not None else None
        self.max_waiting_requests = (
            max_waiting_requests if max_waiting_requests is not None else config.max_waiting_requests  # type: ignore[union-attr]
        )
        self._engine_thread: Bridge = bridge
        self._decoders: TextDecoders | None = None
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups: set[RequestGroup] = set()  # event-loop thread only
        self._idle = asyncio.Event()
        self._accepting = True
        self._drain_task: asyncio.Task[None] | None = None
        # Tokenization and chat templating run here, never on the event loop. One thread: the
        # tokenizer's Rust object must not be mutated from two threads at once.
        self._executor = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="servelm-tok")

    # ------------------------------------------------------------------------------- life cycle

    @property
    def info(self) -> EngineInfo:
        """The engine's facts (served name, settled config, vocabulary...)."""
        if self._info is None:
            self._info = engine_info(self.engine)
        return self._info

    @property
    def bridge(self) -> Bridge:
        """What carries requests to the engine (``EngineThread`` or ``EngineProcess``)."""
        return self._engine_thread

    @property
    def in_process(self) -> bool:
        """The engine steps in a thread of this process (``self.engine`` is it)."""
        return self.engine is not None

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._engine_thread.start(self._loop)

    @property
    def snapshot(self) -> EngineSnapshot:
        """Engine counters as of the last step (any thread may read them)."""
        return self._engine_thread.snapshot

    @property
    def is_alive(self) -> bool:
        """True while the engine runs (``/health``)."""
        return self._engine_thread.running

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def dead_reason(self) -> str | None:
        return self._engine_thread.dead_reason

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
        log.warning(
            "drain deadline passed; ending %d request(s) with a 'server shutting down' error", len(self._groups)
        )
        exc = EngineStoppedError("the server is shutting down: the drain deadline passed")
        for group in list(self._groups):
            group.fail(exc)

    async def drained(self, timeout_s: float) -> None:
        """Return once the drain (``begin_drain``'s, else one started now with ``timeout_s``) has ended:
        the running requests finished or were cut at the deadline."""
        await asyncio.shield(self._start_drain(timeout_s))

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain (or finish the drain ``begin_drain`` started) within ``timeout_s``, then stop the engine thread."""
        await self._start_drain(timeout_s)
        self._engine_thread.stop()
        if self._started:
            await asyncio.to_thread(self._engine_thread.join, 10.0)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the engine now, from a thread that is not the event loop's (after a server that never
        started or whose lifespan never ran ``shutdown``); a no-op after ``shutdown``."""
        self._engine_thread.stop()
        if self._started or not self.in_process:
            self._engine_thread.join(10.0)

    # --------------------------------------------------------------------------- request API

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (tokenization, templating) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _check_accepting(self) -> None:
        t = self._engine_thread
        if t.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        if not t.running:
            raise EngineDeadError("the engine is not running")

    async def add(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        arrival_time: float | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        lora_adapter: Any | None = None,
    ) -> RequestGroup:
        """Hand requests to the engine as one group (computed with the LoRA adapter ``lora_name``, their
        prefix-cache blocks salted with ``cache_salt``, at ``priority``, when given); returns once the
        engine accepted them all. ``lora_adapter``: ``lora_name``'s weights read again, for an adapter
        the engine unloaded to make room (``LoRANotLoadedError``).

        Raises what ``Engine.add_request`` raises (``InvalidParameterError`` for a bad request; the
        earlier requests of the group are then aborted), ``QueueFullError``, ``EngineStoppedError``
        or ``EngineDeadError``.
        """
        self._check_accepting()
        assert self._loop is not None
        group = RequestGroup(self)
        fut: asyncio.Future[None] = self._loop.create_future()
        given = (
            ("lora_name", lora_name),
            ("cache_salt", cache_salt),
            ("priority", priority),
            ("lora_adapter", lora_adapter),
        )
        options = {k: v for k, v in given if v is not None}
        if len(requests) > 1:  # one client request's prompts share its fair share of the engine
            options["group"] = requests[0][0]
        cmd = Add(group, list(requests), arrival_time if arrival_time is not None else time.monotonic(), fut, options)
        num_seqs = sum(p.n for _, _, p in cmd.requests)
        if not self._engine_thread.submit(cmd, num_seqs, self.max_waiting_requests):
            self.observer.on_request_rejected()
            raise QueueFullError(self.max_waiting_requests)
        if self.info.makes_text_here:
            group.texts = {rid: self._text(params) for rid, _, params in cmd.requests if not params.use_beam_search}
        group.request_ids = [r[0] for r in cmd.requests]
        group._unfinished = set(group.request_ids)
        self._groups.add(group)
        self._idle.clear()
        self._engine_thread.wake()
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

    async def call(self, path: str, *args: Any, draining: bool = False) -> Any:
        """``engine.<path>(*args)`` between two steps (``call("loras.remove", name)``); its result or its
        exception. Arguments and result cross processes when the engine runs in its own. ``draining``:
        allowed while the server drains (a metrics scrape)."""
        if not (draining and self._engine_thread.running):
            self._check_accepting()
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._engine_thread.submit(Call(path, args, fut))
        self._engine_thread.wake()
        return await fut

    async def read_lora(self, path: str) -> Any:
        """A LoRA adapter folder, read and checked against the model (``LoRAError``: it is not one).

        In process, off the event loop and off the engine thread (a big adapter takes seconds); an engine
        in another process reads it between two steps (only it has the model) and sends it back."""
        if self.engine is not None:
            return await asyncio.to_thread(resolve(self.engine, "loras.read"), path)
        return await self.call("loras.read", path)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (thread-safe, non-blocking); applied before the engine's next step."""
        if not request_ids:
            return
        self._engine_thread.abort(list(request_ids))

    def _text(self, params: SamplingParams) -> RequestText:
        if self._decoders is None:  # (the tokenizer's vocabulary is read on first use)
            self._decoders = TextDecoders(self.tokenizer)
        return RequestText(self._decoders, params, self.info.eos_token_ids)

    def stop_choices(self, request_id: str, stopped: list[tuple[int, str]]) -> None:
        """Finish choices a stop string ended here (``RequestGroup`` found it in their text)."""
        self._engine_thread.stop_choices(request_id, stopped)

    def release(self, group: RequestGroup) -> None:
        """Forget a closed group (``RequestGroup.close`` calls it); the last one lets a drain end."""
        self._groups.discard(group)
        if not self._groups:
            self._idle.set()
