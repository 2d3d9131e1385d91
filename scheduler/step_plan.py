"""One step's plan as the scheduler hands it to the engine (``SchedulerOutput``), the waiting queue's
orders (``POLICIES``), and a step whose sampling was issued (``SampledStep``, its ``StepResult``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from servelm.runtime.batch import BatchItem, RunnerOutput
from servelm.scheduler.request import Request


@dataclass
class SchedulerOutput:
    """One step's plan: what to run, and what the scheduler did to make it fit."""

    items: list[BatchItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step
    errored: list[Request] = field(default_factory=list)  # finished with an error (can never fit)
    num_prompt_tokens: int = 0  # prefill / chunk / recompute tokens scheduled
    num_decode_tokens: int = 0  # single generated tokens scheduled (and the drafts verified with them)
    num_draft_tokens: int = 0  # speculative drafts scheduled for verification
    prefix_cache_queries: int = 0  # tokens looked up on admission this step
    prefix_cache_hits: int = 0  # of which were cached

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_decode_tokens

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted)

    @property
    def is_empty(self) -> bool:
        return not self.items


POLICIES = ("fcfs", "priority", "static")


def priority_key(req: Request) -> tuple[int, float, int]:
    """The ``priority`` policy's order: lower value first, then earlier arrival."""
    return (req.priority, req.arrival_time, req.seq_id)


def insert_by_priority(queue: deque[Request] | list[Request], req: Request) -> None:
    """Put ``req`` into ``queue`` (kept in ``priority_key`` order) after every request it does not precede."""
    # From the back: a request of the default priority, newest of all, is appended at once.
    key = priority_key(req)
    i = len(queue)
    while i > 0 and priority_key(queue[i - 1]) > key:
        i -= 1
    queue.insert(i, req)


class StepResult(Protocol):
    """A step's sampling on its way to the host (``runtime.step.StepOutput``)."""

    errors: dict[int, Exception]  # items whose sampling raised, by item index (known at once)

    def result(self) -> RunnerOutput:
        """The step's tokens, one entry per item (waits for them)."""
        ...


@dataclass
class SampledStep:
    """A step whose sampling was issued: its items and its ``StepOutput`` (tokens not read yet)."""

    items: list[BatchItem]
    output: StepResult
