"""The encoder engine on a real model (all-MiniLM-L6-v2): embeddings equal sentence-transformers' ``encode``
through the scheduler, batched or not, up to the length limit; bad requests refused by name; no block
left held; the observer sees every request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from encoder_cases import TEXTS, cosines, st_encode, text_of_tokens

from servelm.metrics.observer import RequestStats, StepStats
from servelm.runtime.model_fetch import ensure
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.encoder_engine import EncoderEngine, PoolingParams
from servelm.scheduler.errors import InvalidParameterError
from servelm.scheduler.sampling_params import SamplingParams


class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.finished: list[RequestStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.finished.append(stats)

    def on_request_rejected(self) -> None:
        pass


@pytest.fixture(scope="module")
def minilm() -> Path:
    return ensure("minilm")


@pytest.fixture(scope="module")
def engine(minilm: Path) -> EncoderEngine:
    return EncoderEngine(EngineConfig(model=str(minilm), max_num_seqs=8), Recorder())


def test_embeddings_equal_sentence_transformers(engine: EncoderEngine, minilm: Path) -> None:
    limit = engine.max_model_len
    assert limit == 256  # sentence_bert_config.json's max_seq_length, not the 512 positions
    texts = [*TEXTS, text_of_tokens(engine.tokenizer, limit), text_of_tokens(engine.tokenizer, 37)]
    ref = st_encode(minilm, texts)
    got = engine.embed(texts)  # 12 texts, 8 slots: two steps, padded attention within each
    assert got.shape == (len(texts), 384)
    assert min(cosines(got, ref)) >= 0.9999
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)  # the folder's Normalize module
    alone = torch.cat([engine.embed([t]) for t in texts[:3]])
    assert min(cosines(alone, ref[:3])) >= 0.9999
    assert engine.block_manager.num_used_blocks == 0


def test_steps_batch_under_the_budget_and_are_observed(engine: EncoderEngine) -> None:
    rec: Recorder = engine.observer
    before_steps, before_done = len(rec.steps), len(rec.finished)
    ids = [engine.tokenizer(t)["input_ids"] for t in TEXTS[:6]]
    engine.embed(ids)
    steps = rec.steps[before_steps:]
    assert len(steps) == 1  # six short prompts: one step
    assert steps[0].num_prompt_tokens == sum(map(len, ids))
    done = rec.finished[before_done:]
    assert [d.finish_reason for d in done] == ["stop"] * 6
    assert [d.num_prompt_tokens for d in done] == [len(i) for i in ids]


def test_bad_requests_are_refused_by_name(engine: EncoderEngine) -> None:
    cases = [
        ([101, 102], SamplingParams(), "model"),  # generation on an embedding model
        ([], PoolingParams(), "input"),
        ([101] * (engine.max_model_len + 1), PoolingParams(), "input"),
        ([101, 10**6], PoolingParams(), "input"),
        ([101, -1], PoolingParams(), "input"),
    ]
    for ids, params, param in cases:
        with pytest.raises(InvalidParameterError) as e:
            engine.add_request("bad", ids, params)
        assert e.value.param == param
    assert not engine.has_unfinished_requests()
    assert engine.embed(["still alive"]).shape == (1, 384)


def test_abort_frees_the_request(engine: EncoderEngine) -> None:
    engine.add_request("a", [101, 7592, 102], PoolingParams())
    engine.abort("a")
    [out] = engine.step()
    assert out.finished and out.embedding is None and out.request_id == "a"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.slow  # all-mpnet-base-v2 is a 438 MB model fetched for this test alone (not by `make model`)
def test_mpnet_equals_sentence_transformers() -> None:
    folder = ensure("mpnet")
    engine = EncoderEngine(EngineConfig(model=str(folder), max_num_seqs=8))
    assert engine.max_model_len == 384  # sentence_bert_config.json's max_seq_length
    texts = [*TEXTS, text_of_tokens(engine.tokenizer, engine.max_model_len)]
    got = engine.embed(texts)
    assert got.shape == (len(texts), 768)
    assert min(cosines(got, st_encode(folder, texts))) >= 0.9999


@pytest.mark.slow  # EmbeddingGemma-300M is a 1.2 GB float32 model fetched for this test alone
def test_embeddinggemma_equals_sentence_transformers() -> None:
    folder = ensure("egemma")
    engine = EncoderEngine(EngineConfig(model=str(folder), max_num_seqs=8))
    assert engine.max_model_len == 2048 and engine.dimensions == 768  # after its two Dense modules
    # A document past the 512-token sliding window of its local layers, and one at the limit.
    texts = [*TEXTS, text_of_tokens(engine.tokenizer, 700), text_of_tokens(engine.tokenizer, engine.max_model_len)]
    got = engine.embed(texts)
    # One text at a time: a batch would pad every short text to 2,048 tokens in the reference.
    assert min(cosines(got, st_encode(folder, texts, batch_size=1))) >= 0.9999
