"""The draft model's side of speculative decoding: a second ``ModelRunner`` that proposes each
speculating sequence's next tokens, batched over the sequences.

The draft's KV pool has as many blocks as the target's and is indexed by the same block tables (as
vLLM's draft layers share the target's block ids): a sequence's draft K/V lives at the same slots as
its target K/V, so the target's block manager allocates, shares and frees both, and the draft needs
no bookkeeping of its own but how far it has computed. The draft only ever writes the positions of
its own sequence, and recomputes every position it reads after the sequence starts (or is preempted),
so blocks shared through the prefix cache hold the draft K/V of the same tokens whoever wrote them.
What the draft computes decides only how many drafts are kept, never which tokens come out: the
target verifies every one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from servelm.runtime.batch import BatchItem, SamplingOptions, TokenMask
from servelm.runtime.logits_processing import process_logits
from servelm.runtime.runner import ModelRunner
from servelm.runtime.sampler import GREEDY_TEMPERATURE
from servelm.runtime.spec_sampling import draw, final_probs
from servelm.runtime.truncation import argmax_rows

# Most tokens a catch-up lays out as decode rows rather than a prefill chunk (a full acceptance leaves two).
CATCH_UP_DECODE_ROWS = 8


class DraftGrammar(TokenMask, Protocol):
    """A structured output's state that drafting advances (``scheduler.structured_output.GrammarMatcher``)."""

    def accept(self, token: int) -> bool:
        """Advance past ``token`` (``ValueError`` if the grammar does not allow it)."""
        ...

    def copy(self) -> DraftGrammar:
        """An independent copy of this state."""
        ...


@dataclass
class DraftView:
    """One speculating sequence as the draft model sees it (a ``runtime.batch.SequenceView``): the
    target's tokens, then the drafts proposed so far, over the target's block table."""

    seq_id: int
    token_ids: list[int]  # the sequence's tokens (a copy), drafts appended as they are drawn
    num_prompt_tokens: int
    num_computed_tokens: int  # draft K/V in the pool: positions before this
    block_table: list[int]  # the target's, covering every draft's position
    params: SamplingOptions  # the target's truncation and temperature, so q resembles p
    num_drafts: int  # to propose (fewer where a structured output completes)
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] each: what each draft was drawn from
    generator: torch.Generator | None = None
    lora_id: int = 0
    stop_token_ids_for_min_tokens: tuple[int, ...] = ()
    grammar: DraftGrammar | None = None  # a structured output's state (a copy), advanced past each draft
    grammars: list[TokenMask] = field(default_factory=list)  # its state after each draft
    refused: bool = False  # the grammar refused a draft: the target rejects it there, later rows are not read

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE


class DraftRunner:
    """Proposes drafts with ``runner`` (the draft model over its pool; see the module docstring)."""

    def __init__(self, runner: ModelRunner, seed: int | None = None) -> None:
        self.runner = runner
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def propose(self, views: Sequence[DraftView]) -> None:
        """Fill each view's ``drafts`` (and, sampled, ``probs``) up to ``num_drafts``.

        Each view first computes the tokens it has not (its last at least), whose last row gives the
        first draft; then one decode row per view per draft. Catching up is chunked to the runner's
        token budget, so a long prompt the draft has not seen takes several forwards.
        """
        budget = self.runner.max_num_batched_tokens
        while active := [v for v in views if len(v.drafts) < v.num_drafts]:
            batch: list[BatchItem] = []
            left = budget
            for v in active:
                behind = len(v.token_ids) - v.num_computed_tokens
                n = min(behind, left)
                if n <= 0:
                    break
                # A few tokens past a computed context (the last draft kept and the target's own
                # token) go as decode rows, which the fused decode path serves.
                rows = v.num_computed_tokens > 0 and n <= CATCH_UP_DECODE_ROWS
                batch.append(BatchItem(v, n, sample=n == behind, decode_rows=rows))
                left -= n
            self._step(batch)

    @torch.inference_mode()
    def _step(self, batch: list[BatchItem]) -> None:
        launched = self.runner.launch(batch)
        inputs = launched.inputs
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        if not inputs.sample_items:
            return
        logits = self.runner.sampled_logits(inputs, launched.hidden, launched.logits).contiguous()
        views: list[DraftView] = [batch[i].seq for i in inputs.sample_items]  # type: ignore[misc]
        process_logits(logits, views)  # the structured output's mask and logit_bias, as the target's rows get them
        tokens: list[int] = [0] * len(views)
        greedy = [r for r, v in enumerate(views) if v.greedy]
        if greedy:
            picked = argmax_rows(logits[greedy] if len(greedy) < len(views) else logits).tolist()
            for r, t in zip(greedy, picked):
                tokens[r] = t
        sampled = [r for r, v in enumerate(views) if not v.greedy]
        if sampled:
            probs = final_probs(logits[sampled].float().contiguous(), [views[r] for r in sampled], processed=True)
            for r, t, row in zip(sampled, draw(probs, self.generator).tolist(), probs):
                tokens[r] = t
                views[r].probs.append(row)
        for v, t in zip(views, tokens):
            v.drafts.append(t)
            v.token_ids.append(t)
            if v.grammar is not None:
                self._advance(v, t)

    @staticmethod
    def _advance(v: DraftView, token: int) -> None:
        """Move a view's grammar past its new draft and keep the state for the target's row after it."""
        assert v.grammar is not None
        if not v.refused:
            try:
                if v.grammar.accept(token):  # complete: the sequence ends with this draft if it is kept
                    v.num_drafts = len(v.drafts)
            except ValueError:  # the mask allowed no token here: the target rejects this draft
                v.refused = True
        v.grammars.append(v.grammar.copy())
