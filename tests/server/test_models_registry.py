"""Several models behind one server (server/model_registry.py, server/gate.py): loading on demand,
/v1/models' states, unknown names, LRU unloading under a memory budget, keep_alive, requests in
flight protected, and a model that fails to load, over scripted engines (one per model)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from srv_harness import FakeEngine, ServerThread

from servelm.metrics.models import ModelMetrics
from servelm.scheduler.config import EngineConfig
from servelm.server.app import build_app
from servelm.server.gate import LOAD_HEADER
from servelm.server.model_registry import ModelRegistry
from servelm.server.model_specs import ModelSpec

LOAD = LOAD_HEADER.decode()


class Builds:
    """The engines a registry builds: scripted, one per load, named as the model; ``broken`` fail."""

    def __init__(self, tokenizer: Any, step_time: float = 0.002, broken: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.step_time = step_time
        self.broken = broken
        self.loads: list[str] = []
        self.engines: list[FakeEngine] = []

    def __call__(self, spec: ModelSpec, observer: Any) -> tuple[Any, Any]:
        if spec.id in self.broken:
            raise ValueError(f"{spec.id}: not a model folder (config.json is corrupt)")
        engine = FakeEngine(self.tokenizer, step_time=self.step_time)
        engine.served_model_name = spec.id
        self.loads.append(spec.id)
        self.engines.append(engine)
        return engine, None


def _specs(*ids: str, keep: dict[str, float | None] | None = None) -> list[ModelSpec]:
    keep = keep or {}
    return [
        ModelSpec(
            i, EngineConfig(served_model_name=i), aliases=(f"{i}-alias",), keep_alive_s=keep.get(i), memory_bytes=100
        )
        for i in ids
    ]


@pytest.fixture
def models_server(server_tokenizer: Any) -> Iterator[Callable[..., tuple[ServerThread, ModelRegistry, Builds]]]:
    """``models_server(ids, budget=None, keep=None, **builds)`` -> (running server, its registry, its builds)."""
    started: list[ServerThread] = []

    def make(
        ids: tuple[str, ...], budget: int | None = None, keep: dict[str, float | None] | None = None, **kw: Any
    ) -> tuple[ServerThread, ModelRegistry, Builds]:
        builds = Builds(server_tokenizer, **kw)
        registry = ModelRegistry(_specs(*ids, keep=keep), builds, memory_budget=budget, metrics=ModelMetrics())
        srv = ServerThread(build_app(registry=registry)).start()
        started.append(srv)
        return srv, registry, builds

    yield make
    for srv in started:
        srv.stop()


def _chat(url: str, model: str, max_tokens: int = 3, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def _states(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def test_models_load_on_demand_and_list_their_state(models_server: Any) -> None:
    srv, _, builds = models_server(("a", "b", "c"))
    assert _states(srv.url) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
    first = _chat(srv.url, "b")
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "b"
    assert float(first.headers[LOAD]) > 0  # this request waited for b's load
    assert _states(srv.url) == {"a": "unloaded", "b": "loaded", "c": "unloaded"}
    again = _chat(srv.url, "b-alias")  # an alias names the same engine
    assert again.status_code == 200 and LOAD not in again.headers
    assert _chat(srv.url, "b:latest").json()["model"] == "b"  # Ollama's default tag
    assert builds.loads == ["b"]
    # No model named: the default (the first).
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "a"
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'servelm_model_loads_total{model_name="b"} 1.0' in metrics
    assert 'servelm_model_state{model_name="c",state="unloaded"} 1.0' in metrics
    assert 'servelm_model_load_waits_total{model_name="a"} 1.0' in metrics


def test_unknown_model_is_openai_404_and_loads_nothing(models_server: Any) -> None:
    srv, _, builds = models_server(("a", "b"))
    r = _chat(srv.url, "nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert builds.loads == []
    assert httpx.get(f"{srv.url}/v1/models/nope").status_code == 404
    assert httpx.get(f"{srv.url}/v1/models/a").json()["state"] == "unloaded"


def test_concurrent_requests_to_two_models_each_get_their_engine(models_server: Any) -> None:
    srv, _, builds = models_server(("a", "b"))
    results: dict[str, httpx.Response] = {}

    def ask(model: str) -> None:
        results[model] = _chat(srv.url, model, max_tokens=5)

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {m: r.json()["model"] for m, r in results.items()} == {"a": "a", "b": "b"}
    assert sorted(builds.loads) == ["a", "b"]
    expected = builds.engines[0].expected_text(5)
    assert all(r.json()["choices"][0]["message"]["content"] == expected for r in results.values())
    assert all(len(e.added) == 1 for e in builds.engines)  # each request went to its own model's engine


def test_lru_model_is_unloaded_when_a_new_one_does_not_fit(models_server: Any) -> None:
    srv, registry, builds = models_server(("a", "b", "c"), budget=200)  # two of the three fit
    for m in ("a", "b", "a"):  # b is now the least recently used
        assert _chat(srv.url, m).status_code == 200
    assert _chat(srv.url, "c").status_code == 200
    assert _states(srv.url) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    assert builds.engines[1].served_model_name == "b" and not any(
        e is builds.engines[1] for e in _loaded_engines(registry)
    )
    assert 'servelm_model_unloads_total{model_name="b",reason="budget"} 1.0' in httpx.get(f"{srv.url}/metrics").text
    # b again: a is now the least recently used idle one.
    assert _chat(srv.url, "b").status_code == 200
    assert _states(srv.url) == {"a": "unloaded", "b": "loaded", "c": "loaded"}


def _loaded_engines(registry: ModelRegistry) -> list[Any]:
    return [h.async_engine.engine for h in registry.handles.values() if h.async_engine is not None]


def test_a_model_with_a_request_in_flight_is_never_unloaded(models_server: Any) -> None:
    srv, _, builds = models_server(("a", "b"), budget=100)  # one model at a time
    assert _chat(srv.url, "a").status_code == 200
    a = builds.engines[0]
    a.step_time = 0.2  # its next request runs for 8 s unless sped up
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=30, json={
        "model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True,
    }) as stream:  # fmt: skip
        chunks = stream.iter_raw()  # (kept: a dropped iterator closes the response)
        first = next(chunks)  # a's request is running
        busy = _chat(srv.url, "b")
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "models_busy" and busy.headers["Retry-After"]
        a.step_time = 0.001
        body = first + b"".join(chunks)
    assert b"[DONE]" in body  # a's stream ran to its end
    assert _chat(srv.url, "b").status_code == 200  # a is idle now: it makes room
    assert _states(srv.url) == {"a": "unloaded", "b": "loaded"}
    assert builds.engines[0].block_manager.num_used_blocks == 0


def test_keep_alive_zero_unloads_after_the_request_and_minus_one_keeps(models_server: Any) -> None:
    srv, _, builds = models_server(("a", "b"), keep={"a": 0.0})  # a: unloaded once idle
    assert _chat(srv.url, "a").status_code == 200
    _wait_for(lambda: _states(srv.url)["a"] == "unloaded")
    # A request's keep_alive (Ollama's field) comes before the model's: -1 keeps it.
    r = httpx.post(
        f"{srv.url}/api/generate",
        json={"model": "a", "prompt": "hi", "stream": False, "keep_alive": -1, "options": {"num_predict": 2}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    time.sleep(0.2)
    assert _states(srv.url)["a"] == "loaded"
    assert httpx.get(f"{srv.url}/api/ps").json()["models"][0]["expires_at"].startswith("2318")
    # A duration: loaded until it passes.
    r = httpx.post(
        f"{srv.url}/api/generate",
        json={"model": "b", "prompt": "hi", "stream": False, "keep_alive": "300ms", "options": {"num_predict": 2}},
        timeout=30,
    )
    assert r.status_code == 200
    assert _states(srv.url)["b"] == "loaded"
    _wait_for(lambda: _states(srv.url)["b"] == "unloaded")
    assert 'servelm_model_unloads_total{model_name="b",reason="keep_alive"} 1.0' in httpx.get(f"{srv.url}/metrics").text
    # Ollama's "unload now": no prompt and keep_alive 0; an unloaded model is not loaded for it.
    r = httpx.post(f"{srv.url}/api/generate", json={"model": "a", "keep_alive": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    assert _states(srv.url)["a"] == "unloaded"
    loads = list(builds.loads)
    assert (
        httpx.post(f"{srv.url}/api/chat", json={"model": "b", "messages": [], "keep_alive": 0}, timeout=30).json()[
            "done_reason"
        ]
        == "unload"
    )
    assert builds.loads == loads
    bad = httpx.post(f"{srv.url}/api/generate", json={"model": "b", "prompt": "hi", "keep_alive": "soon"}, timeout=30)
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_model_that_fails_to_load_is_refused_alone(models_server: Any) -> None:
    srv, _, builds = models_server(("a", "broken"), broken=("broken",))
    r = _chat(srv.url, "broken")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and "config.json is corrupt" in err["message"]
    assert _chat(srv.url, "a").status_code == 200  # the others go on
    models = {m["id"]: m for m in httpx.get(f"{srv.url}/v1/models").json()["data"]}
    assert models["broken"]["state"] == "failed" and "corrupt" in models["broken"]["error"]
    again = _chat(srv.url, "broken")  # refused from what it remembers, not loaded again at once
    assert again.status_code == 500 and builds.loads == ["a"]
    ollama = httpx.post(
        f"{srv.url}/api/chat", json={"model": "broken", "messages": [{"role": "user", "content": "x"}]}, timeout=30
    )
    assert ollama.status_code == 500 and "corrupt" in ollama.json()["error"]  # Ollama's error shape on /api
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_a_model_larger_than_the_budget_is_refused(models_server: Any) -> None:
    srv, _, builds = models_server(("a", "b"), budget=50)
    r = _chat(srv.url, "a")
    assert r.status_code == 507 and r.json()["error"]["code"] == "model_too_large"
    assert builds.loads == []


def test_every_engine_series_is_one_per_model_in_one_exposition(
    server_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from servelm.server.app import create_prometheus_observer

    plain = Builds(server_tokenizer)
    monkeypatch.setenv("SERVELM_PEAK_FLOPS", "2e11")  # (the utilization denominators pinned: no measurement per model)
    monkeypatch.setenv("SERVELM_PEAK_BANDWIDTH", "2.6e10")

    def build(spec: ModelSpec, observer: Any) -> tuple[Any, Any]:
        engine, _ = plain(spec, observer)
        return engine, create_prometheus_observer(engine, registry=CollectorRegistry())

    registry = ModelRegistry(_specs("a", "b"), build, metrics=ModelMetrics())
    with ServerThread(build_app(registry=registry)) as srv:
        for model, n in (("a", 1), ("b", 2)):
            for _ in range(n):
                assert _chat(srv.url, model).status_code == 200
        text = httpx.get(f"{srv.url}/metrics").text
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per name, each model a series of it
    assert (
        text.count("# HELP servelm_request_success_total ") == 1
        and text.count("# HELP process_cpu_seconds_total ") == 1
    )
    by_family = {f.name: f for f in families}
    # (The scripted engine reports no request to its observer: the counts are the slow tier's, on real engines.)
    for name in (
        "servelm_request_success",
        "servelm_time_to_first_token_seconds",
        "servelm_kv_cache_usage_perc",
        "servelm_model_info",
    ):
        assert {s.labels["model_name"] for s in by_family[name].samples} == {"a", "b"}, name
    loads = {
        s.labels["model_name"]: s.value for s in by_family["servelm_model_loads"].samples if s.name.endswith("_total")
    }
    assert loads == {"a": 1.0, "b": 1.0}


def test_a_drain_refuses_new_requests_and_loads_and_lets_running_ones_finish(models_server: Any) -> None:
    srv, registry, builds = models_server(("a", "b"))
    assert _chat(srv.url, "a").status_code == 200
    builds.engines[0].step_time = 0.05
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=30, json={
        "model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True,
    }) as stream:  # fmt: skip
        chunks = stream.iter_raw()
        first = next(chunks)
        registry.begin_drain(10.0)  # (what SIGTERM does)
        for model in ("a", "b"):
            refused = _chat(srv.url, model)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        body = first + b"".join(chunks)
    assert b'"finish_reason":"length"' in body and body.endswith(b"data: [DONE]\n\n")
    assert builds.loads == ["a"]  # b was not loaded for a refused request
    assert httpx.get(f"{srv.url}/health").status_code == 503
