"""``servelm serve --model <all-MiniLM-L6-v2 folder>`` as a real process: /v1/embeddings through the OpenAI SDK
and /v1/rerank through httpx equal sentence-transformers' ``encode`` and its cosines, /metrics counts the
requests, and a generation endpoint answers 400 ``model_not_generative``.

Second tier (its module starts `servelm serve`, tests/tiers.py); the in-process server's tests of every
input shape and refusal are tests/server/test_embeddings_api.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from encoder_cases import TEXTS, cosines, st_encode
from proc_harness import ServeProcess

from servelm.runtime.model_fetch import ensure


@pytest.fixture(scope="module")
def minilm() -> Path:
    return ensure("minilm")


@pytest.fixture(scope="module")
def server(minilm: Path) -> Iterator[ServeProcess]:
    with ServeProcess("--model", str(minilm), "--max-num-seqs", "8") as srv:
        yield srv


def counted(url: str) -> tuple[float, float]:
    """Requests finished with reason "stop" and prompt tokens, as /metrics reports them."""
    text = httpx.get(f"{url}/metrics").text
    ok = re.search(r'^servelm_request_success_total\{[^}]*finished_reason="stop"[^}]*\} (\S+)', text, re.M)
    prompt = re.search(r"^servelm_prompt_tokens_total\{[^}]*\} (\S+)", text, re.M)
    return (float(ok.group(1)) if ok else 0.0), (float(prompt.group(1)) if prompt else 0.0)


def test_embeddings_and_rerank_equal_sentence_transformers(server: ServeProcess, minilm: Path) -> None:
    reference = st_encode(minilm, TEXTS)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "all-MiniLM-L6-v2"
    done, tokens = counted(server.url)

    res = client.embeddings.create(model=model, input=TEXTS)  # the SDK asks for base64 and decodes it
    got = torch.tensor([d.embedding for d in res.data])
    assert got.shape == (len(TEXTS), 384) and min(cosines(got, reference)) >= 0.9999

    query, docs = TEXTS[0], TEXTS[1:]
    want = cosines(reference[:1].expand(len(docs), -1), reference[1:])
    body = httpx.post(f"{server.url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 4}).json()
    assert [r["index"] for r in body["results"]] == sorted(range(len(docs)), key=lambda i: -want[i])[:4]
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)

    # One request per text: the embeddings' ten, and the rerank's query with its nine documents.
    done2, tokens2 = counted(server.url)
    assert done2 - done == 2 * len(TEXTS)
    assert tokens2 - tokens == res.usage.prompt_tokens + body["usage"]["total_tokens"]


def test_generation_is_refused_and_the_server_lives(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and e.value.code == "model_not_generative"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"
    after = client.embeddings.create(model="all-MiniLM-L6-v2", input="still serving", encoding_format="float")
    assert len(after.data[0].embedding) == 384
    assert server.proc is not None and server.proc.poll() is None
