"""/v1/embeddings, /v1/rerank and /v1/score on a real encoder (all-MiniLM-L6-v2) through a real HTTP server
(in-process): the official OpenAI SDK and LangChain's ``OpenAIEmbeddings`` unchanged, every input shape and
encoding, the vectors against sentence-transformers' ``encode``, rerank and score against its cosines,
the 400s, and /metrics counting the requests."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from encoder_cases import TEXTS, cosines, st_encode, text_of_tokens
from srv_harness import ServerThread

from servelm.runtime.model_fetch import ensure
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.encoder_engine import EncoderEngine
from servelm.server.app import build_app, create_prometheus_observer
from servelm.server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def minilm() -> Path:
    return ensure("minilm")


@pytest.fixture(scope="module")
def served(minilm: Path) -> Iterator[tuple[ServerThread, EncoderEngine]]:
    engine = EncoderEngine(EngineConfig(model=str(minilm), max_num_seqs=8))
    observer = create_prometheus_observer(engine)
    engine.observer = observer
    app = build_app(AsyncEngine(engine, observer=observer), metrics_registry=observer.registry, playground=False)
    srv = ServerThread(app).start()
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def reference(minilm: Path) -> torch.Tensor:
    return st_encode(minilm, TEXTS)


def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def as_tensor(data: list[Any]) -> torch.Tensor:
    return torch.tensor([d.embedding for d in data])


def test_openai_sdk_every_input_shape(served: tuple[ServerThread, EncoderEngine], reference: torch.Tensor) -> None:
    srv, engine = served
    c = client(srv)
    # The SDK asks for base64 unless told otherwise, and decodes it itself.
    res = c.embeddings.create(model=engine.served_model_name, input=TEXTS)
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    assert min(cosines(as_tensor(res.data), reference)) >= 0.9999
    ids = [engine.tokenizer(t)["input_ids"] for t in TEXTS]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    one = c.embeddings.create(model=engine.served_model_name, input=TEXTS[3], encoding_format="float")
    assert len(one.data) == 1 and cosines(as_tensor(one.data), reference[3:4])[0] >= 0.9999
    by_ids = c.embeddings.create(model=engine.served_model_name, input=ids[:4], encoding_format="float")
    assert min(cosines(as_tensor(by_ids.data), reference[:4])) >= 0.9999
    single_ids = c.embeddings.create(model=engine.served_model_name, input=ids[5])
    assert cosines(as_tensor(single_ids.data), reference[5:6])[0] >= 0.9999


def test_base64_is_little_endian_float32(served: tuple[ServerThread, EncoderEngine], reference: torch.Tensor) -> None:
    srv, _ = served
    body = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "base64"}).json()
    vec = torch.from_numpy(np.frombuffer(base64.b64decode(body["data"][1]["embedding"]), dtype="<f4").copy())
    assert vec.shape == (384,) and cosines(vec[None], reference[1:2])[0] >= 0.9999
    assert body["object"] == "list" and body["data"][1]["object"] == "embedding"


def test_langchain_openai_embeddings(served: tuple[ServerThread, EncoderEngine], reference: torch.Tensor) -> None:
    from langchain_openai import OpenAIEmbeddings

    srv, engine = served
    # check_embedding_ctx_length=False: else LangChain sends tiktoken's ids for OpenAI's vocabulary, not this model's.
    lc = OpenAIEmbeddings(
        model=engine.served_model_name, base_url=f"{srv.url}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    docs = torch.tensor(lc.embed_documents(TEXTS[:5]))
    assert min(cosines(docs, reference[:5])) >= 0.9999
    assert cosines(torch.tensor([lc.embed_query(TEXTS[7])]), reference[7:8])[0] >= 0.9999


def test_length_limit_and_truncation(served: tuple[ServerThread, EncoderEngine], minilm: Path) -> None:
    srv, engine = served
    c = client(srv)
    at_limit = text_of_tokens(engine.tokenizer, engine.max_model_len)
    over = text_of_tokens(engine.tokenizer, engine.max_model_len + 40)
    ok = c.embeddings.create(model=engine.served_model_name, input=at_limit, encoding_format="float")
    assert ok.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=engine.served_model_name, input=[TEXTS[0], over])
    assert e.value.body["param"] == "input" and "256" in e.value.body["message"]
    # Truncated as sentence-transformers truncates: the first tokens and the closing [SEP].
    cut = c.embeddings.create(
        model=engine.served_model_name, input=[over], encoding_format="float", extra_body={"truncate_prompt_tokens": 64}
    )
    assert cut.usage.prompt_tokens == 64
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm), device="cpu")
    st.max_seq_length = 64
    ref = st.encode([over], convert_to_tensor=True).cpu()
    assert cosines(as_tensor(cut.data), ref)[0] >= 0.9999
    assert engine.block_manager.num_used_blocks == 0


def test_refusals(served: tuple[ServerThread, EncoderEngine]) -> None:
    srv, engine = served
    c = client(srv)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": "x", "dimensions": 128}, "dimensions"),  # MiniLM was not trained for shorter vectors
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[101, 10**6, 102]]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ]
    for body, param in cases:
        r = httpx.post(f"{srv.url}/v1/embeddings", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x", "model": "other"})
    assert r.status_code == 404
    full = c.embeddings.create(model=engine.served_model_name, input="x", dimensions=384, encoding_format="float")
    assert len(full.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=engine.served_model_name, messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_generative" and "embedding model" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=engine.served_model_name, prompt="hi")
    assert engine.embed(["alive"]).shape == (1, 384)


def test_rerank_and_score_are_sentence_transformers_cosines(
    served: tuple[ServerThread, EncoderEngine], reference: torch.Tensor
) -> None:
    srv, _ = served
    query, docs = TEXTS[0], TEXTS[1:]
    want = cosines(reference[:1].expand(len(docs), -1), reference[1:])
    body = httpx.post(f"{srv.url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 3}).json()
    best = sorted(range(len(docs)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in body["results"]] == best
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
        assert r["document"] == {"text": docs[r["index"]]}
    bare = httpx.post(
        f"{srv.url}/v1/rerank",
        json={"query": query, "documents": [{"text": d} for d in docs], "return_documents": False},
    ).json()
    assert len(bare["results"]) == len(docs) and all(r.get("document") is None for r in bare["results"])
    one_to_many = httpx.post(f"{srv.url}/v1/score", json={"text_1": query, "text_2": docs[:4]}).json()
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(want[:4], abs=1e-4)
    pairs = httpx.post(f"{srv.url}/v1/score", json={"text_1": TEXTS[:3], "text_2": TEXTS[3:6]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(cosines(reference[:3], reference[3:6]), abs=1e-4)
    bad = httpx.post(f"{srv.url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[:3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
    assert httpx.post(f"{srv.url}/v1/rerank", json={"query": "q", "documents": []}).status_code == 400


def test_metrics_count_embedding_requests(served: tuple[ServerThread, EncoderEngine]) -> None:
    srv, engine = served

    def counts() -> tuple[float, float]:
        text = httpx.get(f"{srv.url}/metrics").text
        ok = re.search(r'^servelm_request_success_total\{[^}]*finished_reason="stop"[^}]*\} (\S+)', text, re.M)
        prompt = re.search(r"^servelm_prompt_tokens_total\{[^}]*\} (\S+)", text, re.M)
        return (float(ok.group(1)) if ok else 0.0), (float(prompt.group(1)) if prompt else 0.0)

    done, tokens = counts()
    ids = [engine.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    httpx.post(f"{srv.url}/v1/embeddings", json={"input": ids})
    done2, tokens2 = counts()
    assert done2 - done == 3 and tokens2 - tokens == sum(map(len, ids))


def test_embeddings_on_a_generative_model_are_refused(fake_server: Any) -> None:
    srv, _, _ = fake_server()
    r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"


def test_servelm_serve_detects_an_encoder(serve_app: Any, minilm: Path) -> None:
    app = serve_app("--model", str(minilm), "--max-model-len", "128")
    engine = app.state.serving.async_engine.engine
    assert isinstance(engine, EncoderEngine)
    assert engine.served_model_name == "all-MiniLM-L6-v2" and app.state.serving.max_model_len == 128
    assert serve_app("--model", str(minilm), "--max-model-len", "1024", status=1) is None  # past its 512 positions


@pytest.mark.slow  # loads the 274 MB nomic-embed-text-v1.5 GGUF file
def test_matryoshka_dimensions_on_nomic() -> None:
    engine = EncoderEngine(EngineConfig(model=str(ensure("nomic")), max_num_seqs=8))
    app = build_app(AsyncEngine(engine), playground=False)
    with ServerThread(app) as srv:
        c = client(srv)
        texts = [f"search_document: {t}" for t in TEXTS[:4]]
        full = as_tensor(c.embeddings.create(model=engine.served_model_name, input=texts).data)
        for dims in (512, 256, 64):
            short = as_tensor(c.embeddings.create(model=engine.served_model_name, input=texts, dimensions=dims).data)
            assert short.shape == (4, dims)
            torch.testing.assert_close(
                short, torch.nn.functional.normalize(full[:, :dims], dim=-1), atol=1e-6, rtol=1e-5
            )
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(model=engine.served_model_name, input="x", dimensions=1024)
        assert e.value.body["param"] == "dimensions"
