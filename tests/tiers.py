"""The suite's two tiers: ``make test`` runs the tests not marked ``slow``, ``make test-slow`` the rest, and
CI runs both (docs/testing.md has the rule for what goes where).

Two parts of the rule are applied here, so a new test lands in the right tier without a mark: a test in a
module that uses the process harness (``ServeProcess``: a real ``servelm serve``) and a test that needs
a real GGUF model file (the ``gemma3_gguf`` and ``qwen05_gguf`` fixtures) are second tier. The rest of
the rule is marked by hand, each mark with its reason, and checked where it can be: a first-tier test
that starts a server process fails, whatever its marks say, and a first-tier test that takes more than
``SLOW_SECONDS`` is named at the end of the run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

SLOW = "slow"
# Fixtures that hand a test a real model's GGUF file: loading one costs seconds before the test starts.
REAL_GGUF_FIXTURES = frozenset({"gemma3_gguf", "qwen05_gguf"})
# Programs that are servers whatever their arguments.
SERVER_PROGRAMS = frozenset({"llama-server", "vllm-router"})
# A first-tier test (setup, call and teardown together) over this, on an idle machine, belongs to the second.
SLOW_SECONDS = 3.0


class SecondTierOnly(AssertionError):
    """A first-tier test started a server process."""


def second_tier_reason(item: pytest.Item) -> str | None:
    """Why ``item`` belongs to the second tier by the automatic part of the rule, or None."""
    module = getattr(item, "module", None)
    if module is not None and hasattr(module, "ServeProcess"):
        return "its module starts `servelm serve` processes"
    fixtures = REAL_GGUF_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if fixtures:
        return f"it loads a real GGUF model ({', '.join(sorted(fixtures))})"
    return None


def mark_second_tier(items: Iterable[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(SLOW) is None and second_tier_reason(item) is not None:
            item.add_marker(SLOW)


def server_in(argv: Any) -> str | None:
    """The server a command line starts (``servelm serve``, a router, llama-server), or None."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        words = os.fsdecode(argv).split()
    else:
        words = [os.fsdecode(a) for a in argv]
    names = [os.path.basename(w) for w in words]
    if "serve" in words and ("servelm" in names or "servelm.server.cli" in words):
        return "servelm serve"
    if "sglang_router.launch_router" in words:
        return "the sglang router"
    return next((n for n in names if n in SERVER_PROGRAMS), None)


class ServerGuard:
    """An audit hook that refuses to start a server process while a first-tier test runs.

    Python's audit event for ``subprocess.Popen`` (what ``subprocess.run``, asyncio and the process
    harness all go through) fires before the fork, so a refused server never starts.
    """

    def __init__(self) -> None:
        self.first_tier_test: str | None = None

    def enter(self, item: pytest.Item) -> None:
        """Called as ``item``'s setup begins (before its fixtures): the test whose rules apply now."""
        self.first_tier_test = None if item.get_closest_marker(SLOW) else item.nodeid

    def __call__(self, event: str, args: Sequence[Any]) -> None:
        if event != "subprocess.Popen" or self.first_tier_test is None:
            return
        server = server_in(args[1])
        if server is not None:
            raise SecondTierOnly(
                f"{self.first_tier_test} starts {server}, and tests that start servers belong to the second "
                "tier (make test-slow): mark it @pytest.mark.slow (docs/testing.md)"
            )


class FirstTierClock:
    """Adds up each first-tier test's setup, call and teardown, and names those over ``SLOW_SECONDS``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, report: pytest.TestReport) -> None:
        if SLOW not in report.keywords:
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def over(self) -> list[tuple[float, str]]:
        return sorted(((s, n) for n, s in self.seconds.items() if s > SLOW_SECONDS), reverse=True)

    def summary(self, write_line: Any, shown: int = 10) -> None:
        over = self.over()
        if not over:
            return
        write_line(
            f"{len(over)} first-tier tests over {SLOW_SECONDS:g} s: mark them slow (docs/testing.md), unless the "
            "machine was busy or the time is the first build of a C++ kernel after a change to its source"
        )
        for seconds, nodeid in over[:shown]:
            write_line(f"  {seconds:6.1f} s  {nodeid}")
