"""The request-field policy over a scripted engine: fields servelm does not know are ignored (logged once per
name, listed in ``x-servelm-ignored-fields``), fields that would change the result are refused by name,
the routers' extensions are honoured, and the client's request id is echoed in ``X-Request-Id``."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from srv_harness import assert_error, parse_sse

http = httpx.Client(timeout=30)
IGNORED = "x-servelm-ignored-fields"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BODIES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": CHAT,
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
}
# What the routers forward, as captured from vllm-router 0.1.17 and sglang-router 0.3.2 (the client sent
# only model, prompt/messages/input and max_tokens); every field is one servelm knows.
ROUTED = [
    (
        "/v1/completions",
        {
            "model": "fake-model",
            "prompt": "Hi",
            "max_tokens": 2,
            "stream": False,
            "echo": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "skip_special_tokens": True,
            "return_hidden_states": False,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "fake-model",
            **CHAT,
            "stream": False,
            "logprobs": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "continue_final_message": False,
            "skip_special_tokens": True,
            "separate_reasoning": True,
            "stream_reasoning": True,
            "return_hidden_states": False,
            "include_reasoning": True,
        },
    ),
    (
        "/v1/responses",
        {
            "input": "Hi",
            "model": "fake-model",
            "store": True,
            "stream": None,
            "temperature": 1.0,
            "top_p": 1.0,
            "priority": 0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        },
    ),
]


@pytest.mark.parametrize("path,body", ROUTED, ids=[p for p, _ in ROUTED])
def test_what_the_routers_forward_is_served_without_notice(shared_fake_server: Any, path: str, body: dict) -> None:
    srv, _, _ = shared_fake_server
    r = http.post(srv.url + path, json=body)
    assert r.status_code == 200, r.text
    assert IGNORED not in r.headers


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_are_ignored_and_named_in_a_header(shared_fake_server: Any, path: str, stream: bool) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    body = {**BODIES[path], "zeta_knob": {"x": 1}, "alpha_flag": True, "stream": stream}
    r = http.post(srv.url + path, json=body)
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED] == "alpha_flag, zeta_knob"
    assert len(eng.added) == before + 1
    if stream and path != "/v1/responses":
        assert parse_sse(r.content)[-1] == "[DONE]"
    elif stream:
        assert "event: response.incomplete" in r.text  # max_output_tokens reached


def test_each_ignored_field_is_logged_once(fake_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    srv, _, _ = fake_server()
    with caplog.at_level(logging.WARNING, logger="servelm.server"):
        for _ in range(3):
            assert (
                http.post(f"{srv.url}/v1/completions", json={**BODIES["/v1/completions"], "odd_one": 1}).status_code
                == 200
            )
        http.post(f"{srv.url}/v1/chat/completions", json={**CHAT, "odd_one": 1, "odd_two": 2})
    warned = [r.getMessage() for r in caplog.records if "odd_" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "odd_one" in warned[0] and "odd_two" in warned[1] and "odd_one" not in warned[1]


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "return_hidden_states", True),
        ("/v1/chat/completions", "return_hidden_states", True),
        ("/v1/chat/completions", "continue_final_message", True),
        ("/v1/completions", "suffix", "end"),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/responses", "background", True),
    ],
)
def test_fields_whose_loss_changes_the_result_are_still_refused(
    shared_fake_server: Any, path: str, field: str, value: Any
) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    assert_error(http.post(srv.url + path, json={**BODIES[path], field: value}), 400, param=field)
    assert len(eng.added) == before


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("field", ["no_stop_trim", "include_stop_str_in_output"])
def test_keeping_the_stop_string_reaches_the_engine(shared_fake_server: Any, path: str, field: str) -> None:
    srv, eng, _ = shared_fake_server
    for value in (True, False):
        assert http.post(srv.url + path, json={**BODIES[path], "stop": ["x"], field: value}).status_code == 200
        assert eng.last_params.include_stop_str_in_output is value


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_request_id_is_echoed_and_logged(
    shared_fake_server: Any, path: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    srv, _, _ = shared_fake_server
    with caplog.at_level(logging.INFO, logger="servelm.server"):
        r = http.post(srv.url + path, json={**BODIES[path], "stream": stream}, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "trace-42"
    assert any("trace-42" in rec.getMessage() for rec in caplog.records)
    if not stream:
        rid = r.json()["id"]  # still OpenAI-shaped: the server's own id, not the client's
        assert rid.split("-")[0].split("_")[0] in ("cmpl", "chatcmpl", "resp") and "trace-42" not in rid
        assert any("trace-42" in m and rid in m for m in (rec.getMessage() for rec in caplog.records))
    # The body's request_id (vLLM's field) serves when no header is sent.
    r = http.post(srv.url + path, json={**BODIES[path], "request_id": "body-7"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "body-7"


def test_without_a_client_id_the_response_id_is_echoed(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    r = http.post(f"{srv.url}/v1/completions", json=BODIES["/v1/completions"])
    assert r.headers["x-request-id"] == r.json()["id"]


def test_a_refused_request_still_echoes_the_request_id(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "suffix": "y"}, headers={"X-Request-Id": "r-9"})
    assert_error(r, 400, param="suffix")
    assert r.headers["x-request-id"] == "r-9"


def test_a_request_id_is_bounded(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    assert_error(
        http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "request_id": "r" * 513}), 400, param="request_id"
    )


def test_unknown_fields_of_nested_objects_are_still_refused(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    body = {"messages": [{"role": "user", "content": "x", "frobnicate": 1}]}
    assert_error(http.post(f"{srv.url}/v1/chat/completions", json=body), 400, param="messages[0].frobnicate")


def test_render_gives_the_token_ids_generation_would_use(shared_fake_server: Any) -> None:
    """vLLM's render endpoints, which vllm-router's cache_aware policy asks every replica before routing."""
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    r = http.post(f"{srv.url}/v1/chat/completions/render", json={**CHAT, "no_stop_trim": False})
    assert r.status_code == 200, r.text
    tokenized = http.post(f"{srv.url}/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    assert r.json() == {"token_ids": tokenized}
    r = http.post(f"{srv.url}/v1/completions/render", json={"prompt": ["Hi", "there"], "max_tokens": 2})
    assert r.json() == [{"token_ids": eng.tokenizer.encode("Hi")}, {"token_ids": eng.tokenizer.encode("there")}]
    assert len(eng.added) == before  # nothing generated
    assert_error(http.post(f"{srv.url}/v1/completions/render", json={"prompt": [1, 10**9]}), 400, param="prompt")


def test_odd_and_many_field_names_make_a_safe_header(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    body = {**BODIES["/v1/completions"], "a\r\nset-cookie: x": 1, "é, b": 2}
    r = http.post(f"{srv.url}/v1/completions", json=body, headers={"X-Request-Id": "ok"})
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED] == "a\\r\\nset-cookie:\\x20x, \\xe9\\x2c\\x20b" and "set-cookie" not in r.headers
    many = {**BODIES["/v1/completions"], **{f"f{i:02d}": i for i in range(40)}}
    r = http.post(f"{srv.url}/v1/completions", json=many)
    assert r.headers[IGNORED] == ", ".join(f"f{i:02d}" for i in range(32)) + ", +8 more"
