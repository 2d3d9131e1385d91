"""What the engine reports to metrics. The engine calls an ``Observer``; metrics/ decides nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class StepStats:
    """One engine iteration."""

    duration_s: float  # wall time of schedule + execute + update
    num_running: int  # after the step
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks in use / total
    num_prompt_tokens: int  # prompt (prefill/recompute) tokens computed this step
    num_generation_tokens: int  # tokens sampled this step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of which were found cached
    flops: float = 0.0  # counted model FLOPs of this step
    bytes_moved: float = 0.0  # weights + KV read/written this step
    time_to_first_tokens: list[float] = field(default_factory=list)  # requests that got their first token
    inter_token_latencies: list[float] = field(default_factory=list)  # one gap per later delivery
    num_draft_tokens: int = 0  # speculative drafts verified this step
    num_accepted_draft_tokens: int = 0  # of which were kept
    num_drafts: int = 0  # sequences whose drafts were verified this step
    accepted_per_pos: list[int] = field(default_factory=list)  # drafts kept at each position (0: the first)
    # LoRA serving on: the names of the adapters of running and of waiting requests (None: LoRA off)
    lora_adapters: tuple[list[str], list[str]] | None = None


@dataclass
class RequestStats:
    """A finished request (one choice of n), from its timestamps (time.monotonic())."""

    finish_reason: str  # stop | length | abort | error
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


class Observer(Protocol):
    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, stats: RequestStats) -> None: ...

    def on_request_rejected(self) -> None:
        """Refused before reaching the engine (queue full): counted as a failure "rejected"."""


class NullObserver:
    """Observes nothing (offline use, unit tests)."""

    def on_step(self, stats: StepStats) -> None:
        pass

    def on_request_finished(self, stats: RequestStats) -> None:
        pass

    def on_request_rejected(self) -> None:
        pass


class ObserverProxy:
    """An ``Observer`` whose target is set after the engine exists (the Prometheus observer wants
    the engine's resolved facts as labels, the engine its observer at construction). Kept across a
    model's loads, so its series continue after an unload."""

    def __init__(self, target: Observer | None = None) -> None:
        self.target = target

    def on_step(self, stats: StepStats) -> None:
        if self.target is not None:
            self.target.on_step(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        if self.target is not None:
            self.target.on_request_finished(stats)

    def on_request_rejected(self) -> None:
        if self.target is not None:
            self.target.on_request_rejected()
