"""The contract between the scheduler and the model runner.

The runtime must not import the scheduler, so what it needs of a request and of its
sampling parameters is described here as protocols; ``scheduler.Request`` and
``scheduler.SamplingParams`` satisfy them structurally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

# Stands in ``SequenceView.token_ids`` for a token the runner's previous sampling step drew but the
# host does not know yet (the engine scheduling ahead). Only ever a sequence's last token.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class LogitBias:
    """A request's ``logit_bias`` as CPU tensors, built once: the sampler adds it to the request's row
    every step with one tensor op for the whole batch, instead of walking the dict."""

    token_ids: torch.Tensor  # [k] int64
    values: torch.Tensor  # [k] float32
    lowest: int  # the smallest and largest token id: checked against the vocabulary without a tensor op
    highest: int

    @classmethod
    def of(cls, bias: dict[int, float]) -> LogitBias:
        ids = [int(t) for t in bias]
        values = torch.tensor([float(v) for v in bias.values()], dtype=torch.float32)
        return cls(torch.tensor(ids, dtype=torch.int64), values, min(ids), max(ids))


class SamplingSpec(Protocol):
    """Per-request sampling parameters, already validated at the edge."""

    temperature: float  # 0 => greedy (argmax)
    top_k: int  # 0 or -1 => off
    top_p: float  # 1.0 => off
    min_p: float  # 0.0 => off
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float  # 1.0 => off
    logit_bias: dict[int, float] | None
    min_tokens: int
    logprobs: int | None  # None => none; k => the chosen token's logprob plus the top-k alternatives
    prompt_logprobs: int | None  # None => none; k => each prompt token's logprob plus the top-k alternatives

    @property
    def logit_bias_tensors(self) -> LogitBias | None:
        """``logit_bias`` as tensors (None without one), built on first use and kept."""
        ...


@dataclass
class SamplingOptions:
    """A plain ``SamplingSpec`` with neutral defaults, for tests, benchmarks and offline tools.

    The engine itself is fed ``scheduler.SamplingParams``, which also validates.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @cached_property
    def logit_bias_tensors(self) -> LogitBias | None:
        return LogitBias.of(self.logit_bias) if self.logit_bias else None


class TokenMask(Protocol):
    """A sequence's structured-output state: which tokens may come next."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Set bit t % 32 of ``bitmask[row, t // 32]`` (int32, CPU) for every allowed token t, clear the rest."""
        ...


class SequenceView(Protocol):
    """What the runner reads of one sequence (a ``scheduler.Request``)."""

    seq_id: int  # unique while the sequence lives
    token_ids: list[int]  # prompt + generated so far (may end with PENDING_TOKEN); the runner only reads it
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose K/V are already in the pool
    block_table: list[int]  # pool block ids, in order
    generator: torch.Generator | None  # set when the request has a seed
    lora_id: int  # the LoRA adapter its rows use (``ModelRunner.add_lora``); 0: the base model

    # Read-only here, so that a Request's narrower types (SamplingParams, a tuple, GrammarMatcher) satisfy them.
    @property
    def params(self) -> SamplingSpec: ...

    @property
    def stop_token_ids_for_min_tokens(self) -> Sequence[int]:  # suppressed while fewer than min_tokens were generated
        ...

    @property
    def grammar(self) -> TokenMask | None:  # structured output: tokens outside the mask get -inf
        ...


@dataclass
class BatchItem:
    """Compute ``num_new_tokens`` tokens of ``seq`` (positions num_computed .. num_computed+num_new-1).

    ``sample`` is True when this chunk reaches the end of ``seq.token_ids``: the logits of its last
    position are sampled to produce the next token. A prefill chunk that stops short samples nothing.

    ``score`` ``(lo, hi)``: positions lo..hi-1 of this chunk (absolute, within the prompt's first
    ``num_prompt_tokens - 1``) whose logits score the prompt token that follows each of them (prompt
    logprobs, ``seq.params.prompt_logprobs`` alternatives each).
    """

    seq: SequenceView
    num_new_tokens: int
    sample: bool
    score: tuple[int, int] | None = None
    # Speculative decoding: tokens proposed to follow ``seq.token_ids``, computed in this step after
    # its last token (counted in ``num_new_tokens``); each of their positions is sampled too, and the
    # caller keeps the drafts that equal what was sampled before them.
    draft: list[int] | None = None
    # A draft model's drafts for a sampled sequence: the distribution each was drawn from [k, V]; the
    # drafts are then verified by speculative sampling's accept/reject rule (``runtime.spec_sampling``).
    draft_probs: torch.Tensor | None = None
    # A structured output's state after each draft (row j + 1 of the drafts' rows is masked by entry j):
    # the grammar masks every position the target verifies, as it would have masked it decoding.
    draft_grammars: list[TokenMask] | None = None
    # A few tokens of a sequence with a cached context, laid out as one decode row per position (each
    # attending up to itself, as drafts are): the decode kernels serve them where a prefill chunk would
    # gather the whole context every layer. Only the last row is sampled (if ``sample``).
    decode_rows: bool = False


@dataclass
class TokenLogprobs:
    """Log-probabilities (of the model's distribution before temperature/top-k/top-p) for one step."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # the k most likely (token id, logprob)


@dataclass
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens, ``first`` (its index in the prompt, >= 1) onwards; each
    from the raw logits of the position before it (no penalties, bias or temperature)."""

    first: int
    entries: list[TokenLogprobs]


@dataclass
class RunnerOutput:
    """One entry per ``BatchItem`` in the order given; None where the item did not sample.

    ``prompt_logprobs``: one entry per item (None where it scored nothing), or None when no item scored.
    """

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    # Items with a ``draft``: the tokens sampled at each draft's position (what follows draft j), with
    # their logprobs (entries None when not asked); None when no item had one.
    draft_samples: list[list[tuple[int, TokenLogprobs | None]] | None] | None = None
    # Items whose sampling raised, by item index: their tokens are None, and the other items got the
    # tokens the step would have given them anyway; None when none did.
    errors: dict[int, Exception] | None = None
