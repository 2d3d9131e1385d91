"""The models one server serves, each with its own engine, loaded on demand under a memory budget.

Handlers never reach an engine directly: they ask ``ModelRegistry.lease(name)`` for the model's
``ServingContext`` (tokenizer, templates, and the ``AsyncEngine`` whose ``add``/``call``/
``run_blocking`` are the whole engine surface they use) and hold it while the request runs. That
lease is the seam a process per engine would replace: a handle whose context talks to another
process over the same few calls.

A lease counts the model's requests in flight: an idle model is unloaded when its keep-alive ends,
or, least recently used first, when a model to be loaded does not fit the budget; a model with a
request in flight never is.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from servelm.metrics.observer import Observer, ObserverProxy
from servelm.server.async_engine import AsyncEngine
from servelm.server.engine_info import EngineInfo
from servelm.server.errors import APIError, model_not_found, unavailable
from servelm.server.model_specs import ModelSpec
from servelm.server.serving_common import ServingContext

log = logging.getLogger(__name__)

# A model that failed to load is tried again by a request this long after (its files may be fixed).
RETRY_FAILED_S = 30.0

# (spec, observer) -> (engine, its Prometheus observer or None); runs in a thread of its own.
BuildEngine = Callable[[ModelSpec, Observer], tuple[Any, Any]]


@dataclass
class Lease:
    """A request's hold on a loaded model."""

    ctx: ServingContext
    load_wait_s: float | None  # seconds this request waited for the model to load (None: it was loaded)


class ModelHandle:
    """One served model: its state, and while loaded its engine behind a ``ServingContext``."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.state = "unloaded"  # unloaded | loading | loaded | failed
        self.error: str | None = None
        self.failed_at = 0.0
        self.ctx: ServingContext | None = None
        self.in_flight = 0
        self.last_used = 0.0
        self.keep_alive_s = spec.keep_alive_s  # the last request's keep_alive, else the model's
        self.expires_at: float | None = None  # wall-clock time its keep-alive ends (None: kept)
        self.proxy = ObserverProxy()
        self.observer: Any = None  # its Prometheus observer, made at its first load
        self._loading: asyncio.Task[None] | None = None
        self.unloading: asyncio.Task[bool] | None = None  # its keep-alive's unload, while it runs
        self._expiry: asyncio.TimerHandle | None = None
        self._generation = 0  # bumped by every use: a keep-alive timer of an earlier idle time is stale

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def async_engine(self) -> AsyncEngine | None:
        return self.ctx.async_engine if self.ctx is not None else None

    @property
    def info(self) -> EngineInfo | None:
        """The loaded engine's facts (None while it is not loaded)."""
        return self.ctx.async_engine.info if self.ctx is not None else None


class ModelRegistry:
    """The served models by name (ids and aliases; the first is the default), each loaded on demand
    by ``build`` and unloaded by keep-alive or to fit ``memory_budget`` bytes (None: no budget)."""

    def __init__(
        self,
        specs: list[ModelSpec],
        build: BuildEngine | None,
        *,
        memory_budget: int | None = None,
        configure: Callable[[ServingContext, ModelSpec], None] | None = None,
        metrics: Any = None,
    ) -> None:
        if not specs:
            raise ValueError("a server needs at least one model")
        self.handles = {s.id: ModelHandle(s) for s in specs}
        self.names = {name: self.handles[s.id] for s in specs for name in s.names}
        self.default = self.handles[specs[0].id]
        self.build = build
        self.memory_budget = memory_budget
        self.configure = configure
        self.metrics = metrics  # metrics.models.ModelMetrics, or None
        self.accepting = True
        self._load_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def single(cls, async_engine: AsyncEngine, ctx: ServingContext) -> ModelRegistry:
        """The registry of a one-model server: its engine built and loaded before the app (the
        command line as it always was), never unloaded."""
        registry = cls([ModelSpec(ctx.served_model_name, async_engine.info.config)], None)
        handle = registry.default
        handle.ctx, handle.state = ctx, "loaded"
        return registry

    @property
    def multi(self) -> bool:
        """More than one model: requests name theirs, and models load and unload."""
        return len(self.handles) > 1 or self.build is not None

    # ------------------------------------------------------------------------------- life cycle

    def start(self) -> None:
        """Start the engines loaded before the app (in the event loop that serves it)."""
        self._loop = asyncio.get_running_loop()
        for h in self.handles.values():
            if h.async_engine is not None:
                h.async_engine.start()
        for h in self.handles.values():
            self._report(h)

    def begin_drain(self, timeout_s: float) -> None:
        self.accepting = False
        for h in self.handles.values():
            if h.async_engine is not None:
                h.async_engine.begin_drain(timeout_s)

    async def drained(self, timeout_s: float) -> None:
        engines = [h.async_engine for h in self.handles.values() if h.async_engine is not None]
        await asyncio.gather(*(ae.drained(timeout_s) for ae in engines))

    async def shutdown(self, timeout_s: float) -> None:
        self.accepting = False
        for h in self.handles.values():
            if h._expiry is not None:
                h._expiry.cancel()
        engines = [h.async_engine for h in self.handles.values() if h.async_engine is not None]
        await asyncio.gather(*(ae.shutdown(timeout_s) for ae in engines))

    @property
    def dead_reason(self) -> str | None:
        """Why an engine died, if one did (the exit status of a one-model server says so)."""
        return next(
            (
                h.async_engine.dead_reason
                for h in self.handles.values()
                if h.async_engine and h.async_engine.dead_reason
            ),
            None,
        )

    def dead_engine(self) -> str | None:
        """Why a loaded model's engine is not running (``/health``), None while all run."""
        for h in self.handles.values():
            ae = h.async_engine
            if ae is not None and not ae.is_alive:
                return ae.dead_reason or "stopped"
        return None

    def default_accepting(self) -> bool:
        """A one-model server's engine takes requests (a drain stops it before the registry knows)."""
        ae = self.default.async_engine
        return ae is None or ae.is_accepting

    # ---------------------------------------------------------------------------------- lookup

    def resolve(self, name: str | None) -> ModelHandle:
        """The model ``name`` names (its id or an alias; None: the default); 404 for another name,
        unless a loaded model serves it as a LoRA adapter."""
        if name is None or name == "":
            return self.default
        # Ollama's clients may add its default tag to a name.
        handle = self.names.get(name) or self.names.get(name.removesuffix(":latest"))
        if handle is not None:
            return handle
        for h in self.handles.values():
            if h.ctx is not None and name in h.ctx.loras:
                return h
        raise model_not_found(name)

    def loaded_bytes(self, but: ModelHandle | None = None) -> int:
        return sum(
            h.spec.memory_bytes for h in self.handles.values() if h.state in ("loaded", "loading") and h is not but
        )

    # ----------------------------------------------------------------------------------- lease

    @asynccontextmanager
    async def lease(self, name: str | None, keep_alive_s: float | str | None = "model") -> AsyncIterator[Lease]:
        """Hold model ``name`` loaded while the block runs (loading it first if need be). Its
        keep-alive then counts from the end of its last request: ``keep_alive_s`` (None: kept
        loaded; 0: unloaded at once) when the request set one, else the model's own."""
        handle = self.resolve(name)
        handle.in_flight += 1
        handle._generation += 1
        if handle._expiry is not None:
            handle._expiry.cancel()
            handle._expiry = None
        handle.expires_at = None
        try:
            waited = None
            if handle.state != "loaded":
                started = time.monotonic()
                await self._ensure_loaded(handle)
                waited = time.monotonic() - started
            assert handle.ctx is not None
            yield Lease(handle.ctx, waited)
        finally:
            handle.in_flight -= 1
            handle.last_used = time.monotonic()
            # As Ollama: the keep-alive of the request that ended last, the model's when it set none.
            handle.keep_alive_s = handle.spec.keep_alive_s if keep_alive_s == "model" else keep_alive_s  # type: ignore[assignment]
            if handle.in_flight == 0 and handle.state == "loaded":
                self._schedule_expiry(handle)

    def _schedule_expiry(self, handle: ModelHandle) -> None:
        keep = handle.keep_alive_s
        if keep is None or self.build is None:
            return
        generation = handle._generation
        handle.expires_at = time.time() + keep
        loop = asyncio.get_running_loop()

        def expire() -> None:
            if handle._generation == generation and handle.in_flight == 0 and handle.state == "loaded":
                handle.unloading = loop.create_task(self.unload(handle, reason="keep_alive"))

        handle._expiry = loop.call_later(keep, expire)

    async def _ensure_loaded(self, handle: ModelHandle) -> None:
        if handle.state == "failed" and time.monotonic() - handle.failed_at < RETRY_FAILED_S:
            raise load_failed(handle)
        if handle._loading is None or handle._loading.done():
            handle._loading = asyncio.ensure_future(self._load(handle))
        await asyncio.shield(handle._loading)
        if handle.state == "failed":
            raise load_failed(handle)

    async def _load(self, handle: ModelHandle) -> None:
        if self.build is None:
            raise unavailable(f"The model `{handle.id}` is not loaded.", code="model_not_loaded")
        async with self._load_lock:  # one load at a time: each sees the memory the others took
            if handle.state == "loaded":
                return
            if not self.accepting:
                raise unavailable("The server is shutting down and loads no models.", code="shutting_down")
            await self._make_room(handle)
            handle.state, handle.error = "loading", None
            self._report(handle)
            log.info(
                "loading model %s (%s; ~%.0f MiB)",
                handle.id,
                handle.spec.config.model or "default",
                handle.spec.memory_bytes / 2**20,
            )
            started = time.monotonic()
            try:
                ctx = await self._start_engine(handle)
            except Exception as e:  # any failure of one model's load is that model's, the server goes on
                handle.state, handle.error, handle.failed_at = "failed", f"{type(e).__name__}: {e}", time.monotonic()
                log.error("model %s failed to load: %s", handle.id, handle.error)
                if self.metrics is not None:
                    self.metrics.load_failed(handle.id)
                self._report(handle)
                return
            seconds = time.monotonic() - started
            handle.ctx, handle.state = ctx, "loaded"
            log.info("model %s loaded in %.2f s", handle.id, seconds)
            if self.metrics is not None:
                self.metrics.loaded(handle.id, seconds)
            self._report(handle)

    async def _start_engine(self, handle: ModelHandle) -> ServingContext:
        from servelm.server.engine_thread import run_in_transient_thread

        assert self.build is not None
        build, spec, proxy = self.build, handle.spec, handle.proxy

        def start() -> ServingContext:
            engine, observer = build(spec, proxy)
            if handle.observer is None:
                handle.observer = observer
            async_engine = AsyncEngine(engine, observer=proxy, max_waiting_requests=engine.config.max_waiting_requests)
            # The context's tokenizer work (grammar vocabulary, prompt bound) is seconds for a large vocabulary.
            ctx = ServingContext.from_engine(async_engine)
            ctx.aliases = spec.aliases
            if self.configure is not None:
                self.configure(ctx, spec)
            return ctx

        # Off the event loop (the other models serve meanwhile), in a thread that exits: its OpenMP
        # team must not live beside the engine threads' (engine_thread.py).
        ctx = await asyncio.to_thread(run_in_transient_thread, start, f"servelm-load-{spec.id}")
        proxy.target = handle.observer
        ctx.async_engine.start()
        return ctx

    async def _make_room(self, handle: ModelHandle) -> None:
        """Unload idle models, least recently used first, until ``handle`` fits the budget."""
        budget = self.memory_budget
        if budget is None:
            return
        need = handle.spec.memory_bytes
        if need > budget:
            raise APIError(
                507, f"The model `{handle.id}` needs about {need / 2**30:.2f} GiB, more than the whole memory budget "
                f"({budget / 2**30:.2f} GiB; --models-memory-budget).", type="server_error", code="model_too_large",
            )  # fmt: skip
        while self.loaded_bytes(but=handle) + need > budget:
            idle = [h for h in self.handles.values() if h.state == "loaded" and h.in_flight == 0 and h is not handle]
            if not idle:
                busy = ", ".join(
                    h.id for h in self.handles.values() if h.state in ("loaded", "loading") and h is not handle
                )
                err = unavailable(
                    f"The model `{handle.id}` does not fit the memory budget while the models {busy} serve requests; retry.",
                    code="models_busy",
                )
                err.headers = {"Retry-After": "1"}
                raise err
            await self.unload(min(idle, key=lambda h: h.last_used), reason="budget")

    async def unload(self, handle: ModelHandle, reason: str = "request") -> bool:
        """Stop ``handle``'s engine and free its memory; False if it has requests in flight (it stays)."""
        if handle.state != "loaded" or handle.in_flight > 0 or self.build is None:
            return False
        ctx = handle.ctx
        assert ctx is not None
        handle.state, handle.ctx, handle.expires_at = "unloaded", None, None
        if handle._expiry is not None:
            handle._expiry.cancel()
            handle._expiry = None
        await ctx.async_engine.shutdown(0.0)
        del ctx
        gc.collect()  # the engine's tensors are in reference cycles (runner <-> model); free them now
        from servelm.server.heap import return_free_heap

        return_free_heap()
        log.info("model %s unloaded (%s)", handle.id, reason)
        if self.metrics is not None:
            self.metrics.unloaded(handle.id, reason)
        self._report(handle)
        return True

    def _report(self, handle: ModelHandle) -> None:
        if self.metrics is not None:
            self.metrics.state(handle.id, handle.state)

    # ---------------------------------------------------------------------------------- listing

    def describe(self) -> list[dict[str, Any]]:
        """Every model with its state, as /v1/models and /api/ps show them."""
        out = []
        for h in self.handles.values():
            item: dict[str, Any] = {
                "id": h.id,
                "state": h.state,
                "aliases": list(h.spec.aliases),
                "memory_bytes": h.spec.memory_bytes,
            }
            if h.error is not None and h.state == "failed":
                item["error"] = h.error
            if h.expires_at is not None:
                item["expires_at"] = h.expires_at
            out.append(item)
        return out


def load_failed(handle: ModelHandle) -> APIError:
    return APIError(
        500,
        f"The model `{handle.id}` failed to load: {handle.error}",
        type="server_error",
        param="model",
        code="model_load_failed",
    )


__all__ = ["BuildEngine", "Lease", "ModelHandle", "ModelRegistry", "load_failed"]
