"""LoRA adapters over HTTP: a real engine on the tiny Llama with PEFT adapters, the official SDK and raw
httpx. Each adapter's answers equal the engine's offline ones for that adapter, the base model's stay
the base model's in the same batches, and loading / unloading at run time behaves as vLLM's endpoints."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from lora_files import save_lora_adapter
from srv_harness import ServerThread

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.app import ObserverProxy, build_app, create_prometheus_observer
from servelm.server.async_engine import AsyncEngine

PROMPT = "The quick brown fox"
MAX_TOKENS = 12


@dataclass
class Lora:
    srv: ServerThread
    engine: Any
    ae: AsyncEngine
    base: str
    adapters: dict[str, Path]
    texts: dict[str | None, str]  # offline greedy completion of PROMPT per adapter (None: base)
    spare: Path  # an adapter not loaded at start-up

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.srv.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.srv.url}{path}", json=body, timeout=60)


@pytest.fixture(scope="module")
def lora(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lora]:
    from servelm.scheduler.engine import Engine

    tmp = tmp_path_factory.mktemp("api-lora")
    adapters = {
        "sql": save_lora_adapter(tiny_llama_dir, tmp / "sql", seed=21),
        "poet": save_lora_adapter(tiny_llama_dir, tmp / "poet", seed=22, r=4),
    }
    spare = save_lora_adapter(tiny_llama_dir, tmp / "spare", seed=23)
    proxy = ObserverProxy()
    config = EngineConfig(
        model=str(tiny_llama_dir),
        kv_cache_memory=4 * 2**20,
        max_model_len=256,
        max_loras=2,
        max_cpu_loras=4,
        lora_modules=tuple((k, str(v)) for k, v in adapters.items()),
    )
    engine = Engine(config, observer=proxy)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = engine.tokenizer.encode(PROMPT)
    texts = {name: engine.generate([ids], greedy, lora_names=name)[0].outputs[0].text for name in (None, "sql", "poet")}
    assert len(set(texts.values())) == 3  # the adapters change the answer
    engine.loras.add("spare_ref", str(spare))
    texts["spare"] = engine.generate([ids], greedy, lora_names="spare_ref")[0].outputs[0].text
    engine.loras.remove("spare_ref")
    observer = create_prometheus_observer(engine)
    proxy.target = observer
    ae = AsyncEngine(engine, observer=proxy)
    app = build_app(ae, metrics_registry=getattr(observer, "registry", None), allow_runtime_lora_updating=True)
    srv = ServerThread(app).start()
    try:
        yield Lora(srv, engine, ae, engine.served_model_name, adapters, texts, spare)
    finally:
        srv.stop()


def _complete(c: openai.OpenAI, model: str) -> str:
    r = c.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.model == model
    return r.choices[0].text


def _idle(lora: Lora) -> None:
    deadline = time.monotonic() + 20
    while (
        lora.ae.snapshot.num_running
        or lora.ae.snapshot.num_waiting
        or lora.ae.snapshot.num_used_blocks
        or lora.ae._groups
    ):
        assert time.monotonic() < deadline, lora.ae.snapshot
        time.sleep(0.05)


def test_models_lists_the_adapters(lora: Lora) -> None:
    c = lora.client()
    cards = {m.id: m for m in c.models.list().data}
    assert set(cards) == {lora.base, "sql", "poet"}
    assert cards["sql"].parent == lora.base and cards["sql"].root == str(lora.adapters["sql"])
    assert c.models.retrieve("poet").parent == lora.base
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")


def test_each_adapter_answers_as_offline_concurrently(lora: Lora) -> None:
    """Base and adapter requests at once, several of each: every answer is its own model's."""
    c = lora.client()
    jobs = [lora.base, "sql", "poet"] * 4
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda m: _complete(c, m), jobs))
    for model, text in zip(jobs, got):
        assert text == lora.texts[None if model == lora.base else model], model
    _idle(lora)


def test_chat_and_streams_name_the_adapter(lora: Lora) -> None:
    c = lora.client()
    msgs = [{"role": "user", "content": "Hello"}]
    full = c.chat.completions.create(model="sql", messages=msgs, max_tokens=8, temperature=0)
    assert full.model == "sql"
    chunks = list(c.chat.completions.create(model="sql", messages=msgs, max_tokens=8, temperature=0, stream=True))
    assert {ch.model for ch in chunks} == {"sql"}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full.choices[0].message.content
    base = c.chat.completions.create(model=lora.base, messages=msgs, max_tokens=8, temperature=0)
    assert base.model == lora.base
    r = c.responses.create(model="poet", input="Hello", max_output_tokens=8, temperature=0)
    assert r.model == "poet"
    tok = lora.post("/tokenize", {"model": "poet", "prompt": PROMPT})
    assert tok.status_code == 200 and tok.json()["tokens"] == lora.engine.tokenizer.encode(PROMPT)


def test_cache_salt_over_http(lora: Lora) -> None:
    """usage.prompt_tokens_details.cached_tokens: a repeated prompt hits the cache under the same salt only."""
    c = lora.client()
    prompt = "A prompt long enough to fill a few blocks of sixteen tokens each, so that it can be cached."

    def cached(**extra: Any) -> int:
        r = c.completions.create(model=lora.base, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") > 0
    assert cached(cache_salt="bob") == 0
    msgs = [{"role": "user", "content": prompt}]
    r1 = c.chat.completions.create(model="sql", messages=msgs, max_tokens=1, extra_body={"cache_salt": "carol"})
    r2 = c.chat.completions.create(model="sql", messages=msgs, max_tokens=1, extra_body={"cache_salt": "carol"})
    assert r1.usage.prompt_tokens_details.cached_tokens == 0 < r2.usage.prompt_tokens_details.cached_tokens
    hits = [
        c.responses.create(
            model=lora.base, input=prompt, max_output_tokens=1, extra_body={"cache_salt": "dave"}
        ).usage.input_tokens_details.cached_tokens
        for _ in range(2)
    ]
    assert hits[0] == 0 < hits[1]
    r = lora.post("/v1/completions", {"model": lora.base, "prompt": prompt, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    _idle(lora)


def test_priority_needs_the_priority_policy(lora: Lora) -> None:
    r = lora.post("/v1/completions", {"model": lora.base, "prompt": PROMPT, "max_tokens": 1, "priority": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = lora.post("/v1/completions", {"model": lora.base, "prompt": PROMPT, "max_tokens": 1, "priority": 0})
    assert r.status_code == 200


def test_unknown_model_is_404_in_openai_shape(lora: Lora) -> None:
    r = lora.post("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_load_and_unload_at_run_time(lora: Lora) -> None:
    c = lora.client()
    r = lora.post("/v1/load_lora_adapter", {"lora_name": "spare", "lora_path": str(lora.spare)})
    assert r.status_code == 200 and "added" in r.text
    assert "spare" in {m.id for m in c.models.list().data}
    assert _complete(c, "spare") == lora.texts["spare"]
    # Loading it again, a bad folder, an adapter over the rank limit, an unknown field: 400s naming the field.
    bad = [
        ({"lora_name": "spare", "lora_path": str(lora.spare)}, "lora_name", "already been loaded"),
        ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, "lora_path", "not a folder"),
        ({"lora_name": "x", "lora_path": str(lora.spare.parent)}, "lora_path", "adapter_config.json"),
        ({"lora_name": lora.base, "lora_path": str(lora.spare)}, "lora_name", "already been loaded"),
    ]
    for body, param, words in bad:
        r = lora.post("/v1/load_lora_adapter", body)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    r = lora.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(lora.spare), "load_everything": True})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    r = lora.post("/v1/unload_lora_adapter", {"lora_name": "spare"})
    assert r.status_code == 200 and "removed" in r.text
    assert "spare" not in {m.id for m in c.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(c, "spare")
    r = lora.post("/v1/unload_lora_adapter", {"lora_name": "spare"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"
    _idle(lora)
    assert lora.engine.runner.lora_ids == {lora.engine.loras.id_of(n) for n in ("sql", "poet")}


def test_unload_while_streaming_lets_the_stream_finish(lora: Lora) -> None:
    c = lora.client()
    assert lora.post("/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(lora.spare)}).status_code == 200
    stream = c.completions.create(
        model="tmp", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert lora.post("/v1/unload_lora_adapter", {"lora_name": "tmp"}).status_code == 200
    text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert text == lora.texts["spare"]
    _idle(lora)
    assert len(lora.engine.runner.lora_ids) == 2


def test_metrics_report_the_adapters(lora: Lora) -> None:
    body = httpx.get(f"{lora.srv.url}/metrics", timeout=10).text
    lines = [ln for ln in body.splitlines() if ln.startswith("servelm_lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0], lines


def test_runtime_updating_is_off_by_default(tiny_llama_dir: Path, fake_server: Any) -> None:
    srv, _, _ = fake_server()
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}, timeout=10)
    assert r.status_code == 404
