"""Beam search on the engine's scheduler equals transformers' (widths 1, 2, 4; length penalties and each
early_stopping rule; beams ending in a stop token), shares KV blocks between beams, and frees them all,
aborted searches included. A tiny random Llama in float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from beam_reference import assert_beams_equal, hf_beam_search, run_beam_search
from sched_reference import TEST_THREADS, torch_threads

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams

MiB = 2**20
MAX_NEW = 8


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 * MiB, max_model_len=256))


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    return engine.tokenizer.encode("The capital of France is", add_special_tokens=False)


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> Iterator[None]:
    with torch_threads(TEST_THREADS):
        yield


@pytest.fixture(scope="module")
def likely_tokens(hf_model: Any, engine: Engine, prompt: list[int]) -> list[int]:
    """Tokens transformers' searches pick from this prompt (greedy first), in order: stop-token candidates."""
    eos = list(engine.eos_token_ids)
    seqs = (
        hf_beam_search(hf_model, prompt, 1, MAX_NEW, eos).tokens
        + hf_beam_search(hf_model, prompt, 4, MAX_NEW, eos).tokens
    )
    return list(dict.fromkeys(t for seq in seqs for t in seq))


def beam_params(width: int, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"n": width, "use_beam_search": True, "temperature": 0.0, "max_tokens": MAX_NEW, **kw})


@pytest.mark.parametrize("width", [1, 2, 4])
def test_widths_equal_transformers(engine: Engine, hf_model: Any, prompt: list[int], width: int) -> None:
    res = engine.generate([prompt], beam_params(width))[0]
    assert len(res.outputs) == width and all(c.finish_reason == "length" for c in res.outputs)
    ref = hf_beam_search(hf_model, prompt, width, MAX_NEW, list(engine.eos_token_ids))
    assert [c.token_ids for c in res.outputs] == ref.tokens
    for c, score in zip(res.outputs, ref.scores):
        assert c.cumulative_logprob / MAX_NEW == pytest.approx(score, rel=1e-5)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"),
    [
        (1, 1.0, False),
        (2, 1.0, False),
        (4, 1.0, False),
        (2, 0.5, False),
        (4, 0.5, True),
        (2, 0.5, "never"),
        (4, 2.0, "never"),
        (3, -1.0, False),
    ],
)
def test_beams_ending_in_a_stop_token_equal_transformers(
    engine: Engine,
    hf_model: Any,
    prompt: list[int],
    likely_tokens: list[int],
    width: int,
    length_penalty: float,
    early_stopping: Any,
) -> None:
    # The first likely token that ends one of transformers' returned sequences when it is a stop token.
    for stop_token in likely_tokens:
        stops = sorted(set(engine.eos_token_ids) | {stop_token})
        ref = hf_beam_search(hf_model, prompt, width, MAX_NEW, stops, length_penalty, early_stopping)
        if any(seq[-1] == stop_token for seq in ref.tokens):
            break
    else:
        pytest.fail("no likely token ends a returned sequence")
    params = beam_params(
        width, stop_token_ids=[stop_token], length_penalty=length_penalty, early_stopping=early_stopping
    )
    choices, steps = run_beam_search(engine, f"stop-{width}-{length_penalty}-{early_stopping}", prompt, params)
    assert_beams_equal(choices, ref, length_penalty, f"width {width}, penalty {length_penalty}, {early_stopping}")
    assert steps == ref.steps  # the search ended where transformers' early-stopping rule ended it
    ended = [c for c in choices if c.new_token_ids[-1] == stop_token]
    assert ended and all(c.finish_reason == "stop" and c.stop_reason == stop_token for c in ended)
    assert engine.block_manager.num_used_blocks == 0


def test_beams_share_blocks_and_run_with_other_requests(engine: Engine, hf_model: Any, prompt: list[int]) -> None:
    """A width-4 search batched with plain requests: the same beams, and at most one partly filled block per
    beam beyond the prompt's blocks while they run (the prompt's blocks are shared, not copied)."""
    bm = engine.block_manager
    long_prompt = prompt * 12  # several full blocks of prompt
    engine.add_request("beams", long_prompt, beam_params(4))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    group = engine.choice_group("beams")
    prompt_blocks = len(long_prompt) // bm.block_size
    peak_beam_blocks = 0
    while not group.finished:
        engine.step()
        tables = [b.block_table for b in group.choices if not b.is_finished]
        if len(tables) == 4 and all(tables):
            assert all(t[:prompt_blocks] == tables[0][:prompt_blocks] for t in tables)  # one copy of the prompt
            peak_beam_blocks = max(peak_beam_blocks, len({x for t in tables for x in t}))
    while engine.has_unfinished_requests():
        engine.step()
    assert peak_beam_blocks <= prompt_blocks + 4 * (1 + -(-MAX_NEW // bm.block_size))
    assert [c.new_token_ids for c in group.results or []] == hf_beam_search(
        hf_model, long_prompt, 4, MAX_NEW, list(engine.eos_token_ids)
    ).tokens
    assert bm.num_used_blocks == 0


def test_abort_frees_every_beam(engine: Engine, prompt: list[int]) -> None:
    engine.add_request("gone", prompt, beam_params(4, max_tokens=50))
    group = engine.choice_group("gone")
    for _ in range(4):
        engine.step()
    assert len(group.choices) == 4 and engine.block_manager.num_used_blocks > 0
    engine.abort("gone")
    outs = engine.step()
    assert any(o.request_id == "gone" and o.finished for o in outs)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    engine.block_manager.check_invariants()


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (dict(temperature=0.7), "temperature"),
        (dict(top_p=0.5), "top_p"),
        (dict(top_k=5), "top_k"),
        (dict(stop=["x"]), "stop"),
        (dict(repetition_penalty=1.2), "repetition_penalty"),
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_unsupported_parameters_are_refused_by_name(kw: dict[str, Any], param: str) -> None:
    base = dict(n=2, use_beam_search=True, temperature=0.0)
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**{**base, **kw})
    assert e.value.param == param


def test_a_search_is_one_finished_request_in_the_metrics(tiny_llama_dir: Path) -> None:
    finished: list[Any] = []

    class Observer:
        def on_step(self, stats: Any) -> None:
            pass

        def on_request_finished(self, stats: Any) -> None:
            finished.append(stats)

        def on_request_rejected(self) -> None:
            pass

    e = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 * MiB, max_model_len=256), observer=Observer())
    res = e.generate(["The capital of France is"], beam_params(4))[0]
    assert len(finished) == 1 and finished[0].finish_reason == res.outputs[0].finish_reason == "length"
