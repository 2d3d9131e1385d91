"""The data-parallel bridge (``server.data_parallel.DataParallelEngines``) over two scripted engines, each
behind an ``EngineThread`` standing in for an engine-core process: where adds go, where aborts go, how
calls are spread and gathered, and one core's death failing the other's requests."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from srv_harness import FakeEngine

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams
from servelm.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from servelm.server.balancer import CoreLoad
from servelm.server.data_parallel import DataParallelEngines
from servelm.server.engine_info import EngineInfo
from servelm.server.engine_thread import EngineThread

BLOCK = 16


class _Core(EngineThread):
    """An engine core's bridge surface, in a thread: what ``DataParallelEngines`` needs beyond ``Bridge``."""

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__(engine)
        self.on_death: list[Any] = []

    def fail(self, exc: BaseException) -> None:  # (EngineThread's would signal this process)
        self._die(exc)

    def _die(self, exc: BaseException) -> None:
        super()._die(exc)
        for hook in self.on_death:
            hook(self.dead)

    def client_gone(self, client: int) -> None:
        pass


def _info() -> EngineInfo:
    return EngineInfo("fake-model", EngineConfig(block_size=BLOCK), 100, (), "", "cpu", "", num_blocks=64)


@pytest.fixture
def fakes(server_tokenizer: Any) -> list[FakeEngine]:
    return [FakeEngine(server_tokenizer, step_time=0.003) for _ in range(2)]


@pytest.fixture
async def served(fakes: list[FakeEngine]) -> Any:
    dp = DataParallelEngines([_Core(f) for f in fakes], [_info(), _info()])  # type: ignore[list-item]
    ae = AsyncEngine(bridge=dp, info=_info(), max_waiting_requests=8, tokenizer=fakes[0].tokenizer)
    ae.start()
    yield ae, dp
    await ae.shutdown(1)


async def _run(ae: AsyncEngine, rid: str, prompt: list[int], n: int = 1, max_tokens: int = 3) -> None:
    async for _ in ae.generate(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n)):
        pass


async def test_requests_one_after_another_take_turns(served: Any, fakes: list[FakeEngine]) -> None:
    ae, dp = served
    for i in range(4):
        await _run(ae, f"r{i}", [5, 6, 7])  # shorter than a block: no affinity
    assert fakes[0].added == ["r0", "r2"] and fakes[1].added == ["r1", "r3"]
    assert dp._core_of == {}  # finished requests leave the map


async def test_a_burst_is_spread(served: Any, fakes: list[FakeEngine]) -> None:
    ae, _ = served
    await asyncio.gather(*(_run(ae, f"b{i}", [5, 6, i]) for i in range(6)))
    assert len(fakes[0].added) == len(fakes[1].added) == 3


async def test_a_shared_prefix_meets_the_same_core(served: Any, fakes: list[FakeEngine]) -> None:
    ae, _ = served
    head = list(range(10, 10 + 2 * BLOCK))
    for i in range(4):
        await _run(ae, f"p{i}", [*head, 100 + i])
    assert sorted(len(f.added) for f in fakes) == [0, 4]


async def test_a_group_stays_on_one_core(served: Any, fakes: list[FakeEngine]) -> None:
    ae, _ = served
    group = await ae.add([("g-0", [5, 6], SamplingParams(max_tokens=2)), ("g-1", [7, 8], SamplingParams(max_tokens=2))])
    async for _ in group:
        pass
    assert sorted(f.added for f in fakes) == [[], ["g-0", "g-1"]]


async def test_a_refused_request_leaves_nothing_behind(served: Any, fakes: list[FakeEngine]) -> None:
    ae, dp = served
    with pytest.raises(InvalidParameterError):
        await _run(ae, "too-long", [1, 2], max_tokens=1000)
    assert dp._core_of == {} and dp.loads() == [CoreLoad(num_blocks=64), CoreLoad(num_blocks=64)]


async def test_an_abort_reaches_the_core_running_it(served: Any, fakes: list[FakeEngine]) -> None:
    ae, dp = served
    await _run(ae, "first", [1, 2])  # core 0; the next idle turn is core 1
    gen = ae.generate("long", [3, 4], SamplingParams(max_tokens=200))
    await gen.__anext__()
    await gen.aclose()
    for _ in range(200):
        if fakes[1].aborted:
            break
        await asyncio.sleep(0.01)
    assert fakes[1].aborted == ["long"] and fakes[0].aborted == []
    assert dp._core_of == {}


async def test_a_stop_string_found_here_reaches_the_core_running_it(served: Any) -> None:
    ae, dp = served
    await _run(ae, "first", [1, 2])  # core 0; the next idle turn is core 1
    heard: list[tuple[int, str, list[tuple[int, str]]]] = []
    for i, core in enumerate(dp.cores):
        core.stop_choices = lambda rid, stopped, i=i: heard.append((i, rid, stopped))
    gen = ae.generate("long", [3, 4], SamplingParams(max_tokens=200))
    await gen.__anext__()
    dp.stop_choices("long", [(0, "END")])
    dp.stop_choices("gone", [(0, "END")])  # finished already: nowhere to go
    await gen.aclose()
    assert heard == [(1, "long", [(0, "END")])]


async def test_the_waiting_limit_is_the_servers(served: Any, fakes: list[FakeEngine]) -> None:
    ae, dp = served
    for f in fakes:
        f.config = dataclasses.replace(f.config, max_num_seqs=0)  # nothing is admitted: everything waits
    groups = [await ae.add([(f"w{i}", [1], SamplingParams(max_tokens=1))]) for i in range(8)]
    await asyncio.sleep(0.05)
    assert dp.snapshot.num_waiting == 8
    with pytest.raises(QueueFullError):
        await ae.add([("w-over", [1], SamplingParams(max_tokens=1))])
    for g in groups:
        g.close()


async def test_changes_go_to_every_core_and_a_refusal_is_undone(served: Any, fakes: list[FakeEngine]) -> None:
    ae, _ = served
    held: list[set[str]] = [set(), set()]

    def loras(i: int) -> Any:
        def add(name: str, _adapter: Any) -> None:
            if name == "bad" and i == 1:
                raise ValueError("core 1 refuses it")
            held[i].add(name)

        return SimpleNamespace(add=add, remove=lambda name: held[i].discard(name), read=lambda path: f"read {i}")

    for i, f in enumerate(fakes):
        f.loras = loras(i)  # type: ignore[attr-defined]
    await ae.call("loras.add", "good", None)
    assert held == [{"good"}, {"good"}]
    with pytest.raises(ValueError, match="core 1 refuses it"):
        await ae.call("loras.add", "bad", None)
    assert held == [{"good"}, {"good"}]  # core 0's "bad" was taken back
    await ae.call("loras.remove", "good")
    assert held == [set(), set()]
    assert await ae.call("loras.read", "/x") in ("read 0", "read 1")  # one core reads


async def test_metrics_are_gathered_and_labelled(served: Any, fakes: list[FakeEngine]) -> None:
    ae, _ = served
    for i, f in enumerate(fakes):
        body = f"# TYPE servelm_num_requests_running gauge\nservelm_num_requests_running {i + 3}\n".encode()
        f.metrics = lambda body=body: (body, "text/plain")  # type: ignore[attr-defined]
    body, _ = await ae.call("metrics")
    text = body.decode()
    assert 'servelm_num_requests_running{engine="0"} 3.0' in text
    assert 'servelm_num_requests_running{engine="1"} 4.0' in text


async def test_one_core_dying_fails_every_request(served: Any, fakes: list[FakeEngine]) -> None:
    ae, dp = served
    await _run(ae, "first", [1, 2])  # core 0; the next idle turn is core 1
    on_one = ae.generate("on-1", [3, 4], SamplingParams(max_tokens=250))
    await on_one.__anext__()
    on_zero = ae.generate("on-0", [5, 6], SamplingParams(max_tokens=250))
    await on_zero.__anext__()
    assert fakes[0].added[-1] == "on-0" and fakes[1].added[-1] == "on-1"
    fakes[1].crash = True
    with pytest.raises(EngineDeadError):
        async for _ in on_zero:  # the healthy core's request fails too
            pass
    await on_one.aclose()
    assert not ae.is_alive
    assert dp.dead_reason is not None and "engine core 1" in dp.dead_reason
    with pytest.raises(EngineDeadError):
        await ae.add([("late", [1], SamplingParams(max_tokens=1))])


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--engine-in-process"], "needs the engine-core process and one model"),
        (["--model", "a", "--model", "b"], "needs the engine-core process and one model"),
        (
            ["--data-parallel-size", "4096"],
            "--data-parallel-size 4096 x --tensor-parallel-size 1 needs",
        ),  # CPUs or GPUs
    ],
)
def test_what_is_refused_before_anything_starts(flags: list[str], why: str, caplog: Any) -> None:
    from servelm.server.cli import main

    argv = ["serve", "--port", "0", "--data-parallel-size", "2", *flags]
    with caplog.at_level("ERROR"):
        assert main(argv) == 1
    assert why in caplog.text


async def test_the_bridge_has_every_member_asyncengine_uses(served: Any) -> None:
    # (data_parallel casts it to Bridge: its counters are read-only sums, so mypy cannot check it against the protocol.)
    from servelm.server.async_engine import Bridge

    _, dp = served
    members = {n for n in [*vars(Bridge), *Bridge.__annotations__] if not n.startswith("_")}
    assert members and not [n for n in members if not hasattr(dp, n)]
