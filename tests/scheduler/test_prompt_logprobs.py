"""Prompt logprobs (``echo`` + ``logprobs`` on /v1/completions) against Hugging Face's logits, through
chunked prefill, preemption, scheduling ahead, prefix caching and n > 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.runtime.batch import BatchItem
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams

MiB = 2**20
K = 3  # alternatives asked per prompt token


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    from servelm.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    # The long one first: it holds most of a small pool while the short ones squeeze in (preemption).
    texts = ["1 2 3 4 5 6 7 8 9 10 " * 4, "Hello, my name is", "The capital of France", "def fib(n):\n    "]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF's log-softmax over each prompt's positions, one forward per prompt: [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0].float().log_softmax(-1) for ids in prompts]


def engine(tiny_llama_dir: Path, **cfg: Any) -> Engine:
    base = dict(model=str(tiny_llama_dir), kv_cache_memory=4 * MiB, max_model_len=256)
    return Engine(EngineConfig(**{**base, **cfg}))


def assert_matches_hf(lps: list[Any] | None, ids: list[int], ref: torch.Tensor, what: str) -> None:
    """One entry per prompt token, the first None; each the token's logprob, rank and top-K of HF's row before it."""
    assert lps is not None and len(lps) == len(ids), what
    assert lps[0] is None
    for j in range(1, len(ids)):
        e, row = lps[j], ref[j - 1]
        assert e.token_id == ids[j]
        assert e.logprob == pytest.approx(row[ids[j]].item(), abs=1e-4), f"{what}: token {j}"
        lp = row[ids[j]]  # rank: 1 + the tokens above it, up to those within float noise of it
        assert int((row > lp + 1e-4).sum()) < e.rank <= int((row > lp - 1e-4).sum()) + 1, f"{what}: token {j}"
        top = row.topk(K)
        assert [t for t, _ in e.top] == top.indices.tolist(), f"{what}: token {j}"
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_num_batched_tokens=8),  # chunked prefill: each prompt scored over several steps
        # 8 blocks of 16 for ~200 tokens of demand: preemption (recomputed positions are not scored twice).
        dict(kv_cache_memory=8 * 16 * 768, max_model_len=128, enable_prefix_caching=False),
        dict(async_scheduling=True, max_num_batched_tokens=8),  # scores read one step late
    ],
    ids=["plain", "chunked", "preempted", "ahead"],
)
def test_prompt_logprobs_match_hf(
    tiny_llama_dir: Path, prompts: list[list[int]], hf_logprobs: list[torch.Tensor], cfg: dict[str, Any]
) -> None:
    e = engine(tiny_llama_dir, **cfg)
    res = e.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=K))
    for i, (r, ids, ref) in enumerate(zip(res, prompts, hf_logprobs)):
        assert_matches_hf(r.prompt_logprobs, ids, ref, f"{cfg} prompt {i}")
        assert len(r.outputs[0].token_ids) == 24
    assert e.block_manager.num_used_blocks == 0
    if "enable_prefix_caching" in cfg:
        assert e.scheduler.num_preemptions_total > 0


def test_outputs_carry_them_once_before_the_first_token(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    e = engine(tiny_llama_dir, max_num_batched_tokens=8)
    e.add_request("a", prompts[0], SamplingParams(max_tokens=3, temperature=0, n=2, prompt_logprobs=0))
    e.add_request("b", prompts[1], SamplingParams(max_tokens=3, temperature=0))
    seen: list[tuple[str, bool, int]] = []  # (request, carries prompt logprobs, tokens in it)
    while e.has_unfinished_requests():
        for o in e.step():
            seen.append((o.request_id, o.prompt_logprobs is not None, sum(len(c.new_token_ids) for c in o.outputs)))
            if o.prompt_logprobs is not None:
                assert len(o.prompt_logprobs) == len(prompts[0])
                assert all(x.top == [] for x in o.prompt_logprobs[1:])  # 0 alternatives asked
    a = [(has, n) for rid, has, n in seen if rid == "a"]
    assert [has for has, _ in a].count(True) == 1 and a[0][0], a  # with the request's first output
    assert a[0][1] > 0  # ... which already has tokens: none came before it
    assert not any(has for rid, has, _ in seen if rid == "b")


def test_prefix_cache_is_bypassed_only_while_the_prompt_is_unscored(
    tiny_llama_dir: Path, prompts: list[list[int]], hf_logprobs: list[torch.Tensor]
) -> None:
    e = engine(tiny_llama_dir)
    long = prompts[0]  # several full blocks
    plain = SamplingParams(max_tokens=2, temperature=0)
    e.generate([long], plain)
    hits = e.block_manager.prefix_cache_hits
    # Its blocks are cached, but scoring needs every position's logits: all recomputed, none adopted.
    r = e.generate([long], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K))[0]
    assert_matches_hf(r.prompt_logprobs, long, hf_logprobs[0], "after a cached run")
    assert e.block_manager.prefix_cache_hits == hits
    e.generate([long], plain)  # a request without prompt logprobs still hits
    assert e.block_manager.prefix_cache_hits > hits
    assert e.block_manager.num_used_blocks == 0


def test_prompt_logprobs_range_and_bad_score_ranges(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    e = engine(tiny_llama_dir)
    with pytest.raises(InvalidParameterError) as err:
        e.add_request("x", prompts[1], SamplingParams(max_tokens=2, prompt_logprobs=21))
    assert err.value.param == "prompt_logprobs"
    # The runner refuses a score range outside the chunk or past the prompt's last-but-one position.
    e.add_request("y", prompts[1], SamplingParams(max_tokens=2, prompt_logprobs=1))
    sched = e.scheduler.schedule()
    (item,) = sched.items
    assert item.score == (0, len(prompts[1]) - 1)
    n = item.num_new_tokens
    for bad in ((0, n), (1, 1), (-1, 2)):
        with pytest.raises(ValueError, match="cannot score"):
            e.runner.execute([BatchItem(item.seq, n, True, bad)])
