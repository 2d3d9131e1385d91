"""What both bridges to an engine share (``server.engine_thread``: the engine in a thread of this process;
``server.engine_process``: in an engine-core process): the commands they carry, the errors they raise,
the counters they publish, and how results reach the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.request_group import RequestGroup


class EngineDeadError(RuntimeError):
    """The engine thread has stopped after an unexpected error; nothing can be served."""


class EngineStoppedError(RuntimeError):
    """The server is shutting down and accepts no new requests (or the drain deadline passed)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters as of the last step, published by the engine thread for other threads to read."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0


@dataclass
class Add:
    """Hand a group's requests to the engine (all or none)."""

    group: RequestGroup
    requests: list[tuple[str, list[int], SamplingParams]]
    arrival_time: float
    future: asyncio.Future[None]
    options: dict[
        str, Any
    ]  # Engine.add_request's keywords (lora_name, cache_salt, priority, lora_adapter) given for the group


@dataclass
class Abort:
    """Abort requests that may still be in the engine (their group is gone or failed)."""

    request_ids: list[str]


@dataclass
class StopChoices:
    """Finish choices as stopped by the stop string the API process found in their text: (index, stop)."""

    request_id: str
    stopped: list[tuple[int, str]]


@dataclass
class Call:
    """Call ``engine.<path>(*args)`` between two steps (``"loras.add"``: an adapter...)."""

    path: str
    args: tuple[Any, ...]
    future: asyncio.Future[Any]


def resolve(engine: Any, path: str) -> Callable[..., Any]:
    """``engine.a.b`` for ``"a.b"``: what the API side may call (never a private name)."""
    target = engine
    for name in path.split("."):
        if not name or name.startswith("_"):
            raise AttributeError(f"no engine call {path!r}")
        target = getattr(target, name)
    fn: Callable[..., Any] = target
    return fn


# ----------------------------------------------------------------------- on the event loop's thread


def resolve_futures(results: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, value, error in results:
        if fut.done():
            continue
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)


def deliver(deliveries: list[tuple[RequestGroup, RequestOutput]]) -> None:
    for group, out in deliveries:
        group._put(out)


def fail_all(
    groups: list[RequestGroup],
    futures: list[tuple[asyncio.Future[None], BaseException]],
    exc: BaseException,
) -> None:
    for g in groups:
        g._put(exc)
    for fut, e in futures:
        if not fut.done():
            fut.set_exception(e)


def call_soon(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` on ``loop``'s thread, from any thread; nothing once the loop is gone."""
    if loop is None or loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # loop closed between the check and the call
        pass
