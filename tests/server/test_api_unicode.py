"""Strings a client sends must be Unicode text: a lone surrogate (``"\\ud800"`` in the JSON, or its raw
UTF-8-style bytes) is a 400 naming the field on every endpoint, streamed or not, before anything is
tokenized, compiled or queued, and the keep-alive connection stays usable. (The tokenizer raised
TypeError on such a prompt, and echoing one back failed to encode: both were 500s.)"""

from __future__ import annotations

import http.client
import json
from typing import Any

import httpx
import pytest
from srv_harness import assert_error

http_client = httpx.Client(timeout=30)
BAD = "\ud800"  # json.dumps writes it as the escape "\ud800", which json.loads turns back into it
USER = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def _post(srv: Any, path: str, body: dict) -> httpx.Response:
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as its escape
    return http_client.post(srv.url + path, content=raw.encode(), headers={"content-type": "application/json"})


CASES = [
    ("/v1/completions", {"prompt": f"{BAD} hi"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", f"a{BAD}"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x", "\udc00"]}, "stop[1]"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": f"a{BAD}"}}, "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": ["a", BAD]}}, "structured_outputs.choice[1]"),
    ("/v1/completions", {"prompt": "hi", "user": BAD}, "user"),
    ("/v1/completions", {"prompt": "hi", "model": BAD}, "model"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {BAD: 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{BAD} hi"}]}, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", {"messages": [{"role": BAD, "content": "x"}]}, "messages[0].role"),
    (
        "/v1/chat/completions",
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": f'{{"a": "{BAD}"}}'}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "description": BAD}}]},
        "tools[0].function.description",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": USER,
            "tools": [
                {**TOOL, "function": {**TOOL["function"], "parameters": {"properties": {"x": {"description": BAD}}}}}
            ],
        },
        "tools[0].function.parameters.properties.x.description",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"properties": {BAD: {}}}},
            },
        },
        "response_format.json_schema.schema.properties",
    ),
    ("/v1/chat/completions", {"messages": USER, "metadata": {"k": BAD}}, "metadata.k"),
    ("/tokenize", {"prompt": f"{BAD} hi"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    (
        "/tokenize",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "description": BAD}}]},
        "tools[0].function.description",
    ),
    ("/detokenize", {"tokens": [1], "model": BAD}, "model"),
    ("/v1/responses", {"input": f"{BAD} hi"}, "input"),
    ("/v1/responses", {"input": [{"role": "user", "content": BAD}]}, "input[0].content"),
    (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": BAD}]}]},
        "input[0].content[0].text",
    ),
    ("/v1/responses", {"input": [{"role": "user", "content": "x", "extra": BAD}]}, "input[0].extra"),
    ("/v1/responses", {"input": "hi", "instructions": BAD}, "instructions"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": BAD}}, "metadata.k"),
    (
        "/v1/responses",
        {"input": "hi", "tools": [{"type": "function", "name": "f", "description": BAD}]},
        "tools[0].description",
    ),
]


@pytest.mark.parametrize("path, body, param", CASES)
def test_a_lone_surrogate_is_400_naming_the_field(shared_fake_server: Any, path: str, body: dict, param: str) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    err = assert_error(_post(srv, path, body), 400, param=param)
    assert "surrogate" in err["message"] and param in err["message"]
    assert len(eng.added) == before


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": f"{BAD} hi", "max_tokens": 2}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"{BAD} hi"}], "max_tokens": 2},
            "messages[0].content",
        ),
        ("/v1/responses", {"input": f"{BAD} hi", "max_output_tokens": 2}, "input"),
    ],
)
def test_streamed_requests_are_refused_before_the_stream_starts(
    shared_fake_server: Any, path: str, body: dict, param: str
) -> None:
    srv, _, _ = shared_fake_server
    r = _post(srv, path, {**body, "stream": True})
    assert not r.headers["content-type"].startswith("text/event-stream")
    assert_error(r, 400, param=param)


def test_raw_surrogate_bytes_are_refused_too(shared_fake_server: Any) -> None:
    """json.loads decodes a bytes body with 'surrogatepass': the 3-byte form of U+D800 becomes one."""
    srv, _, _ = shared_fake_server
    body = b'{"prompt": "\xed\xa0\x80 hi", "max_tokens": 2}'
    r = http_client.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param="prompt")


def test_surrogate_pairs_are_characters_and_served(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    r = _post(srv, "/v1/completions", {"prompt": "launch \U0001f680", "max_tokens": 2})  # sent as \ud83d\ude80
    assert r.status_code == 200, r.text
    assert eng.tokenizer.decode(eng.prompts[-1]).endswith("launch \U0001f680")
    r = _post(srv, "/v1/responses", {"input": "hi", "metadata": {"k": "\U0001f680"}, "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["metadata"] == {"k": "\U0001f680"}


def test_the_keep_alive_connection_survives_the_refusal(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    bodies = [
        ("/v1/completions", {"prompt": f"{BAD} hi", "max_tokens": 2}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}], "max_tokens": 2}, 400),
        ("/tokenize", {"prompt": BAD}, 400),
        ("/v1/responses", {"input": BAD, "max_output_tokens": 2}, 400),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 200),
    ]
    conn.connect()
    sock = conn.sock
    for path, body, status in bodies:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == status, (path, resp.status)
        assert conn.sock is sock  # the same connection: not closed by the server
    conn.close()
