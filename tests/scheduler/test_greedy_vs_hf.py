"""The key acceptance test: the engine's greedy tokens equal Hugging Face's, on the default model in float32,
with every scheduling feature on or off, and scheduling ahead (one batch of 8 chat prompts x 64 tokens, ignore_eos).

HF runs each prompt alone (batch 1); the engine runs them together. A mismatch is excused only at a
provable near-tie (HF's top-two logit gap < 1e-3 at the first diverging step and we chose the runner-up).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sched_reference import TEST_THREADS, GreedyReference, assert_matches_reference, hf_greedy_references, torch_threads

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the default model against transformers

MAX_NEW = 64
MiB = 2**20
KV_TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32

LONG_SYSTEM = (
    "You are a meticulous technical assistant working for a small engineering team. "
    "Always answer in plain English, keep answers short, and prefer concrete examples over theory. "
    "When a question is about code, show a minimal snippet and explain it in one or two sentences. "
    "When a question is about science, state the key fact first, then one supporting detail. "
    "Never invent references. If you are unsure, say so and suggest how to check. "
    "The team works mostly with Python, Linux servers, and small language models running on CPUs, "
    "so examples that fit that setting are preferred. Measurements matter more than opinions: when "
    "someone asks which option is faster, explain how to measure it. Keep a friendly, calm tone, "
    "avoid jargon when a simple word will do, and do not repeat the question back to the user. "
    "Format lists with dashes, and keep every answer under one hundred words unless asked otherwise. "
    "If a user pastes an error message, first name the most likely cause, then the quickest fix, and "
    "only then any background. If a user asks for a comparison, use a short table with at most three "
    "rows. When numbers are involved, include units and round sensibly. When discussing performance, "
    "remember that the machines have two cores, no GPU, and about twenty gigabytes of memory, so advice "
    "about large clusters is not useful here. Prefer standard library solutions to new dependencies."
)
QUESTIONS_LONG = [
    "How do I read a file line by line in Python?",
    "Why is the sky blue?",
    "What does the Linux command `top` show?",
    "How can I tell if my program is limited by memory bandwidth?",
]
QUESTIONS_SHORT = ["What is the capital of France?", "Hi!", "Write a haiku about autumn.", "What is 12 times 7?"]


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> Iterator[None]:
    with torch_threads(TEST_THREADS):
        yield


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    """8 prompts, long (a ~300-token shared system prompt) and short ones interleaved."""
    prompts = []
    for long_q, short_q in zip(QUESTIONS_LONG, QUESTIONS_SHORT):
        for msgs in (
            [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": long_q}],
            [{"role": "user", "content": short_q}],
        ):
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


@pytest.fixture(scope="session")
def default_prompts(default_model_dir: Path) -> list[list[int]]:
    from servelm.runtime.tokenizer import load_tokenizer

    return chat_prompts(load_tokenizer(default_model_dir))


@pytest.fixture(scope="session")
def hf_refs(default_model_dir: Path, default_prompts: list[list[int]]) -> list[GreedyReference]:
    with torch_threads(TEST_THREADS):
        return hf_greedy_references(default_model_dir, default_prompts, MAX_NEW)


def run_engine(model_dir: Path, prompts: list[list[int]], runs: int = 1, **overrides: Any) -> tuple[Engine, list]:
    cfg = dict(model=str(model_dir), kv_cache_memory=128 * MiB, max_model_len=1024, enable_prefix_caching=False)
    cfg.update(overrides)
    engine = Engine(EngineConfig(**cfg))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = [engine.generate(prompts, params) for _ in range(runs)]
    return engine, results


def check(results: list, refs: list[GreedyReference], label: str) -> None:
    ties = 0
    for run, res in enumerate(results):
        assert len(res) == len(refs)
        for i, (r, ref) in enumerate(zip(res, refs)):
            out = r.outputs[0]
            assert out.finish_reason == "length" and len(out.token_ids) == MAX_NEW
            ties += assert_matches_reference(out.token_ids, ref, f"{label} run {run} prompt {i}")
    # A near-tie may excuse a prompt, never most of them.
    assert ties <= 1, f"{label}: {ties} near-tie divergences"


def finish(engine: Engine) -> None:
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    del engine
    gc.collect()


def test_prompts_have_the_intended_shape(default_prompts: list[list[int]]) -> None:
    lens = [len(p) for p in default_prompts]
    assert min(lens) < 40 and max(lens) > 280
    # The long ones share their system prompt: a common prefix of many full blocks.
    a, b = default_prompts[0], default_prompts[2]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > 200


def test_batched_greedy_equals_hf(default_model_dir: Path, default_prompts, hf_refs) -> None:
    engine, results = run_engine(default_model_dir, default_prompts)
    check(results, hf_refs, "plain")
    finish(engine)


def test_prefix_caching(default_model_dir: Path, default_prompts, hf_refs) -> None:
    engine, results = run_engine(default_model_dir, default_prompts, runs=1, enable_prefix_caching=True)
    # Later long prompts reuse the shared system prompt of the first one within the same batch.
    first_hits = engine.block_manager.prefix_cache_hits
    assert first_hits > 200
    results += [engine.generate(default_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))]
    # The second run finds every prompt cached (all full blocks but the one holding the last token).
    assert engine.block_manager.prefix_cache_hits - first_hits >= sum((len(p) - 1) // 16 * 16 for p in default_prompts)
    check(results, hf_refs, "prefix-cache")
    finish(engine)


def test_chunked_prefill(default_model_dir: Path, default_prompts, hf_refs) -> None:
    engine, results = run_engine(default_model_dir, default_prompts, max_num_batched_tokens=16)
    check(results, hf_refs, "chunked-16")
    finish(engine)


def test_preemption(default_model_dir: Path, default_prompts, hf_refs) -> None:
    # 40 blocks (640 tokens) for ~1,900 tokens of demand.
    engine, results = run_engine(
        default_model_dir, default_prompts, kv_cache_memory=40 * 16 * KV_TOKEN_BYTES, max_model_len=512
    )
    assert engine.capacity.num_blocks == 40
    assert engine.scheduler.num_preemptions_total > 0
    check(results, hf_refs, "preemption")
    finish(engine)


def test_static_policy(default_model_dir: Path, default_prompts, hf_refs) -> None:
    engine, results = run_engine(default_model_dir, default_prompts, scheduling_policy="static", max_num_seqs=8)
    check(results, hf_refs, "static")
    finish(engine)


def test_async_scheduling_with_every_feature(default_model_dir: Path, default_prompts, hf_refs) -> None:
    """Scheduling ahead (pending tokens read from the device) under prefix caching, 64-token chunks
    and preemption at once, run twice (the second run hits the cache)."""
    engine, results = run_engine(
        default_model_dir,
        default_prompts,
        runs=2,
        async_scheduling=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        kv_cache_memory=48 * 16 * KV_TOKEN_BYTES,
        max_model_len=512,
    )
    assert engine.scheduler.num_preemptions_total > 0 and engine.block_manager.prefix_cache_hits > 200
    check(results, hf_refs, "async-scheduling")
    finish(engine)


@pytest.mark.parametrize("kv_dtype", ["float16"])
def test_16_bit_kv_cache(default_model_dir: Path, default_prompts, hf_refs, kv_dtype: str) -> None:
    """``--kv-cache-dtype``: half the bytes per token. A float16 cache (llama.cpp's default) still gives
    transformers' float32 greedy tokens here, through chunks, the prefix cache and preemption. (bfloat16
    keeps 8 bits of mantissa and drifts on some prompts: add it here to see where; the kernel tests
    cover both.)"""
    engine, runs = run_engine(default_model_dir, default_prompts, kv_cache_dtype=kv_dtype, kv_cache_memory=64 * MiB)
    assert engine.runner.kv_pool.dtype == getattr(torch, kv_dtype)
    assert engine.capacity.kv_bytes_per_token == KV_TOKEN_BYTES // 2
    assert engine.capacity.num_blocks == 128 * MiB // (KV_TOKEN_BYTES * 16)  # what 128 MiB of float32 holds
    finish(engine)
    engine, more = run_engine(
        default_model_dir,
        default_prompts,
        runs=2,
        kv_cache_dtype=kv_dtype,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
        kv_cache_memory=40 * 16 * KV_TOKEN_BYTES // 2,
        max_model_len=512,
    )
    assert engine.scheduler.num_preemptions_total > 0 and engine.block_manager.prefix_cache_hits > 200
    finish(engine)
    for label, run in zip(("whole prompts", "chunks + preemption", "prefix cache"), runs + more):
        same = [
            next((i for i, (a, b) in enumerate(zip(r.outputs[0].token_ids, ref.tokens)) if a != b), MAX_NEW)
            for r, ref in zip(run, hf_refs)
        ]
        print(f"{kv_dtype} KV cache, {label}: equal to float32 transformers' tokens up to {same} of {MAX_NEW}")
        assert sum(n == MAX_NEW for n in same) >= len(same) // 2, same
    if kv_dtype == "float16":
        check(runs + more, hf_refs, "float16 KV cache")
