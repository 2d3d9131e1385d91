"""Beam search (vLLM's ``use_beam_search``) with transformers' semantics, on the iteration-level scheduler.

A request's beams are ordinary sequences (``Request``) of the scheduler, batched with every other request.
Each beam asks the sampler for the top K log-probabilities of its next token (log_softmax of the raw logits;
K = max(2, 1 + stop tokens) x width, what transformers keeps). Once every beam of a group has its candidates
(a beam computed earlier waits, scheduling nothing), the group takes one step of transformers' ``_beam_search``:
the best K continuations over all beams; those among the best ``width`` that end in a stop token (or reach
max_tokens) join the finished hypotheses at sum / length ** length_penalty; the best ``width`` others are the
next beams. The search ends by transformers' ``early_stopping`` rule (True, False or "never") or at max_tokens.

The next beams are forks: each shares its parent's blocks, the partly filled last one too, which the block
manager copies only when a beam writes into it (``BlockManager.share`` / ``adopt``); the blocks no next beam
continues are freed. Width 1 is greedy search, as transformers' ``num_beams=1`` is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelm.runtime.batch import TokenLogprobs
from servelm.scheduler.outputs import ChoiceGroup, CompletionOutput
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams

# transformers' score of a slot that holds no hypothesis yet (and of a continuation that may not be chosen).
_UNFILLED = -1.0e9


def _f32(a: float, b: float, divisor: float = 1.0) -> float:
    """(a + b) / divisor in float32, as transformers sums and scales beam scores (so near-ties order alike)."""
    return float((np.float32(a) + np.float32(b)) / np.float32(divisor))


@dataclass
class Candidate:
    """One continuation: beam ``beam`` followed by ``token``, whose log-probabilities sum to ``total``."""

    total: float
    beam: int
    token: int
    entry: TokenLogprobs | None  # the token's logprobs as a choice reports them (when asked)


@dataclass
class Hypothesis:
    """A finished sequence: its output tokens, their summed log-probability and its length-penalised score."""

    score: float
    cumulative: float
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    stopped: bool  # by a stop token (else by max_tokens)


@dataclass
class BeamGroup:
    """One request's beam search: its beams (``Request``s, index = slot), their scores, the finished hypotheses."""

    request_id: str
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    stop_ids: frozenset[int]
    logprobs: int | None  # alternatives a choice reports per token (None: no logprobs)
    beams: list[Request] = field(default_factory=list)
    scores: list[float] = field(default_factory=lambda: [0.0])
    histories: list[list[TokenLogprobs]] = field(default_factory=lambda: [[]])
    candidates: dict[int, tuple[int, TokenLogprobs]] = field(default_factory=dict)  # slot -> (preemptions, top K)
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True  # transformers' ``is_early_stop_heuristic_unsatisfied``
    done: bool = False
    beam_params: SamplingParams | None = None  # every beam's: greedy rows asking for the top ``keep`` logprobs
    request_args: dict[str, object] = field(default_factory=dict)  # every beam's Request arguments (arrival, salt, ...)

    @property
    def keep(self) -> int:
        """Continuations kept per step: enough that ``width`` of them go on whatever stop tokens they hold."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    def collect(self, beam: Request, top: TokenLogprobs) -> bool:
        """Keep a beam's candidates; True when every beam has fresh ones (a beam preempted since it gave
        them is recomputed and gives them again)."""
        self.candidates[beam.index] = (beam.num_preemptions, top)
        return len(self.candidates) == len(self.beams) and all(
            self.candidates[i][0] == b.num_preemptions for i, b in enumerate(self.beams)
        )

    def step(self) -> list[Candidate] | None:
        """One step of transformers' beam search over the collected candidates: the next beams, or None
        when the search is over (``finished`` then holds the results, best first)."""
        new_len = self.beams[0].num_output_tokens + 1
        cands: list[Candidate] = []
        for i in range(len(self.beams)):
            top = self.candidates[i][1]
            for rank, (tok, lp) in enumerate(top.top):
                entry = None
                if self.logprobs is not None:
                    entry = TokenLogprobs(tok, lp, rank + 1, top.top[: self.logprobs])
                cands.append(Candidate(_f32(self.scores[i], lp), i, tok, entry))
        self.candidates.clear()
        cands.sort(key=lambda c: (-c.total, c.beam, c.token))
        del cands[self.keep :]
        at_length = new_len >= self.max_tokens
        hits = [at_length or c.token in self.stop_ids for c in cands]
        full = len(self.finished) == self.width
        if self.improvable and not (full and self.early_stopping is True):
            # Only the best ``width`` continuations may finish; the others are there to go on.
            for c, hit in zip(cands[: self.width], hits):
                if hit:
                    self.finished.append(self._hypothesis(c, new_len))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width :]
        running = [c for c, hit in zip(cands, hits) if not hit][: self.width]
        if running:
            never = self.early_stopping == "never" and self.length_penalty > 0.0
            best = _f32(running[0].total, 0.0, (self.max_tokens if never else new_len) ** self.length_penalty)
            worst = min(h.score for h in self.finished) if len(self.finished) == self.width else _UNFILLED
            self.improvable = self.improvable and best > worst
        if not running or not self.improvable or (self.early_stopping is True and len(self.finished) == self.width):
            return None
        return running

    def _hypothesis(self, c: Candidate, length: int) -> Hypothesis:
        beam = self.beams[c.beam]
        tokens = beam.token_ids[beam.num_prompt_tokens :] + [c.token]
        lps = self.histories[c.beam] + [c.entry] if c.entry is not None else None
        return Hypothesis(
            _f32(c.total, 0.0, length**self.length_penalty), c.total, tokens, lps, c.token in self.stop_ids
        )


class BeamSearch:
    """The engine's beam-search requests: makes their beams, hands each step's candidates to their group,
    forks the next beams and reports the finished hypotheses as the request's choices."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # the ``scheduler.engine.Engine`` (not imported: it imports this module)

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        lora_name: str | None,
        arrival_time: float | None,
        cache_salt: str | None,
        priority: int,
        group_name: str | None,
    ) -> None:
        """Queue a beam search (``params.n`` beams): its first beam computes the prompt alone."""
        e = self.engine
        arrival = time.monotonic() if arrival_time is None else arrival_time
        kwargs: dict[str, object] = dict(
            arrival_time=arrival, cache_salt=cache_salt, priority=priority, group=group_name
        )
        refusal = (
            "a LoRA adapter is asked for"
            if lora_name is not None
            else "speculative decoding is on"
            if e.proposer is not None
            else "the model has sliding-window layers"
            if e.block_manager.windows is not None
            else "the model is split over ranks"
            if e.config.tensor_parallel_size > 1
            else None
        )
        if refusal:
            raise InvalidParameterError(
                "use_beam_search", f"use_beam_search is not supported on this server: {refusal}"
            )
        if params.n > e.scheduler.max_num_seqs:
            msg = f"beam width n={params.n} exceeds the sequences one step runs (--max-num-seqs {e.scheduler.max_num_seqs})"
            raise InvalidParameterError("n", msg)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(e.eos_token_ids))
        # With one beam the search is greedy: it ends at the first stop token, as transformers' num_beams=1.
        early = True if params.n == 1 else params.early_stopping
        group = BeamGroup(request_id, params.n, params.length_penalty, early, max_tokens, stop_ids, params.logprobs)
        beam_params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            skip_special_tokens=params.skip_special_tokens,
        )
        beam_params.logprobs = group.keep  # set after validation: K may exceed the API's 20 alternatives
        group.beam_params, group.request_args = beam_params, kwargs
        first = self._new_beam(group, list(prompt))
        e._groups[request_id] = ChoiceGroup(request_id, list(prompt), [first])
        e.scheduler.add(first)

    def _new_beam(self, group: BeamGroup, prompt: list[int]) -> Request:
        e = self.engine
        beam = Request(
            next(e._seq_ids),
            group.request_id,
            prompt,
            group.beam_params,  # type: ignore[arg-type]
            index=len(group.beams),
            max_tokens=group.max_tokens,
            eos_token_ids=e.eos_token_ids,
            device=e.device,
            **group.request_args,  # type: ignore[arg-type]
        )
        beam.beam = group
        group.beams.append(beam)
        return beam

    def collect(self, beam: Request, top: TokenLogprobs | None, changed: dict[str, ChoiceGroup]) -> None:
        """A beam's candidates for its next token; when the group has all of them, one search step."""
        group: BeamGroup = beam.beam
        if group.done or top is None or not group.collect(beam, top):
            return
        running = group.step()
        if running is None:
            self._report(group, changed)
        else:
            self._fork(group, running)

    def _fork(self, group: BeamGroup, running: list[Candidate]) -> None:
        """Make ``running`` the beams: each shares its parent's blocks; what no beam continues is freed."""
        e, bm = self.engine, self.engine.block_manager
        states = []
        for c in running:
            parent = group.beams[c.beam]
            history = group.histories[c.beam] + [c.entry] if c.entry is not None else []
            states.append(
                (
                    bm.share(parent),
                    parent.token_ids + [c.token],
                    parent.num_computed_tokens,
                    list(parent.block_hashes),
                    history,
                )
            )
        for beam in group.beams:
            bm.free(beam)
        first = group.beams[0]
        for j, (shared, tokens, computed, hashes, _) in enumerate(states):
            new = j == len(group.beams)
            beam = self._new_beam(group, first.prompt_token_ids) if new else group.beams[j]
            beam.token_ids, beam.num_computed_tokens, beam.block_hashes = tokens, computed, hashes
            bm.adopt(beam, shared)
            if new:
                e._groups[group.request_id].choices.append(beam)
                e.scheduler.add(beam)
        group.scores = [c.total for c in running]
        group.histories = [s[-1] for s in states]

    def _report(self, group: BeamGroup, changed: dict[str, ChoiceGroup]) -> None:
        """The search is over: free every beam and report the hypotheses, best first, as the choices."""
        e = self.engine
        group.done = True
        now = time.monotonic()
        status = RequestStatus.FINISHED_STOPPED if group.finished[0].stopped else RequestStatus.FINISHED_LENGTH
        for beam in group.beams:  # (their status: how the best hypothesis ended, for the metrics)
            e._finish(beam, status, now)
        choices = e._groups[group.request_id]
        skip = group.beams[0].params.skip_special_tokens
        choices.results = []
        for i, h in enumerate(group.finished):
            text = e.tokenizer.decode(h.token_ids, skip_special_tokens=skip)
            last = h.token_ids[-1]
            stop_reason = last if h.stopped and last not in e.eos_token_ids else None
            reason = "stop" if h.stopped else "length"
            out = CompletionOutput(
                i, h.token_ids, text, h.logprobs, len(h.token_ids), reason, stop_reason, h.cumulative
            )
            choices.pending[i] = out
            choices.results.append(out)
        changed[group.request_id] = choices

    def on_finished(self, beam: Request) -> bool:
        """A beam has finished: when before its search did (abort, error), every other beam ends the same way.
        True for all beams but the first, which alone stands for the request in the metrics."""
        group: BeamGroup = beam.beam
        if not group.done:
            group.done = True
            for other in group.beams:
                if not other.is_finished:
                    self.engine._finish(other, beam.status, time.monotonic())
        return beam.index > 0
