"""The real draft pair: Qwen2.5-Coder-1.5B-Instruct served with Qwen2.5-Coder-0.5B-Instruct drafting (both
Q4_K_M GGUF files, served as stored, in the default arithmetic): greedy tokens equal the 1.5B's alone,
token for token, and most drafts are kept on code."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

MiB = 2**20
ASKS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Add type hints to this function and nothing else:\n\ndef mean(xs):\n    return sum(xs) / len(xs)\n",
]


@pytest.fixture(scope="module")
def qwen15_gguf() -> Path:
    from servelm.runtime.model_fetch import QWEN15, ensure_file

    return ensure_file(QWEN15)


@pytest.mark.slow  # loads the real 1.5B and 0.5B GGUF files (1.6 GB) and decodes on both
def test_qwen_pair_greedy_equals_the_target_alone(qwen15_gguf: Path, qwen05_gguf: Path) -> None:
    results = {}
    spec = json.dumps({"method": "draft_model", "model": str(qwen05_gguf), "num_speculative_tokens": 4})
    for name, sc in (("alone", None), ("drafted", spec)):
        e = Engine(
            EngineConfig(model=str(qwen15_gguf), kv_cache_memory=256 * MiB, max_model_len=1024, speculative_config=sc)
        )
        ids = [
            list(e.tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True)["input_ids"])
            for a in ASKS
        ]  # fmt: skip
        greedy = SamplingParams(max_tokens=64, temperature=0)
        results[name] = [r.outputs[0].token_ids for r in e.generate(ids, greedy)]  # batched
        results[name] += [e.generate([i], greedy)[0].outputs[0].token_ids for i in ids]  # one at a time
        if sc:
            assert e.num_accepted_drafts > 0.5 * e.drafts_verified > 20, (e.num_accepted_drafts, e.drafts_verified)
            sampled = e.generate(ids[:1], SamplingParams(max_tokens=32, temperature=0.7, ignore_eos=True))
            assert len(sampled[0].outputs[0].token_ids) == 32
        assert e.block_manager.num_used_blocks == 0
        del e
        gc.collect()
    assert results["drafted"] == results["alone"]
