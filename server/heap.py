"""Freed heap handed back to the system while serving.

glibc keeps the memory a step frees inside its arenas for reuse; steps of changing sizes (prefill
chunks beside a varying number of decodes) leave it fragmented, so it grows resident without being
in use. ``malloc_trim`` returns every free page of every arena (a few milliseconds), so the engine
thread calls it when it goes idle and, while it steps, at most once an interval.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

# While stepping: a trim takes milliseconds, so one every 2 s stays well under 1% of the engine's time.
TRIM_INTERVAL_S = 2.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return None


_TRIM = _malloc_trim()


def return_free_heap() -> None:
    """Give the allocator's free pages back to the system (nothing where the C library is not glibc)."""
    if _TRIM is not None:
        _TRIM(0)


class HeapTrimmer:
    """Decides when the engine thread trims: ``stepped`` after each step, ``idle`` before it sleeps."""

    def __init__(
        self,
        interval_s: float = TRIM_INTERVAL_S,
        trim: Callable[[], None] = return_free_heap,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._trim = trim
        self._clock = clock
        self._last = clock()
        self._stepped = False  # anything freed since the last trim

    def stepped(self) -> None:
        self._stepped = True
        if self._clock() - self._last >= self.interval_s:
            self._run()

    def idle(self) -> None:
        if self._stepped:
            self._run()

    def _run(self) -> None:
        self._trim()
        self._last = self._clock()
        self._stepped = False
