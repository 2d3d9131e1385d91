"""What the engine emits each step: deltas per request, grouped by the client's request id."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.batch import TokenLogprobs


@dataclass
class CompletionOutput:
    """The change in one choice (``index`` among ``n``) since the previous output."""

    index: int
    new_token_ids: list[int]
    new_text: str  # text delta; text that may still turn into a stop string is held back
    new_logprobs: list[TokenLogprobs] | None  # aligned with new_token_ids when logprobs were asked
    num_output_tokens: int  # cumulative, including new_token_ids
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass
class RequestOutput:
    """One step's news for one client request (all of its ``n`` choices)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)  # only choices that changed
    finished: bool = False  # every choice has finished
    error: str | None = None  # set when the request failed inside the engine (finish_reason "error")
    # Asked with ``prompt_logprobs``: one entry per prompt token (the first None), in the first output
    # after the whole prompt was scored (no later than the first generated token's).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prompt tokens served from the prefix cache (choice 0's, known once it is first scheduled).
    num_cached_tokens: int = 0


@dataclass
class GeneratedChoice:
    """One finished choice of an offline ``Engine.generate`` call."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    """Everything ``Engine.generate`` produced for one prompt (its ``n`` choices, in index order)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[GeneratedChoice] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
