"""Speculative sampling with a draft model: the distribution a row is drawn from, and the accept/reject
rule that keeps the target model's distribution whatever the draft proposes.

A draft token d drawn from the draft's distribution q is kept with probability min(1, p(d) / q(d)),
p being the target's distribution at that position; at the first one rejected, the token is drawn
from the residual max(0, p - q), normalised; when every draft is kept, one more token is drawn from
the target's distribution after the last one. Each token that comes out is then distributed as p
(Leviathan et al., 2023; Chen et al., 2023), so sampled requests keep the target's distribution, and
greedy ones (p and q one-hot) keep exactly the target's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from servelm.runtime.batch import BatchItem, SequenceView, TokenMask
from servelm.runtime.logits_processing import process_logits
from servelm.runtime.platform import platform_of
from servelm.runtime.sampler import GREEDY_TEMPERATURE, tempered_softmax
from servelm.runtime.truncation import truncate


def final_probs(logits: torch.Tensor, seqs: Sequence[SequenceView], processed: bool = False) -> torch.Tensor:
    """The distribution ``Sampler`` draws each row from: the processed logits (mask, bias, min_tokens;
    already applied if ``processed``), the temperature, then top-k, top-p and min-p, renormalised.
    ``logits`` [n, V] float32 is modified; no row may be greedy."""
    params = [s.params for s in seqs]
    if any(p.temperature < GREEDY_TEMPERATURE for p in params):
        raise ValueError("final_probs is for sampled rows; greedy rows take the argmax")
    if not processed:
        process_logits(logits, seqs)
    probs = tempered_softmax(logits, params)
    n, vocab = probs.shape
    device = probs.device
    platform = platform_of(device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    floor = torch.zeros(n, dtype=probs.dtype, device=device)
    if any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params):
        top_p = platform.host_to_device([p.top_p for p in params], device, probs.dtype)
        floor = truncate(probs, platform.host_to_device(top_k, device), top_p).floor
    if any(p.min_p > 0.0 for p in params):
        min_p = platform.host_to_device([p.min_p for p in params], device, probs.dtype)
        floor = torch.maximum(floor, min_p * probs.amax(-1))
    probs.masked_fill_(probs < floor.unsqueeze(1), 0.0)
    return probs.div_(probs.sum(-1, keepdim=True))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [n, V] (non-negative, not all zero)."""
    return torch.multinomial(probs.float().cpu(), 1, generator=generator).flatten().to(probs.device)


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """Verify ``draft`` (k tokens drawn from ``q`` [k, V]) against the target's ``p`` [k + 1, V] (row j: the
    distribution after draft j, row 0 after the last real token). Returns (drafts kept, the next token):
    the residual's draw at the first rejection, else a draw from the last row of ``p``."""
    k = len(draft)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"{k} drafts need {k + 1} target rows and {k} draft rows, got {p.shape[0]} and {q.shape[0]}")
    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    idx = torch.tensor(list(draft), dtype=torch.int64, device=p.device)
    pd = p[:k].gather(1, idx.unsqueeze(1)).squeeze(1).double().tolist()
    qd = q.gather(1, idx.unsqueeze(1)).squeeze(1).double().tolist()
    for j in range(k):
        # Keep with probability min(1, p/q): u * q < p compares without dividing by a tiny q.
        if u[j] * qd[j] < pd[j]:
            continue
        residual = (p[j].double() - q[j].double()).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # a rejection where p == q is rounding's doing: keep the draft
            continue
        # The residual is 0 at the rejected draft (p(d) > q(d) would have kept it): the token differs from it.
        return j, int(draw(residual.unsqueeze(0), generator)[0])
    return k, int(draw(p[k].unsqueeze(0), generator)[0])


def row_tokens(draft: Sequence[int], kept: int, token: int) -> list[int]:
    """The verification's result as one token per target row, in the form the engine reads drafts back
    (``BatchItem.draft``): row j holds draft j + 1 where it was kept, then the next token; rows after
    that are never read (the engine stops at the first draft unlike the row before it)."""
    rows = [*draft[:kept], token]
    return rows + [token] * (len(draft) + 1 - len(rows))


class MaskedRow:
    """A sequence as one of its draft rows sees it: the structured output's state after the drafts
    before the row (``BatchItem.draft_grammars``); everything else is the sequence's."""

    def __init__(self, seq: SequenceView, grammar: TokenMask) -> None:
        self._seq = seq
        self.grammar = grammar

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seq, name)


def row_seqs(items: Sequence[BatchItem], sample_items: Sequence[int]) -> list[SequenceView]:
    """The sequence of each sampled row (``sample_items`` names each row's item; an item's rows are
    consecutive), draft rows under a structured output seeing its state after the drafts before them."""
    seqs: list[SequenceView] = []
    last, j = -1, 0
    for i in sample_items:
        item = items[i]
        j = j + 1 if i == last else 0
        last = i
        grammars = item.draft_grammars
        seqs.append(MaskedRow(item.seq, grammars[j - 1]) if grammars and j else item.seq)
    return seqs


def verify_sampled_drafts(
    logits: torch.Tensor,
    items: Sequence[BatchItem],
    sample_items: Sequence[int],
    seqs: Sequence[SequenceView],
    generator: torch.Generator | None,
) -> list[tuple[int, list[int]]]:
    """Verify the drafts of every item with ``draft_probs`` against the step's ``logits`` (one row per
    sampled position, ``sample_items`` naming each row's item, ``seqs`` its sequence; not modified):
    (first row, the tokens of its rows) for each."""
    out: list[tuple[int, list[int]]] = []
    for idx, item in enumerate(items):
        if item.draft_probs is None or not item.draft:
            continue
        at = sample_items.index(idx)  # an item's rows are consecutive
        k = len(item.draft)
        p = final_probs(logits[at : at + k + 1].float().clone(), seqs[at : at + k + 1])
        kept, token = rejection_sample(p, item.draft_probs.to(p.device), item.draft, generator)
        out.append((at, row_tokens(item.draft, kept, token)))
    return out
