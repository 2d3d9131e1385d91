"""One ``servelm serve`` process over several real models (issue 46): the default model, Gemma 3 270M
(GGUF) and an encoder (all-MiniLM-L6-v2), plus a corrupt file, from a models file under a memory
budget that holds two of the three. Requests to each, concurrent requests to two, LRU unloading,
keep_alive 0 and -1, the failing model answered alone, and Ollama's client on real models.

References: transformers' greedy tokens for the default model, sentence-transformers' embedding for
the encoder, and for Gemma its own answer served alone in the same process (concurrency changes no
token); Ollama's answers against the OpenAI endpoints' for the same greedy request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from proc_harness import ServeProcess
from prometheus_client.parser import text_string_to_metric_families

from servelm.runtime.model_fetch import ensure

pytestmark = pytest.mark.slow  # a server process loading three real models (the GGUF one takes ~1 min on a busy CPU)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
BUDGET_MIB = 900  # the default model (~577 MiB estimated) and Gemma (~305) fit together, not with MiniLM (~87) too


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("models")
    broken = tmp / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))  # a GGUF header of version 0: no model
    models = {
        "memory_budget": f"{BUDGET_MIB}MiB",
        "models": [
            {"id": "smol", "path": "default", "kv_cache_memory": "64MiB", "max_model_len": 1024},
            {
                "id": "gemma",
                "path": str(ensure("gemma3")),
                "kv_cache_memory": "64MiB",
                "max_model_len": 1024,
                "aliases": ["gemma3"],
            },
            {"id": "minilm", "path": str(ensure("minilm"))},
            {"id": "broken", "path": str(broken), "kv_cache_memory": "16MiB"},
        ],
    }
    path = tmp / "models.yaml"
    path.write_text(json.dumps(models))  # (JSON is YAML)
    with ServeProcess("--models-file", str(path)) as srv:
        yield srv


def _states(srv: ServeProcess) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]}


def _chat(srv: ServeProcess, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "messages": CHAT, "temperature": 0, "max_tokens": 12, **kw}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=600)


def _complete(srv: ServeProcess, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=600)


def _wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _transformers_greedy(model_dir: Path, messages: list[dict[str, str]], max_new: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def test_three_models_on_demand_under_a_budget(served: ServeProcess, default_model_dir: Path) -> None:
    srv = served
    assert _states(srv) == {"smol": "unloaded", "gemma": "unloaded", "minilm": "unloaded", "broken": "unloaded"}
    # Concurrent first requests to two models: each loads its own engine and answers.
    results: dict[str, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__("smol", _chat(srv, "smol"))),
        threading.Thread(target=lambda: results.__setitem__("gemma", _complete(srv, "gemma3"))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["smol"].status_code == 200 and results["gemma"].status_code == 200, (
        results["smol"].text,
        results["gemma"].text,
    )
    assert results["smol"].json()["model"] == "smol" and results["gemma"].json()["model"] == "gemma"
    assert all(float(r.headers["x-servelm-model-load-seconds"]) > 0 for r in results.values())
    smol_text = results["smol"].json()["choices"][0]["message"]["content"]
    assert smol_text == _transformers_greedy(default_model_dir, CHAT, 12)
    # Alone, loaded: the same tokens (the other model's engine changed nothing).
    again = _complete(srv, "gemma")
    assert "x-servelm-model-load-seconds" not in again.headers
    assert again.json()["choices"][0]["text"] == results["gemma"].json()["choices"][0]["text"]
    assert _states(srv) == {"smol": "loaded", "gemma": "loaded", "minilm": "unloaded", "broken": "unloaded"}

    # The encoder does not fit beside both: the least recently used idle model (smol) is unloaded.
    from sentence_transformers import SentenceTransformer

    text = "A sentence to embed."
    r = httpx.post(f"{srv.url}/v1/embeddings", json={"model": "minilm", "input": text}, timeout=600)
    assert r.status_code == 200, r.text
    got = r.json()["data"][0]["embedding"]
    want = SentenceTransformer(str(ensure("minilm")), device="cpu").encode(text).tolist()
    dot = sum(a * b for a, b in zip(got, want, strict=True))
    assert dot / (sum(a * a for a in got) ** 0.5 * sum(b * b for b in want) ** 0.5) > 0.9999
    assert _states(srv) == {"smol": "unloaded", "gemma": "loaded", "minilm": "loaded", "broken": "unloaded"}
    assert "model smol unloaded (budget)" in srv.log
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'servelm_model_unloads_total{model_name="smol",reason="budget"} 1.0' in metrics
    successes: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples if family.name == "servelm_request_success" else ():
            if sample.name.endswith("_total"):
                model = sample.labels["model_name"]
                successes[model] = successes.get(model, 0.0) + sample.value
    assert successes == {"smol": 1.0, "gemma": 2.0, "minilm": 1.0}  # each model's series, from its own engine

    # keep_alive 0 (Ollama's field): the encoder is unloaded once its request ends.
    r = httpx.post(f"{srv.url}/api/embed", json={"model": "minilm", "input": [text], "keep_alive": 0}, timeout=600)
    assert r.status_code == 200 and r.json()["embeddings"][0] == pytest.approx(got, abs=1e-6)
    _wait_for(lambda: _states(srv)["minilm"] == "unloaded")
    # keep_alive -1: kept, with Ollama's far-future expiry.
    r = httpx.post(
        f"{srv.url}/api/generate",
        json={
            "model": "gemma",
            "prompt": "Hi",
            "raw": True,
            "stream": False,
            "keep_alive": -1,
            "options": {"num_predict": 2},
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    ps = {m["model"]: m for m in httpx.get(f"{srv.url}/api/ps").json()["models"]}
    assert list(ps) == ["gemma"] and ps["gemma"]["expires_at"].startswith("2318")

    # A corrupt file: that model's requests fail with the reason, the others go on.
    r = _chat(srv, "broken")
    assert r.status_code == 500 and r.json()["error"]["code"] == "model_load_failed", r.text
    assert "version 0" in r.json()["error"]["message"]
    assert _states(srv)["broken"] == "failed"
    assert _complete(srv, "gemma").status_code == 200
    unknown = _chat(srv, "gpt-4o")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_ollama_client_on_real_models(served: ServeProcess) -> None:
    import ollama
    from openai import OpenAI

    srv = served
    client = ollama.Client(host=srv.url, timeout=600)
    openai = OpenAI(base_url=f"{srv.url}/v1", api_key="none", timeout=600)
    # Chat, not streamed and streamed: the OpenAI endpoint's greedy answer.
    reference = openai.chat.completions.create(model="smol", messages=CHAT, temperature=0, max_tokens=12)
    r = client.chat(model="smol", messages=CHAT, options={"temperature": 0, "num_predict": 12})
    assert r.message.content == reference.choices[0].message.content
    assert r.prompt_eval_count == reference.usage.prompt_tokens
    streamed = "".join(
        p.message.content or ""
        for p in client.chat(model="smol", messages=CHAT, options={"temperature": 0, "num_predict": 12}, stream=True)
    )
    assert streamed == r.message.content
    g = client.generate(model="smol", prompt=CHAT[0]["content"], options={"temperature": 0, "num_predict": 12})
    assert g.response == r.message.content  # the same chat turn, through the template
    # format: a JSON schema held by the grammar.
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}, "country": {"type": "string"}},
        "required": ["capital", "country"],
        "additionalProperties": False,
    }
    f = client.chat(model="smol", messages=CHAT, format=schema, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(f.message.content or ""), schema)
    # tools: the same request as OpenAI's, the same call (or answer).
    tool = {"type": "function", "function": {"name": "get_capital", "description": "The capital city of a country.",
            "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}}  # fmt: skip
    ref = (
        openai.chat.completions.create(model="smol", messages=CHAT, tools=[tool], temperature=0, max_tokens=60)
        .choices[0]
        .message
    )
    t = client.chat(model="smol", messages=CHAT, tools=[tool], options={"temperature": 0, "num_predict": 60})
    want_calls = [(c.function.name, json.loads(c.function.arguments)) for c in ref.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in t.message.tool_calls or []] == want_calls
    assert (t.message.content or "") == (ref.content or "")
    # tags: every model; embed through the client.
    assert sorted(m.model for m in client.list().models) == ["broken", "gemma", "minilm", "smol"]
    e = client.embed(model="minilm", input=["one", "two"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 384
