"""``use_beam_search`` on ``/v1/completions`` over HTTP (a tiny random Llama): the response's shape (the best
``n`` of ``best_of`` beams, each with its ``cumulative_logprob``, equal to the offline search's, logprobs that sum
to it), the 400s for what beam search does not serve, and the engine unharmed after them (no KV blocks held)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from srv_harness import ServerThread, assert_error

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.app import build_app
from servelm.server.async_engine import AsyncEngine

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[tuple[ServerThread, Any]]:
    from servelm.scheduler.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 * 2**20, max_model_len=256))
    srv = ServerThread(build_app(AsyncEngine(engine))).start()
    try:
        yield srv, engine
    finally:
        srv.stop()


def post(srv: ServerThread, path: str = "/v1/completions", **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json={"prompt": PROMPT, "max_tokens": 6, **body}, timeout=60)


def test_best_n_of_the_beams_with_their_cumulative_logprob(live: tuple[ServerThread, Any]) -> None:
    srv, engine = live
    r = post(srv, use_beam_search=True, n=2, best_of=4, logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    offline = engine.generate([PROMPT], SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=6))[
        0
    ].outputs
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c, ref in zip(choices, offline[:2]):  # the best two of the width-4 search, best first
        assert c["text"] == ref.text and c["finish_reason"] == ref.finish_reason
        assert c["cumulative_logprob"] == pytest.approx(ref.cumulative_logprob, abs=1e-5)
        assert sum(c["logprobs"]["token_logprobs"]) == pytest.approx(c["cumulative_logprob"], abs=1e-4)
        assert all(len(top) == 2 for top in c["logprobs"]["top_logprobs"])
    assert body["usage"]["completion_tokens"] == sum(len(ref.token_ids) for ref in offline[:2])
    assert engine.block_manager.num_used_blocks == 0


def test_width_is_n_without_best_of(live: tuple[ServerThread, Any]) -> None:
    srv, engine = live
    r = post(srv, use_beam_search=True, n=3, length_penalty=0.5, early_stopping="never")
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 3 and all("cumulative_logprob" in c for c in choices)
    params = SamplingParams(
        n=3, use_beam_search=True, temperature=0.0, max_tokens=6, length_penalty=0.5, early_stopping="never"
    )
    assert [c["text"] for c in choices] == [c.text for c in engine.generate([PROMPT], params)[0].outputs]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (dict(stream=True), "stream"),
        (dict(temperature=0.8), "temperature"),
        (dict(top_p=0.9), "top_p"),
        (dict(stop=["."]), "stop"),
        (dict(frequency_penalty=0.5), "frequency_penalty"),
        (dict(n=4, best_of=2), "best_of"),
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(echo=True, logprobs=1), "prompt_logprobs"),
        (dict(n=200), "n"),
    ],
)
def test_what_beam_search_does_not_serve_is_a_400(
    live: tuple[ServerThread, Any], body: dict[str, Any], param: str
) -> None:
    srv, engine = live
    assert_error(post(srv, use_beam_search=True, n=body.pop("n", 2), **body), 400, param)
    assert engine.block_manager.num_used_blocks == 0
    assert post(srv, max_tokens=2).status_code == 200  # the engine goes on


def test_chat_refuses_beam_search(live: tuple[ServerThread, Any]) -> None:
    srv, _ = live
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2, "max_tokens": 4},
        timeout=60,
    )
    assert_error(r, 400, "use_beam_search")


def test_client_disconnect_frees_every_beam(live: tuple[ServerThread, Any]) -> None:
    srv, engine = live
    body = {"prompt": PROMPT, "max_tokens": 200, "n": 4, "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):  # the client goes away while the beams run
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while engine.block_manager.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.block_manager.num_used_blocks == 0
