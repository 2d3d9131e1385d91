"""One sequence being generated: a client request's choice ``index`` of ``n``."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from servelm.metrics.observer import RequestStats
from servelm.runtime.batch import PENDING_TOKEN, PromptLogprobs, TokenLogprobs
from servelm.scheduler.block_hash import block_hash_seed
from servelm.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:  # runtime-free imports only for type checkers
    from servelm.scheduler.choice_text import ChoiceText
    from servelm.scheduler.structured_output import GrammarMatcher

_SEED_MASK = (1 << 64) - 1


class RequestStatus(enum.Enum):
    """WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (waiting again, at the front) -> RUNNING."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # Both are asked for every request every step: they test the plain ``_value_`` string, whose hash
    # is cached (an Enum member's hash is computed in Python each time).
    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` ("stop", "length", "abort", "error"), None while unfinished."""
        value = self._value_
        return value if value in _FINISHED_VALUES else None


_FINISHED_VALUES = frozenset(
    s.value
    for s in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


class Request:
    """A sequence the scheduler moves through its queues; satisfies ``runtime.batch.SequenceView``.

    ``token_ids`` is prompt + output (ending with ``PENDING_TOKEN`` while the engine, scheduling ahead,
    has sampled a token it has not read yet); ``num_computed_tokens`` counts the positions whose K/V are in
    the pool and catches up with ``len(token_ids)`` one chunk at a time (prefill, decode, recompute
    and prefix-cache hits are all the same operation). ``max_tokens`` is already resolved (never None).
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        index: int = 0,
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        eos_token_ids: Sequence[int] = (),
        device: str | torch.device = "cpu",
        parent: Request | None = None,
        lora_id: int = 0,
        cache_salt: str | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        # The client request this sequence serves (its choices, its other prompts): the unit of fair share.
        self.group = group if group is not None else request_id
        self.index = index
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # The LoRA adapter computing this sequence (0: the base model). Its K/V differ from the base
        # model's for the same tokens, so its blocks' hash chain starts from its own seed; so do those
        # of a request with a cache salt, which shares blocks only with requests of the same salt.
        self.lora_id = lora_id
        self.priority = priority  # the ``priority`` scheduling policy's: lower first
        salted = lora_id or cache_salt is not None
        self.hash_seed: bytes | None = block_hash_seed(lora_id, cache_salt) if salted else None
        # Hash chain of this sequence's full blocks (a function of token ids and ``hash_seed`` only, so
        # it survives preemption); extended lazily by the block manager.
        self.block_hashes: list[bytes] = []
        self.max_tokens = max_tokens if max_tokens is not None else (params.max_tokens or 1)
        # Choice 0 of the same client request: choices 1..n-1 share its prompt blocks (fork).
        self.parent = parent

        self.eos_token_ids: tuple[int, ...] = () if params.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids)
        # The sampler suppresses these while fewer than min_tokens were generated.
        self.stop_token_ids_for_min_tokens: tuple[int, ...] = tuple(
            dict.fromkeys([*self.eos_token_ids, *params.stop_token_ids])
        )
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed((params.seed + index) & _SEED_MASK)

        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.output_logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # One entry per prompt token, the first None (nothing precedes it), filled as chunks are
        # computed. Only choice 0 scores the prompt: its siblings share it.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None and parent is None else None
        )
        # Structured output: this choice's own position in the grammar (dropped when it finishes).
        self.grammar: GrammarMatcher | None = None
        so = params.structured_output
        if so is not None:
            if so.compiled is None:
                raise ValueError("a structured output must be compiled before its request is made")
            self.grammar = so.compiled.matcher()
        self.num_preemptions = 0

        # Timestamps (time.monotonic()) from which every latency metric is derived.
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        # Prompt tokens the prefix cache held when the request was first scheduled (usage's cached_tokens).
        self.num_cached_tokens = 0
        self.drafting: Any = None  # speculative decoding: a scheduler.speculative.DraftState, made on first use
        self.beam: Any = None  # beam search: the scheduler.beam_search.BeamGroup this sequence is a beam of
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

        # Text state, set by an engine that emits text (None: token ids only, or scheduler-only tests).
        self.text: ChoiceText | None = None
        # Engine bookkeeping for outputs: what was already reported to the client.
        self.num_reported_tokens = 0

    # -- views -------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy (O(length)): for final results, not for the per-step path."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def num_prompt_scored(self) -> int:
        """Prompt positions whose logits have scored the token after them (all when none are asked)."""
        lps = self.prompt_logprobs
        return self.num_prompt_tokens - 1 if lps is None else len(lps) - 1

    @property
    def is_decoding(self) -> bool:
        """True when the next computed token is a generated one (one new token per step)."""
        return self.num_output_tokens > 0 and self.num_computed_tokens == len(self.token_ids) - 1

    # -- mutation ----------------------------------------------------------------------------------
    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Add a sampled token: in place of the pending token if there is one (scheduling ahead)."""
        if self.token_ids[-1] == PENDING_TOKEN:
            self.token_ids[-1] = token_id
        else:
            self.token_ids.append(token_id)
        if self.output_logprobs is not None and logprobs is not None:
            self.output_logprobs.append(logprobs)

    def add_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """Keep the entries that extend ``prompt_logprobs``; positions scored again after a preemption
        (recomputed before the engine read their first scores) are dropped."""
        lps = self.prompt_logprobs
        if lps is None:
            return
        skip = len(lps) - scored.first
        if skip < 0:
            raise ValueError(f"prompt logprobs from token {scored.first} leave a gap after token {len(lps) - 1}")
        lps.extend(scored.entries[skip:])

    def drop_pending_token(self) -> None:
        """Forget a pending token whose value will not be read (the sequence finished meanwhile)."""
        if self.token_ids[-1] == PENDING_TOKEN:
            self.token_ids.pop()

    def stats(self) -> RequestStats:
        """What the metrics record of this choice once it has finished."""
        return RequestStats(
            finish_reason=self.finish_reason or "error",
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=self.finished_time if self.finished_time is not None else time.monotonic(),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_output_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"Request(seq_id={self.seq_id}, request_id={self.request_id!r}, index={self.index}, "
            f"status={self.status.name}, tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )
