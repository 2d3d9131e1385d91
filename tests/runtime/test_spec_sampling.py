"""Speculative sampling's accept/reject rule against the distribution it must keep: over many seeded
draws on a six-token vocabulary, the tokens a verification yields are distributed as the target's
(chi-square), and the same test rejects rules that are subtly wrong."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from servelm.runtime.batch import SamplingOptions
from servelm.runtime.spec_sampling import draw, final_probs, rejection_sample, row_tokens


@dataclass
class Seq:
    """A ``runtime.batch.SequenceView`` with nothing but its sampling parameters."""

    params: SamplingOptions
    seq_id: int = 0
    token_ids: list[int] = field(default_factory=lambda: [1, 2])
    num_prompt_tokens: int = 2
    stop_token_ids_for_min_tokens: tuple[int, ...] = ()
    grammar: Any = None
    generator: torch.Generator | None = None


V = 6
N = 10_000
Rule = Callable[[torch.Tensor, torch.Tensor, Sequence[int], torch.Generator], tuple[int, int]]


def _keep_with_p(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], g: torch.Generator) -> tuple[int, int]:
    """Wrong for a sampled draft: keep d with probability p(d) (the rule for a fixed guess), residual p - q."""
    for j, d in enumerate(draft):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) < float(p[j, d]):
            continue
        return j, int(draw((p[j] - q[j]).clamp_min(0).unsqueeze(0), g)[0])
    return len(draft), int(draw(p[len(draft)].unsqueeze(0), g)[0])


def _redraw_from_p(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], g: torch.Generator) -> tuple[int, int]:
    """Wrong: the right acceptance, but a rejected position redrawn from p instead of the residual."""
    for j, d in enumerate(draft):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(q[j, d]) < float(p[j, d]):
            continue
        return j, int(draw(p[j].unsqueeze(0), g)[0])
    return len(draft), int(draw(p[len(draft)].unsqueeze(0), g)[0])


def _no_bonus(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], g: torch.Generator) -> tuple[int, int]:
    """Wrong: after every draft is kept, the next token is the draft model's choice (a draw from q)."""
    kept, token = rejection_sample(p, q, draft, g)
    if kept == len(draft):
        token = int(draw(q[-1].unsqueeze(0), g)[0])
    return kept, token


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at upper tail ~1e-4 (Wilson-Hilferty; z is the normal's 1e-4 quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _two_tokens(rule: Rule, p: torch.Tensor, q: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """Counts [V, V] of the first two tokens over N verifications of ``k`` drafts: a step that yields
    one token is followed by a plain draw at the next position, as the next step would."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    p, q = p[: k + 1], q[:k]
    for _ in range(N):
        draft = [int(draw(q[j].unsqueeze(0), g)[0]) for j in range(k)]
        kept, token = rule(p, q, draft, g)
        out = row_tokens(draft, kept, token)[: kept + 1]
        if len(out) == 1:
            out.append(int(draw(p[1].unsqueeze(0), g)[0]))
        counts[out[0], out[1]] += 1
    return counts


# Target and draft rows that disagree in every way that matters: tokens only one of them allows, a
# token the draft favours, and rows that differ by position.
P = torch.tensor(
    [[0.30, 0.25, 0.20, 0.15, 0.10, 0.00], [0.05, 0.05, 0.40, 0.30, 0.10, 0.10], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]]
)
Q = torch.tensor([[0.10, 0.40, 0.05, 0.05, 0.20, 0.20], [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])


@pytest.mark.parametrize(
    ("rule", "keeps_distribution"),
    [(rejection_sample, True), (_keep_with_p, False), (_redraw_from_p, False), (_no_bonus, False)],
    ids=["standard", "keep-with-p", "redraw-from-p", "bonus-from-q"],
)
def test_verified_tokens_are_distributed_as_the_target(rule: Rule, keeps_distribution: bool) -> None:
    # Two drafts test the rule at both positions; one draft, the token drawn after every draft was kept.
    # With target rows independent of history, the first two tokens are independent draws from P[0], P[1].
    passed = []
    for k in (1, 2):
        counts = _two_tokens(rule, P, Q, k, seed=7 + k)
        expected = N * torch.outer(P[0], P[1])
        cells = expected > 0
        chi2 = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
        critical = _chi2_critical(int(cells.sum()) - 1)
        passed.append(chi2 < critical and counts[~cells].sum() == 0)
        print(
            f"k={k}: chi-square {chi2:.1f} (critical {critical:.1f}), outside the support {int(counts[~cells].sum())}"
        )
    assert all(passed) == keeps_distribution, f"{'the rule' if keeps_distribution else 'a wrong rule'} gave {passed}"


def test_acceptance_rate_is_the_overlap_of_p_and_q() -> None:
    # One draft: kept with probability sum_x min(p(x), q(x)).
    g = torch.Generator().manual_seed(3)
    kept = sum(rejection_sample(P[:2], Q[:1], [int(draw(Q[:1], g)[0])], g)[0] for _ in range(N))
    overlap = float(torch.minimum(P[0], Q[0]).sum())
    assert abs(kept / N - overlap) < 4 * math.sqrt(overlap * (1 - overlap) / N)


def test_one_hot_rows_keep_exactly_the_targets_tokens() -> None:
    # Greedy in distribution form: a draft is kept iff it is the target's argmax, then the target's choice.
    eye = torch.eye(V)
    p = eye[[2, 4, 1]]
    assert rejection_sample(p, eye[[2, 4]], [2, 4], None) == (2, 1)
    assert rejection_sample(p, eye[[2, 3]], [2, 3], None) == (1, 4)
    assert rejection_sample(p, eye[[5, 4]], [5, 4], None) == (0, 2)
    assert row_tokens([5, 4], 0, 2) == [2, 2, 2]
    assert row_tokens([2, 4], 2, 1) == [2, 4, 1]


def test_final_probs_is_the_samplers_distribution() -> None:
    """The rows a draw comes from match ``Sampler``'s frequencies under temperature, top-k, top-p and min-p."""
    from servelm.runtime.sampler import Sampler

    torch.manual_seed(0)
    logits = torch.randn(1, 64) * 2
    for opts in (
        SamplingOptions(temperature=0.7),
        SamplingOptions(top_k=5),
        SamplingOptions(top_p=0.8, temperature=1.3),
        SamplingOptions(min_p=0.1),
        SamplingOptions(logit_bias={3: 5.0}, top_k=10),
    ):
        seq = Seq(opts)
        probs = final_probs(logits.clone(), [seq])[0]
        assert abs(float(probs.sum()) - 1) < 1e-5
        sampler = Sampler(seed=1)
        n = 4000
        tokens, _ = sampler.sample(logits.repeat(n, 1), [seq] * n)
        freq = torch.bincount(torch.tensor(tokens), minlength=64).float() / n
        assert bool((freq[probs == 0] == 0).all()), opts  # nothing outside the support
        assert float((freq - probs).abs().max()) < 0.04, opts
    with pytest.raises(ValueError, match="greedy"):
        final_probs(logits.clone(), [Seq(SamplingOptions(temperature=0))])
