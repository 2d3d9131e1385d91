"""The sampler at the edges of what a request may ask: probabilities stay finite, tokens stay valid and
allowed, and a row whose sampling raises fails alone (``Sampler.sample_rows`` with ``reload``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sampler import BitMask, Seq

from servelm.runtime.batch import SamplingOptions
from servelm.runtime.sampler import GREEDY_TEMPERATURE, Sampler, tempered_softmax
from servelm.runtime.truncation import _radix_floor, truncate

Spec = SamplingOptions
FLOAT32_MAX = torch.finfo(torch.float32).max
NEG_INF = float("-inf")


def _processed(logits: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
    x = logits.clone()
    Sampler().process_logits(x, seqs)
    return x


# ---- the request that killed the engine ---------------------------------------------------------


def _hi_hi_hi(vocab: int = 49152) -> tuple[torch.Tensor, list[int]]:
    """A row where the prompt's tokens 5 and 7 have logits > 3.4 (r = 1e-38 pushes both to float32's
    largest value), token 9 a smaller positive one, token 11 a negative one."""
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 2
    logits[0, 5], logits[0, 7], logits[0, 9], logits[0, 11] = 12.0, 10.0, 2.0, -3.0
    return logits, [5, 7, 9, 11, 5]


@pytest.mark.parametrize(
    "spec",
    [Spec(temperature=0.9, top_p=0.95, repetition_penalty=1e-38), Spec(temperature=0.5, repetition_penalty=1e-38),
     Spec(temperature=1e-5, top_k=50, min_p=0.1, repetition_penalty=1e-38), Spec(temperature=2.0, repetition_penalty=5e-324)],
    ids=["T0.9-top_p", "T0.5", "T1e-5-top_k-min_p", "T2"],
)  # fmt: skip
def test_a_tiny_repetition_penalty_samples_the_penalised_maximum(spec: Spec) -> None:
    """The issue's request: r = 1e-38 lifts prompt tokens to float32's largest logit; a temperature below
    1 overflowed it to inf, the softmax gave NaN, and top-p raised (the engine died) or the draw fell
    off the end (the last token of the vocabulary, every step). The limit distribution is uniform over
    the row's maxima after the penalty."""
    logits, prompt = _hi_hi_hi()
    seq = Seq(token_ids=prompt, num_prompt_tokens=len(prompt), params=spec)
    x = _processed(logits, [seq])
    maxima = set(torch.nonzero(x[0] == x[0].max()).flatten().tolist())
    assert maxima == {5, 7}

    probs = tempered_softmax(x.clone(), [spec])
    assert torch.isfinite(probs).all()
    assert probs[0, [5, 7]].sum().item() == pytest.approx(1.0)

    rows = 400
    tokens, _ = Sampler(seed=0).sample(logits.repeat(rows, 1), [seq] * rows)
    assert set(tokens) <= maxima
    assert set(tokens) == maxima  # a tie is a tie: both come out


def test_the_penalised_maximum_wins_when_it_is_alone() -> None:
    """Penalised values that stay apart keep their order: 3.0 / 1e-38 beats 2.0 / 1e-38 at T = 0.5."""
    logits = torch.zeros(1, 1000)
    logits[0, 3], logits[0, 4] = 3.0, 2.0
    spec = Spec(temperature=0.5, repetition_penalty=1e-38)
    seq = Seq(token_ids=[3, 4], num_prompt_tokens=2, params=spec)
    probs = tempered_softmax(_processed(logits, [seq]), [spec])
    assert probs[0, 3].item() == 1.0 and torch.isfinite(probs).all()
    tokens, _ = Sampler(seed=0).sample(logits.repeat(50, 1), [seq] * 50)
    assert tokens == [3] * 50


def test_ordinary_rows_are_tempered_as_before() -> None:
    """The guard costs ordinary rows nothing and changes none of their bits: softmax(x / T)."""
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)) * 4
    specs = [
        Spec(temperature=0.7),
        Spec(temperature=1.0),
        Spec(temperature=1.7, repetition_penalty=0.5),
        Spec(temperature=0.3, repetition_penalty=0.9),
    ]
    temps = torch.tensor([[s.temperature] for s in specs])
    assert torch.equal(tempered_softmax(x.clone(), specs), (x / temps).softmax(-1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_yields_to_a_structured_output_that_must_end(temperature: float) -> None:
    """The grammar allows only the end (EOS) while min_tokens forbids it: every token was -inf, the
    softmax NaN. The structured output wins: the row ends."""
    eos = 2
    spec = Spec(temperature=temperature, min_tokens=5)
    seq = Seq(token_ids=[1, 8], num_prompt_tokens=1, params=spec, stop_token_ids_for_min_tokens=(eos, 9),
              grammar=BitMask({eos}))  # fmt: skip
    free = Seq(token_ids=[1, 8], num_prompt_tokens=1, params=spec, stop_token_ids_for_min_tokens=(eos, 9),
               grammar=BitMask({eos, 17}))  # fmt: skip
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2))
    x = _processed(logits, [seq, free])
    assert x[0, eos] == logits[0, eos] and x[1, eos] == NEG_INF  # suppressed only where 17 remains
    for _ in range(20):
        tokens, _ = Sampler().sample(logits.clone(), [seq, free])
        assert tokens == [eos, 17]


def test_min_tokens_never_forbids_the_whole_vocabulary() -> None:
    vocab = 40
    seq = Seq(token_ids=[1], params=Spec(min_tokens=3), stop_token_ids_for_min_tokens=tuple(range(vocab)))
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_processed(logits, [seq]), logits)


def test_radix_floor_is_robust_to_rows_it_should_never_see() -> None:
    """NaN gave bucket -8 and ``scatter_add_`` raised; an all-zero row found an empty bucket."""
    rows = torch.tensor(
        [[float("nan"), 0.5, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0], [float("inf"), -1.0, 0.3, 0.1], [-0.0, 0.25, 0.25, 0.5]]
    )
    for weighted, target in ((True, torch.full((4,), 0.9)), (False, torch.full((4,), 2.0))):
        floor = _radix_floor(rows, target, weighted=weighted)
        assert floor.shape == (4,) and floor[3].item() == 0.25


# ---- fuzz: every accepted range -------------------------------------------------------------------

LOGIT_KINDS = ["normal", "flat", "peaked", "huge", "tiny", "ties", "neg_inf", "extremes"]


def _logit_row(kind: str, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(vocab, generator=g) * 3
    if kind == "flat":
        return torch.randn(vocab, generator=g) * 0.01
    if kind == "peaked":
        row = torch.randn(vocab, generator=g)
        row[torch.randint(0, vocab, (5,), generator=g)] += 25.0
        return row
    if kind == "huge":  # as large as a model's logits are assumed to get (runtime.sampler.LOGIT_RANGE)
        return (torch.randn(vocab, generator=g) * 5e29).clamp(-1e30, 1e30)
    if kind == "tiny":
        return torch.randn(vocab, generator=g) * 1e-40  # subnormal
    if kind == "ties":
        return torch.randint(0, 3, (vocab,), generator=g).float()
    if kind == "neg_inf":  # a model that rules out all but a few tokens
        row = torch.full((vocab,), NEG_INF)
        keep = torch.randint(0, vocab, (4,), generator=g)
        row[keep] = torch.randn(4, generator=g)
        return row
    values = torch.tensor([-1e30, 1e30, 0.0, 1.0, -1.0, NEG_INF])
    row = values[torch.randint(0, len(values), (vocab,), generator=g)]
    row[torch.randint(0, vocab, (1,), generator=g)] = 1e30
    return row


def _either(special: list[Any], general: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(special), general)


@st.composite
def _row(draw: st.DrawFn, vocab: int) -> tuple[Seq, torch.Tensor, set[int] | None]:
    tok = st.integers(0, vocab - 1)
    spec = Spec(
        temperature=draw(_either([0.0, GREEDY_TEMPERATURE, 1e-4, 0.5, 1.0, 2.0], st.floats(GREEDY_TEMPERATURE, 2.0))),
        top_p=draw(_either([1.0, 0.95, 1e-9], st.floats(1e-9, 1.0))),
        top_k=draw(_either([-1, 0, 1, 2, 50], st.integers(1, vocab + 5))),
        min_p=draw(_either([0.0, 0.05, 1.0], st.floats(0.0, 1.0))),
        repetition_penalty=draw(_either([1.0, 5e-324, 1e-45, 1e-38, 1e-10, 0.5, 10.0], st.floats(5e-324, 10.0))),
        presence_penalty=draw(_either([0.0, -2.0, 2.0], st.floats(-2.0, 2.0))),
        frequency_penalty=draw(_either([0.0, -2.0, 2.0], st.floats(-2.0, 2.0))),
        logit_bias=draw(
            st.none() | st.dictionaries(tok, _either([-100.0, 100.0], st.floats(-100.0, 100.0)), max_size=6)
        ),
        min_tokens=draw(st.integers(0, 3)),
        logprobs=draw(st.none() | st.integers(0, 20)),
    )
    prompt = draw(st.lists(tok, min_size=1, max_size=6))
    output = draw(st.lists(tok, max_size=4))
    stops = tuple(range(vocab)) if draw(st.booleans()) and vocab < 100 else tuple(draw(st.lists(tok, max_size=3)))
    allowed: set[int] | None = draw(st.none() | st.sets(tok, min_size=1, max_size=8) | st.just(set(stops[:3]) or {0}))
    seq = Seq(
        token_ids=prompt + output,
        num_prompt_tokens=len(prompt),
        params=spec,
        generator=torch.Generator().manual_seed(draw(st.integers(0, 99))) if draw(st.booleans()) else None,
        stop_token_ids_for_min_tokens=stops,
        grammar=BitMask(allowed) if allowed is not None else None,
    )
    return seq, _logit_row(draw(st.sampled_from(LOGIT_KINDS)), vocab, draw(st.integers(0, 2**16))), allowed


@st.composite
def _batch(draw: st.DrawFn) -> tuple[list[Seq], torch.Tensor, list[set[int] | None]]:
    vocab = draw(st.sampled_from([37, 64, 1000, 2048]))
    rows = draw(st.lists(_row(vocab), min_size=1, max_size=5))
    return [r[0] for r in rows], torch.stack([r[1] for r in rows]), [r[2] for r in rows]


@settings(max_examples=250, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batch())
def test_fuzz_probabilities_stay_finite_and_tokens_allowed(
    batch: tuple[list[Seq], torch.Tensor, list[set[int] | None]],
) -> None:
    seqs, logits, allowed = batch
    _n, vocab = logits.shape
    params = [s.params for s in seqs]

    x = _processed(logits, seqs)
    assert not torch.isnan(x).any() and not (x == float("inf")).any()
    live = torch.isfinite(x)  # a row without a live token is the model's doing (its -inf), not a parameter's
    for i, ok in enumerate(allowed):
        if ok is not None:
            assert all(t in ok for t in torch.nonzero(live[i]).flatten().tolist())

    hot = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE and bool(live[i].any())]
    if hot:
        probs = tempered_softmax(x[hot].clone(), [params[i] for i in hot])
        assert torch.isfinite(probs).all()
        assert torch.allclose(probs.sum(-1, dtype=torch.float64), torch.ones(len(hot), dtype=torch.float64), atol=1e-4)
        assert bool((probs[~live[hot]] == 0).all())
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in (params[i] for i in hot)])
        top_p = torch.tensor([params[i].top_p for i in hot])
        floor = truncate(probs, top_k, top_p).floor
        assert torch.isfinite(floor).all() and bool((floor <= probs.amax(-1)).all())

    tokens, lps = Sampler(seed=0).sample(logits.clone(), seqs)
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        assert 0 <= t < vocab
        if not bool(live[i].any()):
            continue
        assert live[i, t], (i, t)  # allowed by the mask, not suppressed, not ruled out by the model
        if params[i].temperature < GREEDY_TEMPERATURE:
            assert t == int(x[i].argmax())
        if lp is not None:
            assert lp.token_id == t and math.isfinite(lp.logprob) and lp.logprob <= 0.0


# ---- one row's failure is that row's ----------------------------------------------------------------


class BrokenMask(BitMask):
    """A structured-output state that fails (the matcher raising) when asked for its mask."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise RuntimeError("matcher broke")


def test_a_row_that_raises_fails_alone_and_the_others_keep_their_draws() -> None:
    vocab = 1000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4)) * 3
    history = [3, 4, 5, 4]

    def seqs(bad: bool) -> list[Seq]:
        return [
            Seq(params=Spec(temperature=0.0, logprobs=3, logit_bias={7: 5.0})),
            Seq(params=Spec(temperature=0.9, top_p=0.9), generator=torch.Generator().manual_seed(11)),
            Seq(
                token_ids=list(history),
                params=Spec(temperature=0.7),
                grammar=BrokenMask({1}) if bad else BitMask({1, 2}),
            ),
            Seq(token_ids=list(history), params=Spec(temperature=1.2, top_k=40, logprobs=2, repetition_penalty=1.3)),
            Seq(params=Spec(temperature=0.6, min_p=0.1)),
        ]

    want = Sampler(seed=9).sample_rows(logits.clone(), seqs(bad=False))
    with pytest.raises(RuntimeError, match="matcher broke"):
        Sampler(seed=9).sample_rows(logits.clone(), seqs(bad=True))

    raw = logits.clone()
    got = Sampler(seed=9).sample_rows(logits.clone(), seqs(bad=True), reload=lambda: raw.clone())
    assert list(got.errors) == [2] and "matcher broke" in str(got.errors[2])
    want_tokens, want_lps = want.resolve()
    tokens, lps = got.resolve()
    for i in (0, 1, 3, 4):
        assert tokens[i] == want_tokens[i] and lps[i] == want_lps[i], i
    assert lps[2] is None
