"""Freed heap handed back while serving: when the engine goes idle, and at most once an interval while
it steps. glibc keeps what a step frees inside its arenas (a 16k-token Gemma 3 server held ~200 MiB of
free heap after 64 long prompts); ``malloc_trim`` gives those pages back."""

from __future__ import annotations

import asyncio
import ctypes
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from srv_harness import FakeEngine

from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.async_engine import AsyncEngine
from servelm.server.heap import HeapTrimmer, return_free_heap


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trims_at_most_once_an_interval_while_stepping_and_once_on_going_idle() -> None:
    trims: list[float] = []
    clock = Clock()
    heap = HeapTrimmer(interval_s=2.0, trim=lambda: trims.append(clock.now), clock=clock)
    heap.idle()
    assert trims == []  # nothing ran since start-up's own trim
    for _ in range(50):  # 5 s of 0.1 s steps
        clock.now += 0.1
        heap.stepped()
    assert trims == pytest.approx([2.0, 4.0])
    heap.idle()
    heap.idle()  # a second wake-up with nothing stepped in between frees nothing new
    assert trims == pytest.approx([2.0, 4.0, 5.0])
    clock.now += 0.1
    heap.stepped()  # the interval counts from the idle trim
    assert len(trims) == 3


def rss_anon_kib() -> int:
    return int(re.search(r"^RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def test_return_free_heap_gives_freed_chunks_back() -> None:
    try:
        glibc = hasattr(ctypes.CDLL("libc.so.6"), "malloc_trim")
    except OSError:
        glibc = False
    if not glibc:
        pytest.skip("not glibc")

    def churn() -> None:  # in its own thread, so in its own arena, as the engine thread's steps are
        held = [bytearray(96 << 10) for _ in range(1706)]  # 96 KiB each, under the mmap threshold: 160 MiB
        del held[::2]
        rss = rss_anon_kib()
        return_free_heap()
        freed.append((rss - rss_anon_kib()) // 1024)
        del held

    freed: list[int] = []
    worker = threading.Thread(target=churn)
    worker.start()
    worker.join()
    assert freed[0] >= 40, f"malloc_trim gave back {freed[0]} MiB of the 80 MiB freed"


async def test_the_engine_thread_trims_when_it_goes_idle(server_tokenizer: Any) -> None:
    trimmed = threading.Event()
    fake = FakeEngine(server_tokenizer, step_time=0.001)
    ae = AsyncEngine(fake, heap=HeapTrimmer(interval_s=3600, trim=trimmed.set))
    ae.start()
    await asyncio.sleep(0.05)
    assert not trimmed.is_set()  # idle since start: nothing to give back
    outs = [o async for o in ae.generate("r1", [1, 2, 3], SamplingParams(max_tokens=5))]
    assert outs[-1].finished
    assert await asyncio.get_running_loop().run_in_executor(None, trimmed.wait, 5.0)
    await ae.shutdown(1)
