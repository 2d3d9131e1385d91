"""The batched sampler: greedy, truncation, distributions, seeds, penalties, logprobs."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from servelm.runtime.batch import SamplingOptions
from servelm.runtime.sampler import Sampler
from servelm.runtime.truncation import (
    TOP_P_FIRST_CANDIDATES,
    _head,
    argmax_rows,
    inverse_cdf,
    sample_sorted,
    truncate,
)

Spec = SamplingOptions  # temperature 1.0, everything else off


@dataclass
class Seq:
    """A ``runtime.batch.SequenceView``."""

    token_ids: list[int] = field(default_factory=lambda: [1])
    num_prompt_tokens: int = 1
    params: Spec = field(default_factory=Spec)
    generator: torch.Generator | None = None
    stop_token_ids_for_min_tokens: tuple[int, ...] = ()
    grammar: Any = None  # runtime.batch.TokenMask
    seq_id: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)


GREEDY = Spec(temperature=0.0)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.72: p ~ 1e-4)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def reference_allowed(logits: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Renormalised probabilities after temperature/top-k/top-p/min-p, by brute force in float64."""
    probs = torch.softmax(logits.double() / spec.temperature, -1)
    order = probs.argsort(descending=True)
    sorted_p = probs[order]
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if 0 < spec.top_k < len(probs):
        keep[spec.top_k :] = False
    mass = torch.where(keep, sorted_p, 0.0)
    if spec.top_p < 1.0:
        before = torch.cumsum(mass, 0) - mass
        keep &= before < spec.top_p * mass.sum()
    if spec.min_p > 0:
        keep &= sorted_p >= spec.min_p * sorted_p[0]
    out = torch.zeros_like(probs)
    out[order] = torch.where(keep, sorted_p, 0.0)
    return out / out.sum()


# ---- greedy -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [50, 37, 1000, 49152])
def test_greedy_is_argmax(vocab: int) -> None:
    logits = torch.randn(8, vocab, generator=seeded(vocab)) * 4
    logits[3, :] = 0.5  # an all-tied row: the first index wins, as with torch.argmax
    logits[5, vocab // 2] = logits[5, vocab - 1] = 100.0  # a tie across blocks
    expected = logits.argmax(-1).tolist()
    tokens, lps = Sampler(seed=0).sample(logits.clone(), [Seq(params=GREEDY) for _ in range(8)])
    assert tokens == expected
    assert tokens[3] == 0 and tokens[5] == vocab // 2
    assert lps == [None] * 8
    assert argmax_rows(logits).tolist() == expected


@pytest.mark.parametrize("rows", [1, 33])  # 33 x 65,536 logits: past numpy's share, the torch path
def test_argmax_rows_takes_the_first_maximum_and_the_first_nan(rows: int) -> None:
    logits = torch.randn(rows, 65536, generator=seeded(rows))
    logits[0, 7] = logits[0, 60000] = 50.0
    logits[-1, 9] = logits[-1, 40000] = float("nan")
    got = argmax_rows(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(-1).tolist()
    assert got[0] == (9 if rows == 1 else 7) and got[-1] == 9


def test_empty_batch() -> None:
    assert Sampler().sample(torch.empty(0, 50), []) == ([], [])


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 50), [Seq()])


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.randn(4, 50, generator=seeded(3))
    tokens, _ = Sampler(seed=1).sample(logits.clone(), [Seq(params=Spec(temperature=1e-7)) for _ in range(4)])
    assert tokens == logits.argmax(-1).tolist()


# ---- distributions ----------------------------------------------------------------------------------

DIST_CASES = {  # name: (spec, vocab, logit scale)
    "temperature": (Spec(temperature=0.7), 50, 1.5),
    "hot": (Spec(temperature=1.8), 50, 1.5),
    "top_k": (Spec(top_k=6), 50, 1.5),
    "top_p": (Spec(top_p=0.6), 50, 1.5),
    "min_p": (Spec(min_p=0.15), 50, 1.5),
    "all": (Spec(temperature=1.3, top_k=12, top_p=0.8, min_p=0.05), 50, 1.5),
    # Wide survivor sets: the histogram paths and the masked draw over the whole vocabulary.
    "wide top_p": (Spec(top_p=0.7), 1024, 1.0),
    "large top_k": (Spec(top_k=300, top_p=0.95), 1024, 0.5),
}


@pytest.mark.parametrize("name", list(DIST_CASES))
def test_empirical_distribution_matches_allowed_set(name: str) -> None:
    spec, vocab, scale = DIST_CASES[name]
    draws = 4000 if vocab <= 50 else 8000
    logits = torch.randn(vocab, generator=seeded(11)) * scale
    expected = reference_allowed(logits, spec)
    allowed = set(torch.nonzero(expected).flatten().tolist())
    assert 1 < len(allowed) < vocab or name in ("temperature", "hot")
    if vocab > 50:
        assert len(allowed) > 2 * TOP_P_FIRST_CANDIDATES

    # One batch of identical rows (the shared generator) plus a few small batches for good measure.
    sampler = Sampler(seed=123)
    tokens, _ = sampler.sample(logits.repeat(draws, 1), [Seq(params=spec) for _ in range(draws)])
    for _ in range(10):
        more, _ = sampler.sample(logits.repeat(3, 1), [Seq(params=spec) for _ in range(3)])
        tokens += more
    assert set(tokens) <= allowed, f"picked outside the allowed set: {set(tokens) - allowed}"

    counts = Counter(tokens)
    n = len(tokens)
    chi2 = sum((counts.get(t, 0) - n * float(expected[t])) ** 2 / (n * float(expected[t])) for t in allowed)
    assert chi2 < chi2_critical(len(allowed) - 1), (chi2, len(allowed))


def test_top_k_one_and_top_p_tiny_are_greedy() -> None:
    logits = torch.randn(6, 50, generator=seeded(5)) * 2
    seqs = [Seq(params=Spec(top_k=1)) for _ in range(3)] + [Seq(params=Spec(top_p=1e-6)) for _ in range(3)]
    tokens, _ = Sampler(seed=0).sample(logits.clone(), seqs)
    assert tokens == logits.argmax(-1).tolist()


def _reference_threshold(probs: torch.Tensor, k: int, p: float) -> tuple[float, float]:
    """(threshold, how close the top-p boundary is to a rounding flip) by a float64 full sort."""
    s = probs.double().sort(descending=True).values
    v = len(s)
    k = k if 0 < k < v else v
    head = s[:k]
    if p >= 1.0:
        return float(head[-1]) if k < v else 0.0, 1.0
    cum = head.cumsum(0)
    before = cum - head
    limit = p * cum[-1]
    n_keep = int((before < limit).sum().clamp_min(1))
    margin = float((before - limit).abs().min())
    return float(head[n_keep - 1]), margin


def test_truncation_matches_full_sort() -> None:
    """Rows with wide nuclei (flat distributions) take the histogram path; the others a head."""
    gen = seeded(7)
    vocab = 3000
    cases = []
    for i in range(60):
        scale = [0.05, 0.5, 2.0, 6.0][i % 4]  # 0.05: nearly flat, the nucleus spans thousands
        k = [0, 0, 5, 100, 2999, 0, 400][i % 7]
        p = [0.9, 0.5, 1.0, 0.95, 0.3, 0.999][i % 6]
        cases.append((torch.randn(vocab, generator=gen) * scale, k, p))
    probs = torch.stack([torch.softmax(x, -1) for x, _, _ in cases])
    k_t = torch.tensor([k if k > 0 else vocab for _, k, _ in cases])
    p_t = torch.tensor([p for _, _, p in cases])
    cut = truncate(probs, k_t, p_t)
    widest = 0
    for i, (_, k, p) in enumerate(cases):
        want, margin = _reference_threshold(probs[i], k, p)
        if margin < 1e-5:  # the float32 and float64 sums may legitimately disagree on the boundary
            continue
        assert cut.floor[i].item() == pytest.approx(want, rel=1e-6, abs=0.0), (i, k, p)
        widest = max(widest, int((probs[i] >= cut.floor[i]).sum()))
    assert widest > 8 * TOP_P_FIRST_CANDIDATES  # the histogram path really ran
    # A row drawn from a head finds all its survivors there.
    in_heads = 0
    for rows, vals, ids in cut.heads:
        for r, v, t in zip(rows.tolist(), vals, ids):
            kept = set(t[v >= cut.floor[r]].tolist())
            assert kept == set(torch.nonzero(probs[r] >= cut.floor[r]).flatten().tolist()), r
            assert torch.equal(probs[r][t][v > 0], v[v > 0])
            in_heads += 1
    assert 10 < in_heads < 60


def test_truncation_rows_do_not_depend_on_their_batch() -> None:
    gen = seeded(8)
    probs = torch.softmax(torch.randn(6, 2000, generator=gen) * torch.tensor([[0.3], [3], [0.3], [1], [5], [0.2]]), -1)
    k = torch.tensor([2000, 40, 2000, 1500, 2000, 7])
    p = torch.tensor([0.9, 0.8, 1.0, 0.7, 0.99, 0.5])
    together = truncate(probs, k, p).floor
    for i in range(6):
        alone = truncate(probs[i : i + 1].clone(), k[i : i + 1], p[i : i + 1]).floor
        assert alone.item() == together[i].item()


@pytest.mark.parametrize("k", [1, 20, 64, 256])
def test_head_is_the_exact_top_k(k: int) -> None:
    gen = seeded(k)
    rows = torch.softmax(torch.randn(5, 49152, generator=gen) * 2, -1)
    rows[3] = rows[3].round(decimals=6)  # many ties
    vals, ids = _head(rows, k)
    assert torch.equal(vals, rows.topk(k, dim=-1).values)
    assert torch.equal(rows.gather(1, ids), vals)
    assert all(len(set(r)) == k for r in ids.tolist())


def test_sample_sorted_skips_zeros() -> None:
    vals = torch.tensor([[0.5, 0.3, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]])
    ids = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    assert sample_sorted(vals, ids, torch.tensor([1.0 - 2**-53, 0.99], dtype=torch.float64)).tolist() == [11, 20]
    assert sample_sorted(vals, ids, torch.tensor([0.0, 0.0], dtype=torch.float64)).tolist() == [10, 20]
    assert sample_sorted(vals, ids, torch.tensor([0.7, 0.5], dtype=torch.float64)).tolist() == [11, 20]


def test_inverse_cdf_never_picks_zero_mass_and_respects_tiny_tokens() -> None:
    vocab = 49152
    probs = torch.zeros(4, vocab)
    probs[0, 123] = 1.0  # a single token
    probs[1, -1] = 1.0  # the very last token (u near 1 must not run off the end)
    probs[2, ::1000] = 1.0
    probs[3, 7] = 1.0
    probs[3, 40000] = 1e-12  # far below float32 resolution of the total: still has its own interval
    u = torch.tensor([0.5, 1.0 - 2**-53, 0.999999, 1.0 - 1e-13], dtype=torch.float64)
    got = inverse_cdf(probs, u).tolist()
    assert got[0] == 123 and got[1] == vocab - 1 and got[2] == 49000 and got[3] == 40000
    u0 = torch.zeros(4, dtype=torch.float64)
    assert inverse_cdf(probs, u0).tolist() == [123, vocab - 1, 0, 7]


# ---- seeds ------------------------------------------------------------------------------------------


def _run_seeded(
    sampler: Sampler, logit_rows: list[torch.Tensor], position: int, others: list[Seq], spec: Spec, seed: int
) -> list[int]:
    """Sample a seeded row over several steps, placed at ``position`` among ``others``."""
    target = Seq(params=spec, generator=seeded(seed))
    out = []
    gen = seeded(99 + position + len(others))  # the other rows' logits change with the batch
    for row in logit_rows:
        seqs = others[:position] + [target] + others[position:]
        logits = torch.randn(len(seqs), row.shape[0], generator=gen) * 2
        logits[position] = row
        tokens, _ = sampler.sample(logits, seqs)
        out.append(tokens[position])
        target.token_ids.append(tokens[position])
    return out


SEEDED_SPECS = {
    "top_k+top_p+min_p": Spec(temperature=0.9, top_p=0.95, top_k=200, min_p=0.01),
    "top_p alone": Spec(top_p=0.9),  # nuclei both inside and beyond the first head
    "temperature": Spec(temperature=1.2, presence_penalty=0.5),
    "large top_k": Spec(top_k=600, top_p=0.97),
}


@pytest.mark.parametrize("name", list(SEEDED_SPECS))
def test_seeded_row_is_independent_of_batch_position_and_sampler(name: str) -> None:
    spec = SEEDED_SPECS[name]
    vocab = 1024
    scales = [0.7, 4.0, 2.5, 6.0, 3.0]  # nuclei from a few tokens to most of the vocabulary
    rows = [torch.randn(vocab, generator=seeded(1000 + i)) * scales[i % 5] for i in range(25)]
    others = [
        Seq(params=GREEDY),
        Seq(params=Spec(top_k=200)),  # widens the shared head
        Seq(params=Spec(temperature=1.5, top_p=0.5), generator=seeded(5)),
        Seq(params=Spec(min_p=0.2, presence_penalty=1.0), token_ids=[1, 2, 3]),
        Seq(params=Spec(logprobs=3)),
        Seq(params=Spec(top_k=900)),
    ]
    alone = _run_seeded(Sampler(seed=1), rows, 0, [], spec, seed=42)
    assert len(set(alone)) > 10  # the distributions are wide enough for this to mean something
    assert _run_seeded(Sampler(seed=2), rows, 3, others, spec, seed=42) == alone
    assert _run_seeded(Sampler(seed=3), rows, 0, others[:2], spec, seed=42) == alone
    assert _run_seeded(Sampler(), rows, 6, others, spec, seed=42) == alone
    assert _run_seeded(Sampler(seed=1), rows, 0, [], spec, seed=43) != alone


def test_seeded_row_draws_exactly_one_uniform_per_sampled_step() -> None:
    gen, twin = seeded(77), seeded(77)
    sampler = Sampler(seed=0)
    logits = torch.randn(3, 50, generator=seeded(1))
    seqs = [Seq(params=Spec(top_k=10), generator=gen), Seq(), Seq(params=GREEDY, generator=seeded(1))]
    for _ in range(4):
        sampler.sample(logits.clone(), seqs)
    torch.rand(4, generator=twin, dtype=torch.float64)
    assert torch.rand(1, generator=gen).item() == torch.rand(1, generator=twin).item()


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.randn(16, 200, generator=seeded(4))
    seqs = [Seq() for _ in range(16)]
    a, _ = Sampler(seed=5).sample(logits.clone(), seqs)
    b, _ = Sampler(seed=5).sample(logits.clone(), seqs)
    c, _ = Sampler(seed=6).sample(logits.clone(), seqs)
    assert a == b and a != c


# ---- penalties and biases ---------------------------------------------------------------------------


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.linspace(-5, 5, 50).repeat(2, 1)
    # prompt [3, 40], output [40, 45, 45, 3]; token 25 is 0.1 (positive), token 3 negative.
    seq = Seq(token_ids=[3, 40, 40, 45, 45, 3], num_prompt_tokens=2, params=Spec(repetition_penalty=1.5))
    plain = Seq(token_ids=[3, 40], num_prompt_tokens=2)
    expected = logits.clone()
    for t in (3, 40, 45):
        v = expected[0, t]
        expected[0, t] = v * 1.5 if v < 0 else v / 1.5
    Sampler().process_logits(logits, [seq, plain])
    assert torch.equal(logits, expected)


def test_a_tiny_repetition_penalty_keeps_logits_finite() -> None:
    """r = 5e-324 is inside (0, 10]: a positive logit divided by it stays finite (it overflowed to inf,
    the log-softmax gave NaN, and the logprobs could not be sent as JSON)."""
    logits = torch.linspace(-5, 5, 50).repeat(1, 1)
    seq = Seq(token_ids=[3, 40, 45], num_prompt_tokens=3, params=Spec(repetition_penalty=5e-324))
    Sampler().process_logits(logits, [seq])
    assert torch.isfinite(logits).all()
    assert logits[0, 40] > 1e38 and logits[0, 3] <= 0  # r counts as float32's smallest normal number
    # 40 and 45 both grow past 1e38; 45 was the larger and stays so (the clamp keeps it at the maximum)
    assert torch.isfinite(logits.log_softmax(-1)).all() and int(logits.argmax()) == 45


@pytest.mark.parametrize("r", [5e-324, 1e-39, 1.3])
def test_repetition_penalty_never_revives_a_forbidden_token(r: float) -> None:
    """A token the structured output forbids (-inf) stays forbidden under any penalty: with r = 5e-324
    (0 in float32) -inf * r was NaN, argmax chose it, and the grammar refused the token (a 500, found
    by schemathesis)."""
    logits = torch.linspace(-5, 5, 50).repeat(1, 1)
    seq = Seq(
        token_ids=[3, 40, 45],
        num_prompt_tokens=3,
        params=Spec(temperature=0.0, repetition_penalty=r),
        grammar=BitMask({10, 45}),
    )
    x = logits.clone()
    Sampler().process_logits(x, [seq])
    assert not torch.isnan(x).any()
    assert x[0, 40] == float("-inf") and x[0, 3] == float("-inf")  # in the prompt, forbidden
    tokens, _ = Sampler().sample(logits.clone(), [seq])
    assert tokens[0] == 45  # allowed, in the prompt (penalised), still the larger of the two


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.randn(2, 50, generator=seeded(2))
    spec = Spec(presence_penalty=0.5, frequency_penalty=0.25)
    seq = Seq(token_ids=[7, 8, 9, 8, 8, 11, 7], num_prompt_tokens=3, params=spec)  # output: 8 x2, 11, 7
    other = Seq(token_ids=[8, 8, 8], num_prompt_tokens=1, params=Spec(frequency_penalty=-1.0))  # output 8 x2
    expected = logits.clone()
    expected[0, 8] -= 2 * 0.25 + 0.5
    expected[0, 11] -= 1 * 0.25 + 0.5
    expected[0, 7] -= 1 * 0.25 + 0.5
    expected[1, 8] -= 2 * -1.0
    Sampler().process_logits(logits, [seq, other])
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_processing_order_bias_min_tokens_repetition_then_presence() -> None:
    logits = torch.zeros(1, 20)
    logits[0, 4] = 1.0
    logits[0, 2] = 3.0
    spec = Spec(
        logit_bias={4: -3.0, 6: 2.0},  # 4 becomes negative before the repetition penalty sees it
        min_tokens=5,
        repetition_penalty=2.0,
        presence_penalty=1.0,
    )
    seq = Seq(token_ids=[4, 6, 4], num_prompt_tokens=2, params=spec, stop_token_ids_for_min_tokens=(2,))
    Sampler().process_logits(logits, [seq])
    expected = torch.zeros(1, 20)
    expected[0, 4] = (1.0 - 3.0) * 2.0 - 1.0  # bias, repetition (negative: multiply), presence (output)
    expected[0, 6] = 2.0 / 2.0  # bias, repetition (positive: divide); prompt only, no presence
    expected[0, 2] = float("-inf")  # stop token suppressed
    assert torch.equal(logits, expected)


def test_logit_bias_forces_a_token() -> None:
    logits = torch.randn(200, 50, generator=seeded(6)) * 3
    seqs = [Seq(params=Spec(temperature=1.0, logit_bias={13: 100.0})) for _ in range(100)]
    seqs += [Seq(params=Spec(temperature=0.0, logit_bias={13: 100.0, 14: -100.0})) for _ in range(100)]
    tokens, _ = Sampler(seed=0).sample(logits, seqs)
    assert tokens == [13] * 200


def test_min_tokens_suppresses_stop_tokens_until_reached() -> None:
    eos, stop = 2, 9
    sampler = Sampler(seed=0)
    spec = Spec(temperature=0.0, min_tokens=3)
    seq = Seq(token_ids=[1, 5], num_prompt_tokens=2, params=spec, stop_token_ids_for_min_tokens=(eos, stop))
    picked = []
    for step in range(5):
        logits = torch.zeros(1, 20)
        logits[0, eos] = 10.0
        logits[0, stop] = 9.0
        logits[0, 17] = 1.0
        tokens, _ = sampler.sample(logits, [seq])
        picked.append(tokens[0])
        seq.token_ids.append(17 if step < 3 else tokens[0])  # pretend the output grew by one
    assert picked == [17, 17, 17, eos, eos]
    # Sampled (non-greedy) rows too: eos holds nearly all the mass but never comes out.
    fresh = [Seq(token_ids=[1], params=Spec(min_tokens=1), stop_token_ids_for_min_tokens=(eos,)) for _ in range(300)]
    logits = torch.zeros(300, 20)
    logits[:, eos] = 15.0
    tokens, _ = sampler.sample(logits, fresh)
    assert eos not in tokens


def test_rows_without_processing_are_untouched() -> None:
    logits = torch.randn(3, 50, generator=seeded(9))
    before = logits.clone()
    seqs = [Seq(token_ids=[1, 2, 3], num_prompt_tokens=1), Seq(params=GREEDY), Seq(params=Spec(top_k=3))]
    Sampler().process_logits(logits, seqs)
    assert torch.equal(logits, before)


# ---- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_values_rank_and_top() -> None:
    vocab = 50
    logits = torch.randn(6, vocab, generator=seeded(10)) * 0.5  # flat: sampled tokens are often not rank 1
    specs = [
        Spec(temperature=0.0, logprobs=5),
        Spec(temperature=2.0, logprobs=3, presence_penalty=1.5),
        Spec(temperature=1.5, logprobs=0),
        Spec(temperature=1.5, logprobs=20, repetition_penalty=1.3),
        Spec(temperature=1.0),  # no logprobs
        Spec(temperature=1.7, logprobs=1, top_k=30),
    ]
    seqs = [Seq(token_ids=[1, 4, 4, 7], num_prompt_tokens=2, params=s) for s in specs]
    processed = logits.clone()
    Sampler().process_logits(processed, seqs)
    expected_lp = torch.log_softmax(processed, -1)  # after penalties, before temperature

    ranks_seen = set()
    sampler = Sampler(seed=0)
    for _ in range(20):
        tokens, lps = sampler.sample(logits.clone(), seqs)
        assert lps[4] is None
        for i, spec in enumerate(specs):
            if spec.logprobs is None:
                continue
            tl = lps[i]
            assert tl is not None and tl.token_id == tokens[i]
            row = expected_lp[i]
            assert tl.logprob == pytest.approx(row[tokens[i]].item(), abs=1e-5)
            assert tl.rank == int((row > row[tokens[i]]).sum()) + 1
            ranks_seen.add(tl.rank)
            assert len(tl.top) == spec.logprobs
            ids = [t for t, _ in tl.top]
            vals = [v for _, v in tl.top]
            assert vals == sorted(vals, reverse=True)
            assert ids == row.argsort(descending=True)[: spec.logprobs].tolist()
            assert vals == pytest.approx(row[ids].tolist(), abs=1e-5)
        assert lps[0].rank == 1
    assert max(ranks_seen) > 3  # sampled tokens below the top were checked too


# ---- speed (printed) --------------------------------------------------------------------------------


def _best_ms(fn, reps: int = 5) -> float:
    """The fastest of ``reps`` runs: the machine is shared, and the minimum is the least disturbed."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def test_speed_at_serving_size() -> None:
    """R=32, V=49152: each configuration gives valid tokens; its time is printed (``-s`` shows it)."""
    rows, vocab = 32, 49152
    gen = seeded(12)
    flat = torch.randn(rows, vocab, generator=gen) * 3  # wide nuclei: top-p needs the radix path
    peaked = flat.clone()  # a chat model's usual step: a few tokens hold most of the mass
    spikes = torch.randint(0, vocab, (rows, 20), generator=gen)
    peaked.scatter_add_(1, spikes, torch.rand(rows, 20, generator=gen) * 15 + 8)
    output = [int(t) for t in torch.randint(0, vocab, (200,), generator=seeded(13))]
    history = list(range(1, 300)) + output
    mixed_specs = [
        GREEDY,
        Spec(temperature=0.7, top_p=0.9, frequency_penalty=0.5),
        Spec(top_k=40, repetition_penalty=1.1, presence_penalty=0.3),
        Spec(temperature=1.0, min_p=0.05, logit_bias={5: 3.0}, logprobs=5),
    ]
    configs = {
        "all greedy": (flat, [Seq(params=GREEDY) for _ in range(rows)]),
        "all temperature 0.8": (flat, [Seq(params=Spec(temperature=0.8)) for _ in range(rows)]),
        "all top_p 0.9, peaked": (peaked, [Seq(params=Spec(top_p=0.9)) for _ in range(rows)]),
        "all top_p 0.9, flat": (flat, [Seq(params=Spec(top_p=0.9)) for _ in range(rows)]),
        "mixed with penalties (300+200 tokens), a third seeded": (
            peaked,
            [
                Seq(
                    token_ids=list(history),
                    num_prompt_tokens=300,
                    params=mixed_specs[i % 4],
                    generator=seeded(i) if i % 3 == 0 else None,
                )
                for i in range(rows)
            ],
        ),
    }
    sampler = Sampler(seed=0)
    buf = torch.empty(rows, vocab)
    report = []
    # One thread: on this shared 2-core machine a second OpenMP thread often waits out a whole
    # scheduler slice (~16 ms per parallel op), which would measure the neighbours, not the sampler.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (logits, seqs) in configs.items():
            tokens, _ = sampler.sample(logits.clone(), seqs)
            assert len(tokens) == rows and all(0 <= t < vocab for t in tokens)
            if name == "all greedy":
                assert tokens == logits.argmax(-1).tolist()
            ms = _best_ms(lambda: sampler.sample(buf.copy_(logits), seqs)) - _best_ms(lambda: buf.copy_(logits))
            report.append(f"{name}: {ms:.2f} ms")
    finally:
        torch.set_num_threads(threads)
    print("\nsampler, R=32 V=49152, 1 thread, best of 5: " + "; ".join(report))


def test_spec_helper_matches_the_contract() -> None:
    # The protocol fields this file's Spec stands in for must exist on the real SamplingParams.
    from servelm.scheduler.sampling_params import SamplingParams

    real = SamplingParams()
    for name in Spec.__dataclass_fields__:
        assert hasattr(real, name), name
    tokens, _ = Sampler(seed=0).sample(torch.randn(1, 50), [replace(Seq(), params=SamplingParams(temperature=0.0))])
    assert len(tokens) == 1


class BitMask:
    """A ``runtime.batch.TokenMask`` allowing a fixed set of tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_grammar_mask_leaves_only_allowed_tokens_and_other_rows_alone(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from servelm.runtime.cpu import ops as cpu_ops

    if path == "torch":
        monkeypatch.setattr(cpu_ops, "token_bitmask_kernel", lambda: None)
    elif cpu_ops.token_bitmask_kernel() is None:
        pytest.skip("the CPU ops extension is not available here")
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g)
    allowed = [{3, 31, 32, 999}, {0}, set(range(500, 1000, 7))]
    seqs = [
        Seq(params=GREEDY, grammar=BitMask(allowed[0])),
        Seq(params=GREEDY),
        Seq(params=Spec(), grammar=BitMask(allowed[1])),
        Seq(params=GREEDY, grammar=BitMask(allowed[2])),
    ]
    x = logits.clone()
    Sampler(seed=0).process_logits(x, seqs)
    assert torch.equal(x[1], logits[1])  # no grammar: untouched
    for row, ok in zip((0, 2, 3), allowed):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[list(ok)] = True
        assert torch.equal(x[row][keep], logits[row][keep])
        assert bool((x[row][~keep] == float("-inf")).all())
    tokens, _ = Sampler(seed=0).sample(logits.clone(), seqs)
    assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t].item())
    assert tokens[2] == 0  # sampled (temperature 1) from a single allowed token
    assert tokens[3] in allowed[2] and tokens[1] == int(logits[1].argmax())


def test_logit_bias_comes_from_tensors_built_once_per_request() -> None:
    """Every row's logit_bias is added in one op from tensors its parameters build on first use (the
    dict is not walked each step); ids outside the vocabulary (unvalidated options only) are ignored."""
    from servelm.scheduler.sampling_params import SamplingParams

    vocab = 1000
    logits = torch.randn(6, vocab, generator=seeded(14))
    biases = [{3: 1.5, 999: -100.0, 0: 100.0}, None, {i: float(i % 7) - 3 for i in range(0, vocab, 4)},
              {5: 2.0, vocab: 9.0, -1: 9.0}, {7: 0.25}, {}]  # fmt: skip
    seqs = [Seq(params=Spec(logit_bias=b)) for b in biases]
    expected = logits.clone()
    for i, b in enumerate(biases):
        for t, v in (b or {}).items():
            if 0 <= t < vocab:
                expected[i, t] += v
    x = logits.clone()
    Sampler().process_logits(x, seqs)
    assert torch.equal(x, expected)
    built = seqs[2].params.logit_bias_tensors
    Sampler().process_logits(logits.clone(), seqs)
    assert built is not None and seqs[2].params.logit_bias_tensors is built
    assert seqs[1].params.logit_bias_tensors is None and seqs[5].params.logit_bias_tensors is None

    real = SamplingParams(temperature=0.0, logit_bias={13: 100.0, 14: 50.0})
    assert Sampler().sample(logits[:1].clone(), [replace(Seq(), params=real)])[0] == [13]
