"""``--data-parallel-size N``: N engine cores behind the API process, one bridge in front of them all.

``DataParallelEngines`` has the surface of one ``EngineProcess`` (``AsyncEngine`` cannot tell): an add
goes to the one core the balancer (``server.balancer``) picks, by load and prefix affinity, and a group
of requests (n > 1, several prompts) stays on it; the request id -> core map sends aborts where their
requests run. Calls: the metrics are gathered from every core and merged (``metrics.labelled``), reads
go to one core, and every other call (a LoRA adapter loaded or unloaded) to every core, which must all
agree. The counters are the cores' summed.

One core's death is the server's: every request on every core fails at once (``EngineDeadError``),
``/health`` answers 503 and the API process exits 1, as with one core.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.outputs import RequestOutput
from servelm.server.async_engine import AsyncEngine, Bridge
from servelm.server.balancer import CoreLoad, choose_core, prefix_key
from servelm.server.bridge import Add, Call, EngineDeadError, EngineSnapshot
from servelm.server.dp_placement import Placement, PlacementError, plan_placements, run_placed_engine_core
from servelm.server.engine_info import EngineInfo, load_api_tokenizer
from servelm.server.engine_process import CoreAddress, EngineProcess, EngineStartError
from servelm.server.request_group import RequestGroup

log = logging.getLogger(__name__)

GATHERED = frozenset({"metrics"})  # read from every core, merged
READS = frozenset({"loras.read"})  # any one core answers (it changes nothing)
UNDO = {"loras.add": "loras.remove"}  # a change some cores made and others refused is taken back


def start_data_parallel(config: EngineConfig, n: int, log_level: str = "info", api_servers: int = 1) -> AsyncEngine:
    """An ``AsyncEngine`` over ``n`` engine cores, each on its own CPUs or GPUs, started together; returns
    once all are ready. ``api_servers``: API processes each core will answer (this one is the first).
    Raises ``EngineStartError``."""
    from servelm.runtime.platform import visible_gpus

    try:
        plan = plan_placements(config, n, visible_gpus(config.device))
    except PlacementError as e:
        raise EngineStartError(str(e)) from e
    cores = [PlacedCore(c, pl, log_level, api_servers) for pl, c in plan]
    for pl, _ in plan:
        log.info("data parallel: %s", pl.describe())
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="servelm-dp-start") as pool:
        started = [pool.submit(core.launch) for core in cores]
    infos: list[EngineInfo] = []
    failures = []
    for i, f in enumerate(started):
        try:
            infos.append(f.result())
        except EngineStartError as e:
            failures.append(f"engine core {i}: {e}")
    if failures:
        for core in cores:
            core.close()
        raise EngineStartError("; ".join(failures))
    for i, info in enumerate(infos):
        log.info("engine core %d: capacity %s", i, info.capacity)
    return _over(DataParallelEngines(cores, infos))


def join_data_parallel(address: CoresAddress) -> AsyncEngine:
    """An ``AsyncEngine`` over the running engine cores at ``address`` (an API process after the first)."""
    return _over(DataParallelEngines([DataParallelCore(a) for a in address.cores], list(address.infos)))


def _over(bridge: DataParallelEngines) -> AsyncEngine:
    info = bridge.infos[0]
    try:
        tokenizer = load_api_tokenizer(info)
    except Exception as e:
        bridge.close()
        raise EngineStartError(f"the API process cannot load the tokenizer from {info.tokenizer_path}: {e}") from e
    # (Its counters are sums, read-only: the protocol declares them settable for the bridges that publish them.)
    return AsyncEngine(bridge=cast(Bridge, bridge), info=info, tokenizer=tokenizer)


@dataclass(frozen=True)
class CoresAddress:
    """How an API process after the first (``--api-server-count``) reaches every engine core, and their facts."""

    cores: tuple[CoreAddress, ...]
    infos: tuple[EngineInfo, ...]


class DataParallelCore(EngineProcess):
    """This API process's end of one of the engine cores, able to fail its requests when another core dies."""

    def __init__(self, address: CoreAddress | None = None, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        self.on_death: list[Callable[[BaseException], None]] = []

    def fail(self, exc: BaseException) -> None:
        """Another core died: what runs here fails too (the server stops)."""
        self._die(exc)

    def _die(self, exc: BaseException) -> None:
        super()._die(exc)
        assert self.dead is not None
        for hook in self.on_death:
            hook(self.dead)


class PlacedCore(DataParallelCore):
    """One of the engine cores, owned by this (the first) API process: spawned on its own share of the machine."""

    def __init__(self, config: EngineConfig, placement: Placement, log_level: str, api_servers: int) -> None:
        super().__init__(config=config, log_level=log_level, api_servers=api_servers)
        self.placement = placement
        spawn = multiprocessing.get_context("spawn")
        # Not a daemon: a tensor-parallel core starts worker processes of its own.
        self.process = spawn.Process(
            target=run_placed_engine_core,
            args=(placement, config, self.address.inbox, self.outboxes, log_level),
            name=f"servelm-engine-core-{placement.index}",
        )


class _Routed:
    """A group's stand-in in its core's routes: outputs pass through to the group, and the requests
    that end leave the request id -> core map."""

    def __init__(self, group: RequestGroup, forget: Callable[[list[str]], None], request_ids: list[str]) -> None:
        self.group, self.forget, self.request_ids = group, forget, request_ids

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.forget(self.request_ids)
        elif item.finished:
            self.forget([item.request_id])
        self.group._put(item)


class DataParallelEngines:
    """N ``EngineProcess``es behind one bridge (see the module's docstring)."""

    def __init__(self, cores: Sequence[DataParallelCore], infos: list[EngineInfo]) -> None:
        self.cores = list(cores)
        self.infos = infos
        self.block_size = int(infos[0].config.block_size or 0)
        self.num_blocks = [info.num_blocks for info in infos]
        self._lock = threading.Lock()  # the map and the counts (abort may come from any thread)
        self._core_of: dict[str, int] = {}
        self._pending = [0] * len(cores)  # sequences sent to each core and not yet acknowledged
        self._turn = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self.dead: BaseException | None = None  # the first core's death, the server's
        self.before_stop: list[Callable[[], None]] = []  # the first API process: wait for the others
        for i, core in enumerate(cores):
            core.on_death.append(functools.partial(self._core_died, i))

    # ------------------------------------------------------------------------------- what is known

    @property
    def dead_reason(self) -> str | None:
        return None if self.dead is None else f"{type(self.dead).__name__}: {self.dead}"

    @property
    def running(self) -> bool:
        return self.dead is None and all(c.running for c in self.cores)

    @property
    def snapshot(self) -> EngineSnapshot:
        snaps = [c.snapshot for c in self.cores]
        return EngineSnapshot(
            sum(s.num_running for s in snaps), sum(s.num_waiting for s in snaps), sum(s.num_used_blocks for s in snaps)
        )

    def loads(self) -> list[CoreLoad]:
        """Each core's load as the balancer sees it."""
        out = []
        for i, core in enumerate(self.cores):
            s = core.snapshot
            out.append(CoreLoad(s.num_running, s.num_waiting, self._pending[i], s.num_used_blocks, self.num_blocks[i]))
        return out

    # --------------------------------------------------------------------------------- life cycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for core in self.cores:
            core.start(loop)

    def stop(self) -> None:
        for wait in self.before_stop:
            wait()
        for core in self.cores:
            core.stop()

    def join(self, timeout_s: float) -> None:
        for core in self.cores:
            core.join(timeout_s)

    def close(self) -> None:
        for core in self.cores:
            core.close()

    def _core_died(self, index: int, cause: BaseException) -> None:
        """(From core ``index``'s watcher thread, or the event loop.) Every other core's requests fail too."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = EngineDeadError(f"engine core {index} stopped: {cause}")
        log.error("engine core %d stopped (%s): every request on every core fails", index, cause)
        for i, core in enumerate(self.cores):
            if i != index:
                core.fail(self.dead)

    # ------------------------------------------------------------------------------ requests

    def submit(self, cmd: Add | Call, num_seqs: int = 0, limit: int | None = None) -> bool:
        """An add to the core the balancer picks (False: more than ``limit`` sequences would wait in all
        the cores together); a call as the module's docstring says."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
        if isinstance(cmd, Call):
            self._call(cmd)
            return True
        loads = self.loads()
        if limit is not None and sum(c.num_waiting + c.num_pending for c in loads) + num_seqs > limit:
            return False
        first = cmd.requests[0]
        salt = "\0".join(str(cmd.options.get(k) or "") for k in ("lora_name", "cache_salt"))
        key = prefix_key(first[1], self.block_size, salt if salt != "\0" else None)
        i = choose_core(loads, key, start=next(self._turn))
        ids = [r[0] for r in cmd.requests]
        routed = cast(RequestGroup, _Routed(cmd.group, self._forget, ids))
        with self._lock:
            for rid in ids:
                self._core_of[rid] = i
            self._pending[i] += num_seqs
        cmd.future.add_done_callback(lambda fut: self._acknowledged(i, num_seqs, ids, fut))
        try:
            self.cores[i].submit(Add(routed, cmd.requests, cmd.arrival_time, cmd.future, cmd.options), num_seqs)
        except BaseException:
            self._forget(ids)
            raise
        return True

    def _acknowledged(self, index: int, num_seqs: int, ids: list[str], fut: asyncio.Future[None]) -> None:
        with self._lock:
            self._pending[index] -= num_seqs
            if not fut.cancelled() and fut.exception() is not None:  # refused: nothing of it runs there
                for rid in ids:
                    self._core_of.pop(rid, None)

    def _forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._core_of.pop(rid, None)

    def abort(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                i = self._core_of.pop(rid, None)
                if i is not None:
                    by_core.setdefault(i, []).append(rid)
        for i, ids in by_core.items():
            self.cores[i].abort(ids)

    def stop_choices(self, request_id: str, stopped: list[tuple[int, str]]) -> None:
        with self._lock:
            i = self._core_of.get(request_id)
        if i is not None:  # (else it has finished: nothing is left to stop)
            self.cores[i].stop_choices(request_id, stopped)

    def notify(self, path: str, *args: Any) -> None:
        self.cores[0].notify(path, *args)  # (a count: the merged metrics add every core's)

    def wake(self) -> None:
        for core in self.cores:
            core.wake()

    def address_of(self, client: int) -> CoresAddress:
        """The address API process ``client`` is given (only the owner knows them)."""
        return CoresAddress(tuple(c.address_of(client) for c in self.cores), tuple(self.infos))

    def client_gone(self, client: int) -> None:
        for core in self.cores:
            core.client_gone(client)

    # --------------------------------------------------------------------------------- calls

    def _call(self, cmd: Call) -> None:
        loop = cmd.future.get_loop()
        if cmd.path in READS:
            self.cores[self._least_loaded()].submit(cmd)
            return
        subs = [loop.create_future() for _ in self.cores]
        for core, fut in zip(self.cores, subs, strict=True):
            core.submit(Call(cmd.path, cmd.args, fut))
        task = loop.create_task(self._gather(cmd, subs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _least_loaded(self) -> int:
        loads = self.loads()
        return min(range(len(loads)), key=lambda i: loads[i].score)

    async def _gather(self, cmd: Call, subs: list[asyncio.Future[Any]]) -> None:
        results = await asyncio.gather(*subs, return_exceptions=True)
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        try:
            if cmd.path in GATHERED:
                if errors:
                    raise errors[0][1]
                from servelm.metrics.labelled import render_labelled

                value: Any = render_labelled([cast(tuple[bytes, str], r)[0] for r in results])
            elif errors:
                if len(errors) < len(results):
                    await self._undo(cmd, [i for i, r in enumerate(results) if not isinstance(r, BaseException)])
                raise errors[0][1]
            else:
                value = results[0]
        except BaseException as e:
            if not cmd.future.done():
                cmd.future.set_exception(e)
            return
        if not cmd.future.done():
            cmd.future.set_result(value)

    async def _undo(self, cmd: Call, done: list[int]) -> None:
        """Cores ``done`` made a change the others refused: take it back, so that they all agree again."""
        undo = UNDO.get(cmd.path)
        log.warning(
            "engine cores %s did %s and the others refused it%s", done, cmd.path, "; undoing it" if undo else ""
        )
        if undo is None:
            return
        loop = cmd.future.get_loop()
        subs = [loop.create_future() for _ in done]
        for i, fut in zip(done, subs, strict=True):
            self.cores[i].submit(Call(undo, cmd.args[:1], fut))
            self.cores[i].wake()
        await asyncio.gather(*subs, return_exceptions=True)
