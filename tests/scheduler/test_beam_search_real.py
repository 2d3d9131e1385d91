"""Beam search equals transformers' on real models, widths 1, 2 and 4: the default model (SmolLM2-135M-Instruct,
served as the greedy comparison serves it: its exact int4 by default, against transformers in float32) and
Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file in exact mode (``gguf_activations="float32"``) against the model
transformers loads from that file, dequantized to float32. Chat prompts whose answers end within max_tokens, so
beams finish on EOS as well as by length; all widths of one model run batched together in one engine."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from beam_reference import assert_beams_equal, hf_beam_search
from sched_reference import TEST_THREADS, fast_gguf_reader, torch_threads

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # real models against transformers

WIDTHS = (1, 2, 4)
QUESTIONS = ["What is the capital of France?", "Name a primary color."]
MAX_NEW = 20


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> Iterator[None]:
    with torch_threads(TEST_THREADS):
        yield


def chat_ids(folder: Path, question: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def run_all(engine: Engine, prompts: list[list[int]]) -> dict[tuple[int, int], Any]:
    """Every prompt at every width in one batch."""
    cases = [(p, w) for p in range(len(prompts)) for w in WIDTHS]
    params = [SamplingParams(n=w, use_beam_search=True, temperature=0.0, max_tokens=MAX_NEW) for _, w in cases]
    results = engine.generate([prompts[p] for p, _ in cases], params)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    return {case: r.outputs for case, r in zip(cases, results)}


def compare(
    model: Any, prompts: list[list[int]], ours: dict[tuple[int, int], Any], stops: list[int], label: str
) -> None:
    ended = 0
    for (p, w), choices in ours.items():
        ref = hf_beam_search(model, prompts[p], w, MAX_NEW, stops)
        assert len(choices) == w
        for c in choices:  # (offline results: ``GeneratedChoice``, compared as ``assert_beams_equal`` reads them)
            c.new_token_ids = c.token_ids
        assert_beams_equal(choices, ref, 1.0, f"{label} prompt {p} width {w}", rel=1e-4)
        ended += sum(c.finish_reason == "stop" for c in choices)
    assert ended > 0  # some beams ended on EOS


def test_default_model_equals_transformers(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [chat_ids(default_model_dir, q) for q in QUESTIONS]
    engine = Engine(EngineConfig(model=str(default_model_dir), kv_cache_memory=64 * 2**20, max_model_len=512))
    ours = run_all(engine, prompts)
    stops = list(engine.eos_token_ids)
    del engine
    gc.collect()
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    compare(model, prompts, ours, stops, "SmolLM2-135M")


def test_qwen05_gguf_exact_mode_equals_transformers(qwen05_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    from servelm.runtime.model_files import resolve_model_path

    folder = resolve_model_path(str(qwen05_gguf))
    prompts = [chat_ids(folder, q) for q in QUESTIONS]
    engine = Engine(
        EngineConfig(model=str(qwen05_gguf), gguf_activations="float32", kv_cache_memory=64 * 2**20, max_model_len=256)
    )
    ours = run_all(engine, prompts)
    stops = list(engine.eos_token_ids)
    del engine
    gc.collect()
    with fast_gguf_reader():
        model = AutoModelForCausalLM.from_pretrained(
            str(qwen05_gguf.parent), dtype=torch.float32, gguf_file=qwen05_gguf.name
        )
    compare(model.eval(), prompts, ours, stops, "Qwen2.5-Coder-0.5B Q4_K_M")
