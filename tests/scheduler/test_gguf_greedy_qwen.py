"""A real-size chat model served as stored: Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file (mostly Q5_0 and
Q8_0 tensors, 24 layers, a 151,936-token vocabulary) in exact mode (``gguf_activations="float32"``)
gives transformers' greedy tokens from the same file (issue 41); in the default mode (llama.cpp's int8
arithmetic and float16 cache) its top-1 is transformers' at nearly every position of those sequences.

Six chat prompts, rendered by the file's own chat template, in English, French, German, Chinese, Spanish
and a coding request, run together in one engine with chunked prefill (64-token steps) and the shared
system prompt from the prefix cache. HF runs each prompt alone (batch 1) on the model transformers loads
from the GGUF file (dequantized to float32). A mismatch is excused only at a provable near-tie
(``sched_reference``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sched_reference import TEST_THREADS, assert_matches_reference, hf_greedy_references, torch_threads

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # Qwen2.5-Coder-0.5B's GGUF file against transformers

BLOCK = 16
KV_BLOCKS = 64  # every prompt and its answer at once: no preemption (test_gguf_greedy covers it)
PROMPTS: list[tuple[str, int]] = [  # (user message, new tokens): answers longer than that, so no EOS on the way
    ("Explain in two sentences why the sky is blue.", 40),
    ("Écris un court poème de quatre vers sur la mer.", 32),
    ("Was ist der Unterschied zwischen einer Liste und einem Tupel in Python?", 48),
    ("用三句话解释什么是递归，并举一个例子。", 40),
    ("Describe en tres frases cómo funciona una bicicleta.", 36),
    ("Write a Python function `is_palindrome(s: str) -> bool` that ignores case and punctuation.", 48),
]
MAX_NEW = max(n for _, n in PROMPTS)


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> Iterator[None]:
    with torch_threads(TEST_THREADS):
        yield


def chat_prompts(folder: Path) -> list[list[int]]:
    """Each message as the chat endpoint renders it: the file's template, with its default system prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        for m, _ in PROMPTS
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def test_qwen05_q4_k_m_file_exact_mode(qwen05_gguf: Path) -> None:
    from servelm.runtime.capacity import kv_bytes_per_token
    from servelm.runtime.config import ModelConfig
    from servelm.runtime.model_files import resolve_model_path

    folder = resolve_model_path(str(qwen05_gguf))
    ids = chat_prompts(folder)
    assert all(p[:20] == ids[0][:20] for p in ids)  # the system prompt: one full block shared by all

    start = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=str(qwen05_gguf),
            gguf_activations="float32",
            max_num_batched_tokens=64,  # the longer prompts are prefilled in two chunks
            enable_prefix_caching=True,
            max_model_len=256,
            kv_cache_memory=KV_BLOCKS * BLOCK * kv_bytes_per_token(ModelConfig.from_dir(folder), torch.float32),
            block_size=BLOCK,
        )
    )
    try:
        assert engine.runner.weights_as_stored
        assert engine.runner.gguf_activations == "float32"
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in PROMPTS]
        started = time.perf_counter()
        results = engine.generate(ids, params)
        ran = time.perf_counter()
        hits = engine.block_manager.prefix_cache_hits
        assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    finally:
        del engine
        gc.collect()

    refs = hf_greedy_references(qwen05_gguf.parent, ids, MAX_NEW, gguf_file=qwen05_gguf.name)
    hf_done = time.perf_counter()
    ties = 0
    for i, (r, ref, (message, n)) in enumerate(zip(results, refs, PROMPTS)):
        out = r.outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == n, (i, out.finish_reason, len(out.token_ids))
        cut = type(ref)(ref.tokens[:n], ref.top2_ids[:n], ref.top2_gap[:n])
        ties += assert_matches_reference(out.token_ids, cut, f"qwen05 prompt {i} {message[:30]!r}")
    assert ties <= 1, f"{ties} near-tie divergences"
    agree, positions, worst = default_mode_agreement(qwen05_gguf, ids, refs)
    assert agree >= 0.95 * positions, (
        f"int8 mode (the default) takes transformers' greedy token at {agree}/{positions} positions of its "
        f"sequences; where they differ, transformers' top-two gap is at most {worst:.3f}"
    )
    print(
        f"int8 mode agrees with transformers' top-1 at {agree}/{positions} positions (largest gap where not: {worst:.3f})"
    )
    print(
        f"{qwen05_gguf.name}: {len(ids)} prompts ({sum(map(len, ids))} tokens), {ties} near-tie(s), prefix-cache "
        f"hits {hits} tokens; engine start {started - start:.1f} s, generate {ran - started:.1f} s, "
        f"transformers load + greedy {hf_done - ran:.1f} s"
    )


def default_mode_agreement(path: Path, ids: list[list[int]], refs: list) -> tuple[int, int, float]:
    """The file with no flags runs llama.cpp's arithmetic (int8 activations, float16 KV); fed
    transformers' greedy sequences, at how many positions its own top-1 is transformers' token, and the
    largest top-two gap transformers had where it is not (so the figure says how close those calls were)."""
    engine = Engine(
        EngineConfig(model=str(path), max_model_len=256, kv_cache_memory=64 * 2**20, max_num_batched_tokens=64)
    )
    try:
        assert engine.runner.gguf_activations == "int8" and engine.runner.kv_dtype == torch.float16
        seqs = [p + ref.tokens[:n] for p, ref, (_, n) in zip(ids, refs, PROMPTS)]
        scored = engine.generate(seqs, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    finally:
        del engine
        gc.collect()
    agree = positions = 0
    worst = 0.0
    for p, ref, res, (_, n) in zip(ids, refs, scored, PROMPTS):
        for k in range(n):
            entry = res.prompt_logprobs[len(p) + k]  # the position before generated token k
            positions += 1
            if entry.rank == 1:
                agree += 1
            else:
                worst = max(worst, ref.top2_gap[k])
    return agree, positions, worst
