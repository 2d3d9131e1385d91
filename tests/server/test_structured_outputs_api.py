"""Structured outputs at the edge (a scripted engine): what reaches the engine, and every malformed
spec refused with a 400 naming its field before anything is queued."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from srv_harness import assert_error

http = httpx.Client(timeout=30)
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
COMPLETION = {"prompt": "x", "max_tokens": 4}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _post(srv: Any, path: str, body: dict) -> httpx.Response:
    return http.post(srv.url + path, json=body)


@pytest.mark.parametrize(
    "path, extra, kind, value",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "json", {"type": "object"}),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            "json",
            SCHEMA,
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
            "json",
            {},
        ),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "json", {"type": "object"}),
        ("/v1/completions", {"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
        ("/v1/completions", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", SCHEMA),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ("/v1/chat/completions", {"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        ("/v1/completions", {"structured_outputs": {"json_object": True}}, "json", {"type": "object"}),
        ("/v1/completions", {"structured_outputs": {"json": True}}, "json", {}),
    ],
)
def test_specs_reach_the_engine_compiled(
    shared_fake_server: Any, path: str, extra: dict, kind: str, value: Any
) -> None:
    srv, eng, _ = shared_fake_server
    base = CHAT if "chat" in path else COMPLETION
    r = _post(srv, path, {**base, **extra})
    assert r.status_code == 200, r.text
    so = eng.last_params.structured_output
    assert so is not None and so.kind == kind and so.compiled is not None
    assert (json.loads(so.value) if kind in ("json", "choice") else so.value) == value


def test_text_format_and_no_spec_leave_the_output_free(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    for extra in ({}, {"response_format": {"type": "text"}}):
        assert _post(srv, "/v1/chat/completions", {**CHAT, **extra}).status_code == 200
        assert eng.last_params.structured_output is None


def test_disable_any_whitespace(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    body = {**COMPLETION, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    assert _post(srv, "/v1/completions", body).status_code == 200
    assert eng.last_params.structured_output.whitespace_flexible is False


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "florp"}}}},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/nope"}}}},
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs.grammar"),
        ("/v1/completions", {"structured_outputs": {"grammar": 'start: "a" nowhere'}}, "structured_outputs.grammar"),
        ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ("/v1/completions", {"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
        ("/v1/completions", {"structured_outputs": {"json": False}}, "structured_outputs.json"),
        ("/v1/completions", {"structured_outputs": {"json": 1}}, "structured_outputs.json"),
        ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ("/v1/completions", {"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend"),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
def test_malformed_specs_are_400_naming_the_field(shared_fake_server: Any, path: str, extra: dict, param: str) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    base = CHAT if "chat" in path else COMPLETION
    assert_error(_post(srv, path, {**base, **extra}), 400, param=param)
    assert len(eng.added) == before  # nothing reached the engine


def test_schema_documents_both_fields(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    spec = http.get(srv.url + "/openapi.json").json()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = spec["components"]["schemas"][name]["properties"]
        assert "response_format" in props and "structured_outputs" in props
    so = spec["components"]["schemas"]["StructuredOutputsParams"]["properties"]
    assert {"json", "regex", "choice", "grammar", "json_object"} <= set(so)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ("/v1/chat/completions", {"structured_outputs": {"grammar": 'start: ""'}}, "structured_outputs.grammar"),
        # "a" is allowed first, but it is a stop token id, which min_tokens forbids as it forbids EOS
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a?"}, "stop_token_ids": [64]},
            "structured_outputs.regex",
        ),
    ],
)
def test_a_structure_that_min_tokens_leaves_no_first_token_is_400(
    shared_fake_server: Any, path: str, extra: dict, param: str, stream: bool
) -> None:
    """The structure allows only its end (or a stop token id) at the start while min_tokens forbids
    ending: no token could be sampled (this was a 500, or a 200 stream carrying the error)."""
    srv, eng, _ = shared_fake_server
    (a,) = eng.tokenizer.encode("a", add_special_tokens=False)
    extra = {k: ([a] if k == "stop_token_ids" else v) for k, v in extra.items()}
    before = len(eng.added)
    base = CHAT if "chat" in path else COMPLETION
    r = _post(srv, path, {**base, "max_tokens": 8, "min_tokens": 3, "stream": stream, **extra})
    assert not r.headers["content-type"].startswith("text/event-stream")
    assert "min_tokens" in assert_error(r, 400, param=param)["message"]
    assert len(eng.added) == before
    # Without min_tokens the same structure is served (an empty output), and so is one that can begin.
    assert _post(srv, path, {**base, "max_tokens": 8, "stream": stream, **extra}).status_code == 200
    so = {"structured_outputs": {"regex": "a+"}}
    assert _post(srv, path, {**base, "max_tokens": 8, "min_tokens": 3, "stream": stream, **so}).status_code == 200
