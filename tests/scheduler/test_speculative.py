"""Speculative decoding by n-gram lookup: the drafts proposed, the config, and through the engine the
same tokens as plain greedy decoding (and transformers'), with drafts both kept and thrown away."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sched_reference import assert_matches_reference, hf_greedy_references

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams
from servelm.scheduler.speculative import NgramIndex, SpeculativeConfig

MiB = 2**20
# Up to 4 drafts from suffixes of 1-4 tokens, whatever the batch: the tiny random model repeats
# itself enough for drafts to be kept, and often enough not.
SPEC = '{"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4, "max_running": 8}'


def test_ngram_index_proposes_what_followed_the_longest_suffix_last_time() -> None:
    idx = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1]
    assert idx.propose(toks, 3) == []  # ... 7, 1: "1" never occurred before
    toks = [5, 6, 7, 8, 9, 5, 6, 7]
    assert NgramIndex(1, 3).propose(toks, 3) == [8, 9, 5]  # "5 6 7" occurred at 0: what followed it
    assert NgramIndex(1, 3).propose(toks, 1) == [8]
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 2], 2) == []  # only a 1-gram matches, and 1 < min
    assert NgramIndex(1, 3).propose([1, 2, 3, 4, 2], 2) == [3, 4]
    # The latest earlier occurrence wins; the index grows with the tokens.
    idx = NgramIndex(1, 2)
    toks = [1, 2, 1, 3, 1]
    assert idx.propose(toks, 1) == [3]
    toks += [4, 1]
    assert idx.propose(toks, 2) == [4, 1]
    # At the end of the tokens: fewer than k.
    assert NgramIndex(1, 1).propose([7, 8, 7], 5) == [8, 7]


def test_speculative_config_parses_vllm_json() -> None:
    c = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    )
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min, c.max_running) == (5, 3, 1, 1)
    assert SpeculativeConfig.parse('{"disable_by_batch_size": 4}').max_running == 3
    for bad, words in [
        ("{nope", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "model": "x"}', "only 'ngram'"),
        ('{"num_speculative_tokens": 0}', "at least 1"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"draft_tensor_parallel_size": 1}', "unknown keys"),
        ('{"num_speculative_tokens": "3"}', "integers"),
    ]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


def _engine(model_dir: Path, spec: str | None, **cfg: Any) -> Engine:
    base: dict[str, Any] = dict(
        model=str(model_dir), kv_cache_memory=4 * MiB, max_model_len=256, speculative_config=spec
    )
    return Engine(EngineConfig(**{**base, **cfg}))


def _drafts(e: Engine) -> tuple[int, int]:
    """(drafts verified, drafts kept) so far."""
    return e.drafts_verified, e.num_accepted_drafts


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    from servelm.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    texts = ["1 2 3 4 5 6 7 8 9 10 " * 4, "Hello, my name is", "The capital of France", "def fib(n):\n    "]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_num_batched_tokens=8),  # chunked prefill; drafts share the step's small budget
        # 8 blocks of 16 for ~200 tokens of demand: preemption (drafts' slots included).
        dict(kv_cache_memory=8 * 16 * 768, max_model_len=128, enable_prefix_caching=False),
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_greedy_tokens_equal_plain_decoding_and_transformers(
    tiny_llama_dir: Path, prompts: list[list[int]], cfg: dict
) -> None:
    refs = hf_greedy_references(tiny_llama_dir, prompts, 40)
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    e = _engine(tiny_llama_dir, SPEC, **cfg)
    together = e.generate(prompts, p)  # batched: every request speculates (max_running 8)
    alone = [e.generate([pr], p)[0] for pr in prompts]
    for i, ref in enumerate(refs):
        assert_matches_reference(together[i].outputs[0].token_ids, ref, f"{cfg} batched, prompt {i}")
        assert_matches_reference(alone[i].outputs[0].token_ids, ref, f"{cfg} alone, prompt {i}")
    verified, kept = _drafts(e)
    assert kept > 20 and verified > kept  # drafts were kept, and others thrown away
    assert e.block_manager.num_used_blocks == 0
    if "max_model_len" in cfg:
        assert e.scheduler.num_preemptions_total > 0


def test_stops_inside_the_drafts_end_as_plain_decoding_does(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    plain, spec = _engine(tiny_llama_dir, None), _engine(tiny_llama_dir, SPEC)
    free = plain.generate([prompts[1]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    # Stop on a token the answer reaches late, a stop string, and max_tokens: each may fall inside a
    # step's kept drafts.
    cases = [
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[free.token_ids[25]]),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[free.text[len(free.text) // 2 :][:6]]),
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2),
    ]
    for p in cases:
        (a,) = plain.generate([prompts[1]], p)
        (b,) = spec.generate([prompts[1]], p)
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
            x.token_ids,
            x.text,
            x.finish_reason,
            x.stop_reason,
        )
        if p.logprobs:
            assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in y.logprobs] == [
                (lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in x.logprobs
            ]
            assert max(abs(u.logprob - v.logprob) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4
    assert spec.num_accepted_drafts > 0 and spec.block_manager.num_used_blocks == 0


def test_who_speculates_and_when(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    e = _engine(tiny_llama_dir, '{"num_speculative_tokens": 4, "prompt_lookup_min": 1}')  # max_running 1
    for p in (
        SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True),  # seeded: load-independent draws
        SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.1, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.5, ignore_eos=True),
    ):
        e.generate([prompts[1]], p)
        assert _drafts(e) == (0, 0)
    e.generate(prompts[:2], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert _drafts(e) == (0, 0)  # two running: no drafts
    e.generate([prompts[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert _drafts(e)[1] > 0
    # Unseeded sampling speculates: each position is drawn as usual and a draft kept when it was drawn.
    before = _drafts(e)
    (r,) = e.generate([prompts[1]], SamplingParams(max_tokens=30, temperature=0.05, ignore_eos=True))
    assert len(r.outputs[0].token_ids) == 30 and _drafts(e)[1] > before[1] and e.block_manager.num_used_blocks == 0
    # Scheduling ahead: drafts would follow tokens still in flight, so none.
    e.async_scheduling = True
    before = _drafts(e)
    e.generate([prompts[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert _drafts(e) == before


def test_step_stats_count_drafts(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    class Steps:
        def __init__(self) -> None:
            self.steps: list[Any] = []

        def on_step(self, s: Any) -> None:
            self.steps.append(s)

        def on_request_finished(self, s: Any) -> None:
            pass

        def on_request_rejected(self) -> None:
            pass

    obs = Steps()
    e = Engine(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 * MiB, max_model_len=256, speculative_config=SPEC),
        observer=obs,
    )
    (_r,) = e.generate([prompts[1]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert sum(s.num_draft_tokens for s in obs.steps) == e.drafts_verified > 0
    assert sum(s.num_accepted_draft_tokens for s in obs.steps) == e.num_accepted_drafts > 0
    assert sum(s.num_generation_tokens for s in obs.steps) == 40
    # Fewer steps than tokens: kept drafts arrive with the step's own token.
    assert len([s for s in obs.steps if s.num_generation_tokens]) == 40 - e.num_accepted_drafts


@pytest.mark.slow  # an engine on the default model
def test_default_model_rewrite_keeps_drafts_and_tokens(default_model_dir: Path) -> None:
    """The default model (int4, as served) rewriting a text: most drafts kept, the same tokens."""
    text = (
        "The lighthouse stood on a rock at the edge of the bay. Every night its keeper climbed the one hundred "
        "and twelve steps, trimmed the wick, wound the clockwork and watched the beam sweep over the water."
    )
    ask = [
        {"role": "user", "content": f"Rewrite this text, changing 'keeper' to 'guardian' and nothing else:\n\n{text}"}
    ]
    outs = {}
    for spec in (None, '{"num_speculative_tokens": 3}'):
        e = Engine(
            EngineConfig(kv_cache_memory=64 * MiB, max_model_len=1024, quantization="auto", speculative_config=spec)
        )
        ids = list(e.tokenizer.apply_chat_template(ask, add_generation_prompt=True, tokenize=True)["input_ids"])
        (r,) = e.generate([ids], SamplingParams(max_tokens=80, temperature=0))
        outs[spec] = (r.outputs[0].token_ids, r.outputs[0].finish_reason)
        if spec:
            assert e.num_accepted_drafts > 0.5 * e.drafts_verified > 10
        assert e.block_manager.num_used_blocks == 0
    assert outs[None] == outs['{"num_speculative_tokens": 3}']
    assert "The lighthouse stood on a rock at the edge of the bay" in e.tokenizer.decode(
        outs[None][0]
    )  # (the 135M model copies more than it edits)


def test_drafting_backs_off_while_drafts_are_wrong() -> None:
    from servelm.scheduler.request import Request
    from servelm.scheduler.speculative import PROBE_EVERY, NgramProposer

    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    req = Request(0, "r", [1, 2, 3, 4, 5, 6, 1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    assert proposer.propose(req, 10) == [4, 5, 6]
    sizes = []
    for _ in range(12):  # every draft wrong
        proposer.observe(req, 0, 3)
        sizes.append(len(proposer.propose(req, 10)))
    assert sizes[:3] == [3, 1, 1]  # kept rate 1.0 -> 0.7 -> 0.49 -> 0.34: full, then one draft
    probing = sizes[3:]  # below 0.25: one draft every PROBE_EVERY steps
    assert set(probing) == {0, 1} and probing.count(1) == len(probing) // PROBE_EVERY
    for _ in range(6):  # drafts kept again
        proposer.observe(req, 1, 1)
    assert len(proposer.propose(req, 10)) == 3
