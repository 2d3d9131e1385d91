"""The wire format of ``POST /v1/completions``: the request model and the response's schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from servelm.server.protocol import GenerationRequest, GenerationResponse, PromptLogprobs

# Token ids before strings: pydantic's smart union validates every member, and a member that fails
# collects an error per element; a 2.5M-id prompt took 0.6 s of the event loop with list[str] first,
# 0.05 s this way round (a list of strings pays ~0.2 us per string instead).
Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    # Declared so they are refused by name (not as "unrecognized"):
    suffix: str | None = None
    best_of: int | None = None  # with use_beam_search: the beam width (n: how many of the best beams return)
    # vLLM's beam search: transformers' semantics (``scheduler.beam_search``); both others only with it.
    use_beam_search: bool | None = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_int(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("'logprobs' must be an integer in [0, 20] for /v1/completions (not a boolean)")
        return v


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object (parallel lists, one entry per token)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    cumulative_logprob: float | None = None  # beam search only: the sum of the choice's token log-probabilities


class CompletionResponse(GenerationResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
