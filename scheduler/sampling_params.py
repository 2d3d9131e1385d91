"""Sampling parameters: validated once at the edge; the engine trusts them afterwards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

# Re-exported: the edge names the error beside the parameters it checks.
from servelm.scheduler.errors import InvalidParameterError as InvalidParameterError

if TYPE_CHECKING:
    from servelm.runtime.batch import LogitBias
    from servelm.scheduler.structured_output import StructuredOutput


class LoRANotFoundError(InvalidParameterError):
    """A request names a LoRA adapter the engine does not serve (the server's 404)."""

    def __init__(self, name: str) -> None:
        super().__init__("model", f"The model `{name}` does not exist.")
        self.name = name


@dataclass(frozen=True)
class Range:
    """The values a numeric parameter may take: checked here, written into the API's schema."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself excluded

    def __contains__(self, value: float) -> bool:
        if value != value:  # NaN
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"greater than {self.low:g}" if self.low_open else f"at least {self.low:g}"
        return f"at most {self.high:g}"

    def json_schema(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


# Every range-checked numeric parameter, by its SamplingParams name.
# Stop strings per request, and characters per stop string (each gets a matcher built in the engine
# thread at admission, linear in its length).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096
# logit_bias entries (OpenAI's bound) and stop token ids per request: the sampler walks both for each
# of the request's rows every step, so they must not grow that step's work without bound.
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 300

RANGES: dict[str, Range] = {
    "n": Range(1, 128),
    "max_tokens": Range(1),
    "temperature": Range(0, 2),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(-1),  # -1 and 0: off
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 10, low_open=True),
    "min_tokens": Range(0),
    "logprobs": Range(0, 20),
    "prompt_logprobs": Range(0, 20),
}


@dataclass
class SamplingParams:
    """Per-request generation options (OpenAI's, plus vLLM-style extensions)."""

    n: int = 1
    max_tokens: int | None = 16  # None => up to max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives (0 = only the chosen token)
    # The same for every prompt token after the first (``echo`` with ``logprobs`` on /v1/completions).
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output must match a JSON schema, regex, choice or grammar (compiled at the edge).
    structured_output: StructuredOutput | None = None
    # Beam search (vLLM's extension): ``n`` beams, transformers' length penalty and early stopping.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def logit_bias_tensors(self) -> LogitBias | None:
        """``logit_bias`` as the tensors the sampler adds every step, built on first use."""
        from servelm.runtime.batch import LogitBias  # (torch: not imported where parameters are only validated)

        return LogitBias.of(self.logit_bias) if self.logit_bias else None

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidParameterError(param, msg)

        if not isinstance(self.n, int):
            bad("n", f"n must be an integer, got {self.n!r}")
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                bad(name, f"{name} must be {allowed.describe()}, got {value}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            bad("seed", f"seed out of range: {self.seed}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            bad("stop", f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
                if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                    bad("logit_bias", f"logit_bias token id {tok} is outside the vocabulary")
        if self.use_beam_search:
            self._validate_beam_search()
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if not 0 <= tok < vocab_size:
                    bad("stop_token_ids", f"stop token id {tok} is outside the vocabulary")

    def _validate_beam_search(self) -> None:
        """Beams rank by the model's own log-probabilities: what would change them, or whose output differs
        per beam (stop strings, grammars), is refused by name rather than ignored."""
        if self.early_stopping not in (True, False, "never"):
            raise InvalidParameterError(
                "early_stopping", f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
            )
        if not math.isfinite(self.length_penalty):
            raise InvalidParameterError(
                "length_penalty", f"length_penalty must be a finite number, got {self.length_penalty}"
            )
        off = {
            "temperature": 0.0,
            "top_p": 1.0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_tokens": 0,
            "prompt_logprobs": None,
        }
        bad = [name for name, value in off.items() if getattr(self, name) != value]
        bad += [name for name in ("logit_bias", "stop", "structured_output") if getattr(self, name)]
        if self.top_k not in (0, -1):
            bad.append("top_k")
        if bad:
            hint = " (beams follow the model's log-probabilities: 0 or omitted)" if bad[0] == "temperature" else ""
            raise InvalidParameterError(bad[0], f"'{bad[0]}' is not supported with use_beam_search{hint}")


class PromptTooLongError(InvalidParameterError):
    """Prompt tokens + max_tokens exceed the model's context length."""


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, vocab: int, max_model_len: int) -> int:
    """Check a request against the model it is for (vocabulary size, context length); return its
    resolved max_tokens (what the context leaves when the request gives none)."""
    params.validate(vocab_size=vocab)
    if not prompt_token_ids:
        raise InvalidParameterError("prompt", "the prompt is empty; it must contain at least one token")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidParameterError("prompt", f"prompt token id {bad} is outside the vocabulary (size {vocab})")
    limit = max_model_len
    n_prompt = len(prompt_token_ids)
    if params.max_tokens is None:
        if n_prompt >= limit:
            raise PromptTooLongError(
                "prompt",
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{n_prompt} tokens, which leaves no room for the completion. Please shorten the prompt.",
            )
        return limit - n_prompt
    total = n_prompt + params.max_tokens
    if total > limit:
        raise PromptTooLongError(
            "prompt" if n_prompt >= limit else "max_tokens",
            f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
            f"({n_prompt} in the prompt, {params.max_tokens} for the completion). Please reduce the length "
            "of the prompt or the completion.",
        )
    return params.max_tokens
