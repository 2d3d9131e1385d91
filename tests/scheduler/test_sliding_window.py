"""Sliding-window attention through the whole engine: greedy tokens equal transformers' (whose
generation masks each step to the window) with chunked prefill, preemption and the prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sched_reference import GreedyReference, assert_matches_reference, hf_greedy_references

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

MiB = 2**20
MAX_NEW = 24
PROMPTS = [
    [
        5,
        900,
        17,
        4000,
        33,
        2,
        77,
        1200,
        8,
        64,
        19,
        300,
        41,
        7,
        4500,
        12,
        90,
        3,
        600,
        28,
        1000,
        55,
        6,
        71,
        18,
        2000,
        44,
        11,
        9,
    ],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333],
    [
        5,
        900,
        17,
        4000,
        33,
        2,
        77,
        1200,
        8,
        64,
        19,
        300,
        41,
        7,
        4500,
        12,
        90,
        3,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
        9,
    ],
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


@pytest.mark.parametrize("case", ["plain", "chunked", "preempted"])
def test_blocks_every_window_left_are_handed_back_and_tokens_stay_exact(
    model: tuple[Path, list[GreedyReference]], case: str
) -> None:
    """Blocks of 4 tokens: a sequence leaves a block of its windowed layers every 4 tokens past the
    window. Released blocks are overwritten here with large values instead of zeros (pages of a tiny
    model's blocks are shared by several), so a kernel reading one, or a prefix hit or recomputation
    starting from one, changes the tokens."""
    path, refs = model
    cfg = {"kv_cache_memory": 2 * MiB, "max_model_len": 256, "block_size": 4, **CASES[case]}
    engine = Engine(EngineConfig(model=str(path), **cfg))
    pool, layers = engine.runner.kv_pool, engine.model_config.window_layers
    assert pool.releases_pages and engine.block_manager.windows is not None
    released: list[int] = []

    def poison(blocks: list[int], window_layers: tuple[int, ...]) -> None:
        assert tuple(window_layers) == layers
        released.extend(blocks)
        for layer in layers:
            pool.k_cache[layer][blocks] = 1e3
            pool.v_cache[layer][blocks] = -1e3

    pool.release = poison
    results = engine.generate(PROMPTS, GREEDY)
    for p, res in enumerate(results):
        assert_matches_reference(res.outputs[0].token_ids, refs[p], f"{case} prompt {p}")
    assert len(released) >= 6, released
    if case == "preempted":
        assert engine.scheduler.num_preemptions_total > 0
    # The same prompts again: hits cut back where a window reached a released block.
    hits = engine.block_manager.prefix_cache_hits
    again = engine.generate(PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in results]
    assert engine.block_manager.prefix_cache_hits > hits
    # A next turn (prompt, answer, more): its hit reaches the answer's last full block (its 35 computed
    # tokens: 8 blocks), whose window is whole; in 20 blocks, later prompts evicted most of it.
    turn = [PROMPTS[1] + list(results[1].outputs[0].token_ids) + [3, 14, 15]]  # 39 tokens
    ref = hf_greedy_references(path, turn, MAX_NEW)[0]
    hits = engine.block_manager.prefix_cache_hits
    assert_matches_reference(engine.generate(turn, GREEDY)[0].outputs[0].token_ids, ref, f"{case} next turn")
    assert engine.block_manager.prefix_cache_hits - hits == (8 if case == "preempted" else 32)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("swa_full", [False, True])
def test_swa_full_keeps_every_position(model: tuple[Path, list[GreedyReference]], swa_full: bool) -> None:
    """``--swa-full``: nothing is handed back, and a prefix shared by a later prompt hits where it ends.
    By default that prefix's window was handed back once prompt 0 went on past it: no hit the first
    time it is shared, a full one from then on."""
    path, refs = model
    engine = Engine(
        EngineConfig(model=str(path), kv_cache_memory=2 * MiB, max_model_len=256, block_size=4, swa_full=swa_full)
    )
    assert (engine.block_manager.windows is None) == swa_full
    first = engine.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    assert_matches_reference(first, refs[0], f"swa_full={swa_full} prompt 0")
    again = engine.generate([PROMPTS[2]], GREEDY)[0].outputs[0].token_ids  # shares 18 tokens with prompt 0
    assert_matches_reference(again, refs[2], f"swa_full={swa_full} prompt 2")
    assert engine.block_manager.prefix_cache_hits == (16 if swa_full else 0)
    # A third prompt with that prefix: prompt 2 kept the window before where it matched, so it hits.
    third = PROMPTS[0][:18] + [7, 70, 700]
    out = engine.generate([third], GREEDY)[0].outputs[0].token_ids
    assert_matches_reference(out, hf_greedy_references(path, [third], MAX_NEW)[0], f"swa_full={swa_full} third")
    assert engine.block_manager.prefix_cache_hits == (32 if swa_full else 16)


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_n_choices_share_the_prompt_past_the_window(
    model: tuple[Path, list[GreedyReference]], max_num_seqs: int
) -> None:
    """n = 2: the second choice forks the first one's prompt blocks (or, admitted after it finished,
    hits them in the prefix cache); the prompt's last window is kept whole for it, so it shares every
    full prompt block and still writes transformers' tokens."""
    path, refs = model
    engine = Engine(
        EngineConfig(
            model=str(path), kv_cache_memory=2 * MiB, max_model_len=256, block_size=4, max_num_seqs=max_num_seqs
        )
    )
    two = SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    (result,) = engine.generate([PROMPTS[0]], two)
    for choice in result.outputs:
        assert_matches_reference(choice.token_ids, refs[0], f"max_num_seqs={max_num_seqs} choice {choice.index}")
    assert engine.block_manager.windows is not None and engine.block_manager.num_used_blocks == 0
    if max_num_seqs == 1:  # the first choice went 24 tokens past its 29-token prompt before the second began
        assert engine.block_manager.prefix_cache_hits == 28
