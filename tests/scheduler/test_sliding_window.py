"""Sliding-window attention through the whole engine: greedy tokens equal transformers' (whose
generation masks each step to the window) with chunked prefill, preemption and the prefix cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams
from sched_reference import GreedyReference, assert_matches_reference, hf_greedy_references

MiB = 2**20
MAX_NEW = 24
PROMPTS = [
    [5, 900, 17, 4000, 33, 2, 77, 1200, 8, 64, 19, 300, 41, 7, 4500, 12, 90, 3, 600, 28, 1000, 55, 6, 71, 18, 2000, 44, 11, 9],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333],
    [5, 900, 17, 4000, 33, 2, 77, 1200, 8, 64, 19, 300, 41, 7, 4500, 12, 90, 3, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 7},
    # 5 blocks of 16 tokens (768 bytes a token) for 3 sequences growing to 53, 36 and 57 tokens
    "preempted": {"kv_cache_memory": 768 * 16 * 5, "max_model_len": 64},
}


@pytest.fixture(scope="module", params=["mistral_window", "qwen2_window", "gemma3"])
def model(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> tuple[Path, list[GreedyReference]]:
    path = tiny_model_dir(request.param)
    return path, hf_greedy_references(path, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers_past_the_window(model: tuple[Path, list[GreedyReference]], case: str) -> None:
    path, refs = model
    cfg = {"kv_cache_memory": 2 * MiB, "max_model_len": 256, **CASES[case]}
    engine = Engine(EngineConfig(model=str(path), **cfg))
    assert engine.model_config.sliding_window == 16 and engine.max_model_len == cfg["max_model_len"]
    results = engine.generate(PROMPTS, GREEDY)
    for p, res in enumerate(results):
        assert_matches_reference(res.outputs[0].token_ids, refs[p], f"{case} prompt {p}")
    if case == "preempted":
        assert engine.scheduler.num_preemptions_total > 0
    # The same prompts again: served from the prefix cache, the same tokens.
    again = engine.generate(PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in results]
    assert engine.block_manager.prefix_cache_hits > 0
    assert engine.block_manager.num_used_blocks == 0
