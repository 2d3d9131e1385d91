"""``AsyncEngine`` on its own: delivery, early exit, refusals, engine death, draining."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from srv_harness import FakeEngine

from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams
from servelm.server.async_engine import AsyncEngine, EngineDeadError, EngineStoppedError, QueueFullError


async def _until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
def fake(server_tokenizer: Any) -> FakeEngine:
    return FakeEngine(server_tokenizer, step_time=0.005)


async def test_generate_runs_to_completion(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()
    outs = [o async for o in ae.generate("r1", [1, 2, 3], SamplingParams(max_tokens=5, n=2))]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    for i in range(2):
        text = "".join(c.new_text for o in outs for c in o.outputs if c.index == i)
        assert text == fake.expected_text(5, index=i)
    assert fake.block_manager.num_used_blocks == 0 and fake.aborted == []
    await ae.shutdown(1)
    assert not ae.is_alive


async def test_consumer_leaving_aborts_within_a_step(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()
    gen = ae.generate("r1", [1, 2, 3], SamplingParams(max_tokens=200))
    async for _ in gen:
        break
    await gen.aclose()
    steps_at_close = fake.steps
    await _until(lambda: fake.aborted == ["r1"])
    # Counted when the abort was applied (more steps may run before this thread looks: they report it).
    assert fake.steps_at_abort[0] - steps_at_close <= 1
    await _until(lambda: not fake.has_unfinished_requests())
    assert fake.block_manager.num_used_blocks == 0
    await ae.shutdown(1)


async def test_cancelled_consumer_aborts(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()

    async def consume() -> None:
        async for _ in ae.generate("r1", [1, 2, 3], SamplingParams(max_tokens=200)):
            pass

    task = asyncio.ensure_future(consume())
    await _until(lambda: fake.steps > 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: fake.aborted == ["r1"] and fake.block_manager.num_used_blocks == 0)
    await ae.shutdown(1)


async def test_bad_request_in_a_group_leaves_nothing_behind(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()
    ok = ("g-0", [1, 2], SamplingParams(max_tokens=5))
    too_long = ("g-1", list(range(1, 250)), SamplingParams(max_tokens=100))
    with pytest.raises(InvalidParameterError) as e:
        await ae.add([ok, too_long])
    assert e.value.param == "max_tokens"
    await _until(lambda: "g-0" in fake.aborted)
    assert not ae._groups and fake.block_manager.num_used_blocks == 0
    await ae.shutdown(1)


async def test_queue_bound_counts_sequences(fake: FakeEngine) -> None:
    fake.config.max_num_seqs = 1
    rejected: list[int] = []
    observer = type("O", (), {"on_request_rejected": lambda self: rejected.append(1)})()
    ae = AsyncEngine(fake, max_waiting_requests=3, observer=observer)
    ae.start()
    running = await ae.add([("run", [1], SamplingParams(max_tokens=100))])
    waiting = await ae.add([("wait", [1], SamplingParams(max_tokens=100, n=2))])
    with pytest.raises(QueueFullError):
        await ae.add([("more", [1], SamplingParams(max_tokens=1, n=2))])  # 2 waiting + 2 > 3
    assert rejected == [1]
    one = await ae.add([("one", [1], SamplingParams(max_tokens=1))])  # 2 + 1 <= 3
    for g in (running, waiting, one):
        g.close()
    await ae.shutdown(1)


async def test_engine_death_fails_everything(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()
    group = await ae.add([("r1", [1, 2], SamplingParams(max_tokens=200))])
    await _until(lambda: fake.steps > 2)
    fake.crash = True
    with pytest.raises(EngineDeadError):
        async for _ in group:
            pass
    assert not ae.is_alive and "simulated engine failure" in (ae.dead_reason or "")
    with pytest.raises(EngineDeadError):
        await ae.add([("r2", [1], SamplingParams())])
    await ae.shutdown(1)


async def test_shutdown_drains_then_refuses(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()
    group = await ae.add([("r1", [1, 2], SamplingParams(max_tokens=30))])

    async def consume() -> str:
        return "".join([c.new_text async for o in group for c in o.outputs])

    task = asyncio.ensure_future(consume())
    await _until(lambda: fake.steps > 2)
    await ae.shutdown(10)
    assert await task == fake.expected_text(30)
    assert not ae.is_alive
    with pytest.raises(EngineStoppedError):
        await ae.add([("r2", [1], SamplingParams())])


async def test_shutdown_deadline_aborts_the_rest(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()
    group = await ae.add([("r1", [1, 2], SamplingParams(max_tokens=200))])
    await ae.shutdown(0.05)
    with pytest.raises(EngineStoppedError):
        async for _ in group:
            pass
    assert fake.aborted == ["r1"] and fake.block_manager.num_used_blocks == 0


def test_run_in_transient_thread_returns_or_raises_from_a_finished_thread() -> None:
    from servelm.server.engine_thread import run_in_transient_thread

    threads: list[threading.Thread] = []

    def work() -> int:
        threads.append(threading.current_thread())
        return 42

    assert run_in_transient_thread(work) == 42
    assert threads[0] is not threading.current_thread() and not threads[0].is_alive()

    def boom() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope"):
        run_in_transient_thread(boom)
