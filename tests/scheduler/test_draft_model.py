"""Speculative decoding with a draft model, through the engine on tiny random pairs of the same
vocabulary: greedy tokens equal the target's alone (and transformers') through batching, chunked
prefill, preemption and the prefix cache; the target itself as its draft keeps every draft, greedy
and sampled (which shows the draft's K/V bookkeeping and its distributions are the target's); who
speculates; the config and the start-up refusals; the metrics' counts."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sched_reference import assert_matches_reference, hf_greedy_references

from servelm.metrics.observer import StepStats
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams
from servelm.scheduler.speculative import DraftModelConfig, SpeculativeConfig, parse_speculative_config

MiB = 2**20
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _spec(draft: Path, k: int = 4, max_running: int = 8) -> str:
    return (
        f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": {k}, "max_running": {max_running}}}'
    )


def _engine(target: Path, spec: str | None, observer: Any = None, **cfg: Any) -> Engine:
    base: dict[str, Any] = dict(model=str(target), kv_cache_memory=4 * MiB, max_model_len=256, speculative_config=spec)
    return Engine(EngineConfig(**{**base, **cfg}), observer)


def _perturbed(src: Path, out: Path, noise: float) -> Path:
    """A copy of ``src`` with noise on its matrices: a draft that agrees with it about half the time."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name, w in weights.items():
        if w.ndim == 2 and "embed" not in name:
            weights[name] = w + noise * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def near_draft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _perturbed(tiny_llama_dir, tmp_path_factory.mktemp("near-draft"), 0.05)


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    from servelm.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    texts = ["1 2 3 4 5 6 7 8 9 10 " * 4, "Hello, my name is", "The capital of France", "def fib(n):\n    "]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_config_parses_vllms_draft_model_json() -> None:
    c = parse_speculative_config('{"method": "draft_model", "model": "/m/draft.gguf", "num_speculative_tokens": 5}')
    assert c == DraftModelConfig("/m/draft.gguf", 5, 1)  # drafts while one request runs: two already lose
    assert parse_speculative_config('{"model": "d", "disable_by_batch_size": 3}') == DraftModelConfig("d", 3, 2)
    assert isinstance(parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}'), SpeculativeConfig)
    for bad, words in [
        ('{"method": "draft_model"}', "needs 'model'"),
        ('{"method": "draft_model", "model": "d", "prompt_lookup_max": 3}', "not both"),
        ('{"method": "ngram", "model": "d"}', "not both"),
        ('{"method": "draft_model", "model": "d", "num_speculative_tokens": 0}', "at least 1"),
        ('{"method": "draft_model", "model": "d", "draft_tensor_parallel_size": 1}', "unknown keys"),
        ('{"method": "eagle", "model": "d"}', "only 'ngram' and 'draft_model'"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_speculative_config(bad)


def test_the_cli_takes_a_draft_model_and_refuses_a_broken_one() -> None:
    from servelm.server.cli import build_parser, engine_config_from_args

    spec = '{"method": "draft_model", "model": "/m/d.gguf", "num_speculative_tokens": 4}'
    assert (
        engine_config_from_args(build_parser().parse_args(["serve", "--speculative-config", spec])).speculative_config
        == spec
    )
    for bad in ('{"method": "draft_model"}', '{"method": "draft_model", "model": "d", "prompt_lookup_min": 1}'):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--speculative-config", bad])


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_num_batched_tokens=8),  # chunked prefill; the drafts share the step's small budget
        # 8 blocks of 16 for ~200 tokens of demand (the draft's pool takes half the budget): preemption.
        dict(kv_cache_memory=2 * 8 * 16 * 768, max_model_len=128, enable_prefix_caching=False),
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_greedy_tokens_equal_the_target_alone_and_transformers(
    tiny_llama_dir: Path, near_draft: Path, prompts: list[list[int]], cfg: dict
) -> None:
    refs = hf_greedy_references(tiny_llama_dir, prompts, GREEDY.max_tokens)
    e = _engine(tiny_llama_dir, _spec(near_draft), **cfg)
    together = e.generate(prompts, GREEDY)  # batched: every request speculates (max_running 8)
    alone = [e.generate([p], GREEDY)[0] for p in prompts]
    for i, ref in enumerate(refs):
        assert_matches_reference(together[i].outputs[0].token_ids, ref, f"{cfg} batched, prompt {i}")
        assert_matches_reference(alone[i].outputs[0].token_ids, ref, f"{cfg} alone, prompt {i}")
    assert e.drafts_verified > e.num_accepted_drafts > 20  # drafts kept, and others thrown away
    assert e.block_manager.num_used_blocks == 0
    if "max_model_len" in cfg:
        assert e.scheduler.num_preemptions_total > 0


def test_an_unrelated_draft_of_another_architecture(
    tiny_llama_dir: Path, tiny_model_dir: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """A random Qwen2 drafting for the Llama: nearly every draft is wrong, the tokens are still the target's."""
    plain = _engine(tiny_llama_dir, None).generate(prompts, GREEDY)
    e = _engine(tiny_llama_dir, _spec(tiny_model_dir("qwen2"), k=3))
    spec = e.generate(prompts, GREEDY)
    assert [r.outputs[0].token_ids for r in spec] == [r.outputs[0].token_ids for r in plain]
    assert e.drafts_verified > 100 and e.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "cfg",
    [dict(), dict(max_num_batched_tokens=8), dict(kv_cache_memory=2 * 8 * 16 * 768, max_model_len=128)],
    ids=["plain", "chunked", "preempted"],
)
def test_the_target_as_its_own_draft_keeps_every_draft(
    tiny_llama_dir: Path, prompts: list[list[int]], cfg: dict
) -> None:
    """The draft's K/V follows the target's block tables through acceptance, rejection (the last
    draft's position), preemption and prefix-cache hits: were any of it stale, drafts would differ."""
    e = _engine(tiny_llama_dir, _spec(tiny_llama_dir), **cfg)
    e.generate(prompts, GREEDY)
    e.generate(prompts[1:3], GREEDY)  # the same prompts again: prefix-cache hits (where it is on)
    assert e.num_accepted_drafts == e.drafts_verified > 100
    # Sampled: the draft's distributions are the target's, so every draft is kept (p = q) up to the
    # rounding of different batch shapes.
    before = e.drafts_verified, e.num_accepted_drafts
    sampled = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.9, top_k=40, ignore_eos=True)
    out = e.generate(prompts, sampled)
    verified, kept = e.drafts_verified - before[0], e.num_accepted_drafts - before[1]
    assert verified > 50 and kept >= 0.97 * verified
    assert all(len(r.outputs[0].token_ids) == 32 for r in out)
    assert e.block_manager.num_used_blocks == 0


def test_stops_and_logprobs_inside_the_drafts_end_as_plain_decoding(
    tiny_llama_dir: Path, near_draft: Path, prompts: list[list[int]]
) -> None:
    plain, spec = _engine(tiny_llama_dir, None), _engine(tiny_llama_dir, _spec(near_draft))
    free = plain.generate([prompts[1]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    for p in (
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[free.token_ids[25]]),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[free.text[len(free.text) // 2 :][:6]]),
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2),
    ):
        a, b = plain.generate([prompts[1]], p)[0], spec.generate([prompts[1]], p)[0]
        if p.prompt_logprobs:  # scored by the prefill, which the draft does not touch
            assert [(e.token_id, e.rank) for e in b.prompt_logprobs[1:]] == [
                (e.token_id, e.rank) for e in a.prompt_logprobs[1:]
            ]
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
            x.token_ids,
            x.text,
            x.finish_reason,
            x.stop_reason,
        )
        if p.logprobs:
            assert [(a.token_id, a.rank) for a in y.logprobs] == [(a.token_id, a.rank) for a in x.logprobs]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    assert spec.num_accepted_drafts > 0 and spec.block_manager.num_used_blocks == 0


def test_who_speculates(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    e = _engine(tiny_llama_dir, _spec(tiny_llama_dir, max_running=1))
    for p in (
        SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True),  # seeded: load-independent draws
        SamplingParams(max_tokens=20, temperature=0.8, logprobs=1, ignore_eos=True),  # the verification draws
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.1, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5, ignore_eos=True),
    ):
        e.generate([prompts[1]], p)
        assert e.drafts_verified == 0, p
    e.generate(prompts[:2], GREEDY)
    assert e.drafts_verified == 0  # two running, max_running 1
    e.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True))
    assert e.num_accepted_drafts > 0 and e.block_manager.num_used_blocks == 0


def test_metrics_count_drafts_per_position(tiny_llama_dir: Path, near_draft: Path, prompts: list[list[int]]) -> None:
    class Steps:
        def __init__(self) -> None:
            self.steps: list[StepStats] = []

        def on_step(self, s: StepStats) -> None:
            self.steps.append(s)

        def on_request_finished(self, s: Any) -> None:
            pass

        def on_request_rejected(self) -> None:
            pass

    obs = Steps()
    e = _engine(tiny_llama_dir, _spec(near_draft, k=3), observer=obs)
    e.generate(prompts, GREEDY)
    num_drafts = sum(s.num_drafts for s in obs.steps)
    per_pos = [sum(s.accepted_per_pos[j] for s in obs.steps if len(s.accepted_per_pos) > j) for j in range(3)]
    assert sum(s.num_draft_tokens for s in obs.steps) == e.drafts_verified
    assert sum(per_pos) == sum(s.num_accepted_draft_tokens for s in obs.steps) == e.num_accepted_drafts > 0
    assert num_drafts >= per_pos[0] >= per_pos[1] >= per_pos[2]  # a draft is kept only after those before it
    assert 3 * num_drafts >= e.drafts_verified > 2 * num_drafts  # three drafts each, fewer only near max_tokens
    assert sum(s.num_generation_tokens for s in obs.steps) == 4 * 32


def test_start_up_refuses_what_a_draft_cannot_serve(
    tiny_llama_dir: Path, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="vocabulary has 512 tokens"):
        _engine(tiny_llama_dir, _spec(tiny_model_dir("llama_small_vocab")))
    with pytest.raises(ValueError, match="not served with LoRA"):
        _engine(tiny_llama_dir, _spec(tiny_llama_dir), enable_lora=True)
    with pytest.raises(ValueError, match="sliding-window"):
        _engine(tiny_llama_dir, _spec(tiny_model_dir("mistral_window")))
    with pytest.raises((ValueError, FileNotFoundError)):
        _engine(tiny_llama_dir, _spec(tmp_path / "missing"))


def test_structured_outputs_mask_the_drafts_and_every_verified_position(
    tiny_llama_dir: Path, near_draft: Path, prompts: list[list[int]]
) -> None:
    """The draft proposes under the grammar and each verified position is masked by the grammar's state
    after the drafts before it: greedy tokens equal the target's alone, and the target drafting for
    itself keeps every draft, greedy and sampled, every output matching the structure."""
    import json
    import re

    from servelm.scheduler.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}  # fmt: skip
    regex = r"[a-z]{3,8}( [a-z]{3,8}){4,6}\."

    def params(kind: str, value: str, temperature: float = 0.0) -> SamplingParams:
        return SamplingParams(max_tokens=48, temperature=temperature, structured_output=StructuredOutput(kind, value))

    plain, near, itself = (_engine(tiny_llama_dir, s) for s in (None, _spec(near_draft), _spec(tiny_llama_dir)))
    for kind, value in (("json", json.dumps(schema)), ("regex", regex)):
        want = [r.outputs[0].token_ids for r in plain.generate(prompts, params(kind, value))]
        for e in (near, itself):
            assert [r.outputs[0].token_ids for r in e.generate(prompts, params(kind, value))] == want, kind
    assert near.drafts_verified > near.num_accepted_drafts > 0
    # Every draft kept but, at most, each request's last: the structure completes on it, and the request
    # ends before the row after it is read (and the draft proposes nothing past a complete structure).
    assert itself.drafts_verified - len(prompts) * 2 <= itself.num_accepted_drafts < itself.drafts_verified
    assert itself.drafts_verified > 100
    before = itself.drafts_verified, itself.num_accepted_drafts
    for r in itself.generate(prompts, params("regex", regex, temperature=1.0)):
        assert re.fullmatch(regex, r.outputs[0].text), r.outputs[0].text
    verified, kept = itself.drafts_verified - before[0], itself.num_accepted_drafts - before[1]
    assert verified > 20 and kept >= 0.97 * verified - len(prompts)
    assert near.block_manager.num_used_blocks == itself.block_manager.num_used_blocks == 0


@pytest.mark.slow  # 1,600 sampled requests through two engines: over 3 s (the rule itself is tested fast in tests/runtime/test_spec_sampling.py)
def test_sampled_tokens_are_distributed_as_the_targets_alone(
    tiny_llama_dir: Path, near_draft: Path, prompts: list[list[int]]
) -> None:
    """Through the whole engine, with a draft that often disagrees: the first two generated tokens (the
    second verified against one draft) are distributed as the target's alone (a two-sample chi-square)."""
    import math
    from collections import Counter

    n = 800
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    counts = []
    for spec in (None, _spec(near_draft, k=2, max_running=64)):
        e = _engine(tiny_llama_dir, spec, kv_cache_memory=32 * MiB)
        counts.append(Counter(tuple(r.outputs[0].token_ids[:2]) for r in e.generate([prompts[2]] * n, params)))
        verified, kept = e.drafts_verified, e.num_accepted_drafts
    a, b = counts
    cells = [c for c in set(a) | set(b) if a[c] + b[c] >= 10]
    rest = (sum(a.values()) - sum(a[c] for c in cells), sum(b.values()) - sum(b[c] for c in cells))
    chi2 = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells) + (rest[0] - rest[1]) ** 2 / max(1, sum(rest))
    df = len(cells)
    critical = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3  # upper tail ~1e-4
    assert chi2 < critical, (chi2, critical, sorted(a.items()), sorted(b.items()))
    assert verified > 0.9 * n and 0.1 * n < kept < 0.9 * n  # drafts kept, and others rejected
