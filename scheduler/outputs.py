"""What the engine emits each step: deltas per request, grouped by the client's request id (``ChoiceGroup``
holds a request's choices and assembles their news)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from servelm.runtime.batch import TokenLogprobs

if TYPE_CHECKING:
    from servelm.scheduler.request import Request


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
    cumulative_logprob: float | None = None  # beam search: the sum of the choice's token log-probabilities


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
    # An encoder's request (``scheduler.encoder_engine``): the pooled vector (float32 values).
    embedding: list[float] | None = None


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
    cumulative_logprob: float | None = None  # beam search: the sum of the choice's token log-probabilities


@dataclass
class GenerationResult:
    """Everything ``Engine.generate`` produced for one prompt (its ``n`` choices, in index order)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[GeneratedChoice] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class ChoiceGroup:
    """The ``n`` choices of one client request, and the news of each not yet emitted."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[Request]
    num_finished: int = 0
    pending: dict[int, CompletionOutput] = field(default_factory=dict)  # by choice index, since the last output
    prompt_logprobs_sent: bool = False
    results: list[CompletionOutput] | None = None  # beam search: the whole choices, once it is over

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.choices)

    def complete_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """Choice 0's prompt logprobs (it scores the prompt) once every prompt token has its entry."""
        lps = self.choices[0].prompt_logprobs
        return lps if lps is not None and len(lps) == len(self.prompt_token_ids) else None

    def report(self, req: Request, text: str) -> None:
        """Queue ``req``'s news since its last report (tokens, their logprobs, ``text``, how it
        finished) after what is already queued for it (two tokens in one step: the step issued
        ahead, then this one, after ``async_scheduling`` was switched off)."""
        start = req.num_reported_tokens
        n_out = req.num_output_tokens
        new_ids = req.token_ids[req.num_prompt_tokens + start :] if n_out > start else []
        new_lps = req.output_logprobs[start:] if req.output_logprobs is not None else None
        req.num_reported_tokens = n_out
        out = CompletionOutput(req.index, new_ids, text, new_lps, n_out, req.finish_reason, req.stop_reason)
        prev = self.pending.get(req.index)
        if prev is not None:
            out.new_token_ids = prev.new_token_ids + out.new_token_ids
            out.new_text = prev.new_text + out.new_text
            if prev.new_logprobs is not None:
                out.new_logprobs = prev.new_logprobs + (out.new_logprobs or [])
        self.pending[req.index] = out

    def take_output(self) -> RequestOutput:
        """The queued news as one ``RequestOutput`` (choices in index order); the queue is emptied."""
        pending = self.pending
        outs = list(pending.values()) if len(pending) == 1 else [pending[i] for i in sorted(pending)]
        self.pending = {}
        error = next((r.error for r in self.choices if r.error), None)
        lps = None if self.prompt_logprobs_sent else self.complete_prompt_logprobs()
        if lps is not None:  # sent once, as soon as the whole prompt is scored
            self.prompt_logprobs_sent = True
        return RequestOutput(
            self.request_id, self.prompt_token_ids, outs, self.finished, error, lps, self.choices[0].num_cached_tokens
        )
