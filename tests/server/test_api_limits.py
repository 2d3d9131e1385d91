"""Input limits over a scripted engine: what the server refuses before it spends time or memory on a
request (body size, prompt text longer than the context can hold, more sequences than the queue, every
list and string a request carries), and the cost of parsing what it accepts."""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from srv_harness import assert_error

from servelm.scheduler.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from servelm.scheduler.structured_output import MAX_SPEC_CHARS
from servelm.server.limits import MAX_CONTENT_PARTS, MAX_JSON_DEPTH, MAX_JSON_ITEMS, MAX_MESSAGES, MAX_TOOL_CALLS

http = httpx.Client(timeout=30)


def test_prompt_too_long_names_both_numbers(fake_server: Any) -> None:
    srv, _, _ = fake_server(max_model_len=64)
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": list(range(10, 40)), "max_tokens": 40})
    err = assert_error(r, 400, param="max_tokens")
    assert "64" in err["message"] and "70" in err["message"]
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 60},
    )
    err = assert_error(r, 400, param="max_completion_tokens")
    assert "64" in err["message"]


def test_a_prompt_text_too_long_for_the_context_is_refused_before_tokenizing(fake_server: Any) -> None:
    """No text of 64 tokens can have more than 64 x (the longest vocabulary entry) characters; a longer
    one is refused without being tokenized (a 100 MB prompt once held the tokenizer for 97 s and grew
    the server by 10 GB before its context-length 400)."""
    srv, _, _ = fake_server(max_model_len=64)
    ctx = srv.config.app.state.serving
    limit = ctx.max_prompt_chars
    longest = max(len(t) for t in ctx.tokenizer.get_vocab())
    assert limit == 64 * longest  # SmolLM2's byte-level BPE has no normalizer
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 1})
    err = assert_error(r, 400, param="prompt")
    assert f"{limit + 1} characters" in err["message"] and "64 tokens" in err["message"]
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": ["ok", "b" * (limit + 1)], "max_tokens": 1})
    assert "prompt 1 has" in assert_error(r, 400, param="prompt")["message"]
    half = "c" * (limit // 2 + 1)
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "system", "content": half}, {"role": "user", "content": half}], "max_tokens": 1},
    )
    assert "characters" in assert_error(r, 400, param="messages")["message"]
    # At the limit the text is tokenized and refused (or served) by its real token count.
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "a" * limit, "max_tokens": 1})
    err = assert_error(r, 400)
    assert "characters" not in err["message"] and "in the prompt" in err["message"]
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_request_bodies_over_the_limit_get_413_unparsed(fake_server: Any) -> None:
    srv, _eng, _ = fake_server(max_request_bytes=4096)
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = http.post(f"{srv.url}/v1/completions", content=big, headers={"content-type": "application/json"})
    err = assert_error(r, 413, param=None, code="request_too_large")
    assert "4096" in err["message"]

    def chunked():  # no Content-Length: counted while read
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    with httpx.Client(timeout=30) as c:  # a fresh connection: the 413 may close the one it was sent on
        r = c.post(f"{srv.url}/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")
    small = {"prompt": "Hi", "max_tokens": 2, "user": "u" * 3000}
    r = httpx.post(f"{srv.url}/v1/completions", json=small, timeout=30)  # just under: served
    assert r.status_code == 200, r.text
    with httpx.Client(timeout=30) as c:  # a small chunked body is reassembled whole
        body = json.dumps(small).encode()
        r = c.post(
            f"{srv.url}/v1/completions",
            content=iter([body[:10], body[10:]]),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200


def test_a_request_larger_than_the_whole_queue_is_400_not_503(fake_server: Any) -> None:
    """Retrying cannot help a request of more sequences than --max-waiting-requests: no Retry-After."""
    srv, eng, ae = fake_server(max_waiting_requests=4)
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
    err = assert_error(r, 400, param="prompt")
    assert "6 sequences" in err["message"] and "4" in err["message"] and "retry-after" not in r.headers
    r = http.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 5})
    assert_error(r, 400, param="n")
    assert ae.test_observer.rejected == 0 and not eng.added
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})  # exactly 4
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4


def test_the_prompt_union_keeps_each_form_and_validates_token_ids_without_trying_strings() -> None:
    """Token ids come first in the prompt union (a 2.5M-id prompt spent 0.6 s of the event loop
    while pydantic collected an error per id for the list[str] member); every form still parses
    as itself."""
    from servelm.server.protocol_completions import CompletionRequest

    def parsed(prompt: Any) -> Any:
        return CompletionRequest.model_validate({"prompt": prompt}).prompt

    assert parsed("x") == "x"
    assert parsed(["1", "2"]) == ["1", "2"]  # digit strings stay text
    assert parsed([3, 4]) == [3, 4] and parsed([[3], [4, 5]]) == [[3], [4, 5]]
    with pytest.raises(ValidationError):
        parsed(["a", 1])  # mixed lists are no form at all
    assert CompletionRequest.model_fields["prompt"].annotation.__args__[:3] == (str, list[int], list[str])


# ------------------------------------------------------------------------ one request, bounded in all


def _count_tokenizer_calls(srv: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the server's tokenizer from now on (its encode, and the chat template's)."""
    tok = srv.config.app.state.serving.tokenizer
    calls: list[int] = []
    for name in ("encode", "apply_chat_template"):
        real = getattr(tok, name)

        def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            calls.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tok, name, counted)
    return calls


def test_the_text_of_all_prompts_together_is_bounded_before_tokenizing(
    fake_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50 prompts, each under the bound, once held the one tokenizer thread for 55 s (a normal request
    sent meanwhile waited as long) and grew the server by 0.7 GB: the bound is on the request's text."""
    srv, eng, _ = fake_server(max_model_len=2048)
    limit = srv.config.app.state.serving.max_prompt_chars
    calls = _count_tokenizer_calls(srv, monkeypatch)
    big = {"prompt": ["a" * (limit // 10)] * 50, "max_tokens": 1}

    def refuse() -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        return httpx.post(f"{srv.url}/v1/completions", json=big, timeout=60), time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(refuse)
        t0 = time.monotonic()
        normal = http.post(f"{srv.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        normal_s = time.monotonic() - t0
        r, refused_s = pending.result()
    err = assert_error(r, 400, param="prompt")
    assert "50 prompts" in err["message"] and str(limit) in err["message"]
    assert refused_s < 1.0 and not calls[:-1]  # only the normal request was tokenized
    assert normal.status_code == 200 and normal_s < 1.0
    # Chat: the messages and the tools (rendered as JSON) count together.
    calls.clear()
    tool = {
        "type": "function",
        "function": {"name": "f", "description": "d" * (limit // 2), "parameters": {"type": "object"}},
    }
    half = {"role": "user", "content": "c" * (limit // 2)}
    r = http.post(f"{srv.url}/v1/chat/completions", json={"messages": [half], "tools": [tool], "max_tokens": 1})
    assert "messages and tools" in assert_error(r, 400, param="messages")["message"]
    r = http.post(f"{srv.url}/tokenize", json={"messages": [half], "tools": [tool]})
    assert_error(r, 400, param="messages")
    r = http.post(f"{srv.url}/v1/responses", json={"input": [half, half, half], "max_output_tokens": 1})
    assert_error(r, 400, param="input")
    assert not calls and not eng.added[1:]


def test_token_id_lists_are_bounded_by_the_context(fake_server: Any) -> None:
    srv, eng, _ = fake_server(max_model_len=64)
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": [[5] * 10, [5] * 65], "max_tokens": 1})
    assert "prompt 1 has 65 tokens" in assert_error(r, 400, param="prompt")["message"]
    r = http.post(f"{srv.url}/detokenize", json={"tokens": [5] * 65})
    assert_error(r, 400, param="tokens")
    assert http.post(f"{srv.url}/detokenize", json={"tokens": [5] * 64}).status_code == 200
    assert not eng.added


CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
TEXT = {"prompt": "x", "max_tokens": 1}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**TEXT, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ("/v1/responses", {"input": "x", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ("/v1/completions", {**TEXT, "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": CHAT["messages"] * (MAX_MESSAGES + 1)}, "messages"),
        ("/tokenize", {"messages": CHAT["messages"] * (MAX_MESSAGES + 1)}, "messages"),
        ("/v1/responses", {"input": CHAT["messages"] * (MAX_MESSAGES + 1)}, "input"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * (MAX_CONTENT_PARTS + 1)}]},
            "messages[0].content",
        ),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * (MAX_CONTENT_PARTS + 1)}]},
            "input[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    *CHAT["messages"],
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]
                        * (MAX_TOOL_CALLS + 1),
                    },
                ]
            },
            "messages[1].tool_calls",
        ),
        ("/v1/chat/completions", {**CHAT, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ("/v1/chat/completions", {**CHAT, "metadata": {"k" * 65: "v"}}, "metadata"),
        ("/v1/responses", {"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        (
            "/v1/completions",
            {**TEXT, "structured_outputs": {"regex": "|".join(f"w{i}" for i in range(MAX_SPEC_CHARS // 4))}},
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            {**TEXT, "structured_outputs": {"choice": [f"choice {i}" for i in range(MAX_SPEC_CHARS // 10)]}},
            "structured_outputs.choice",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"description": "d" * MAX_SPEC_CHARS}},
                },
            },
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", {"prompt": ["a"] * (MAX_JSON_ITEMS + 1), "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[5]] * (MAX_JSON_ITEMS + 1), "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "metadata": {"k": [[]] * (MAX_JSON_ITEMS + 1)}}, "metadata.k"),
    ],
)
def test_every_list_and_string_a_request_carries_is_bounded(
    shared_fake_server: Any, path: str, body: dict, param: str
) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    t0 = time.monotonic()
    err = assert_error(http.post(srv.url + path, json=body), 400, param=param)
    assert time.monotonic() - t0 < 1.0, err
    assert len(eng.added) == before


def test_a_conversation_continued_past_the_message_bound_is_400(fake_server: Any) -> None:
    srv, _, _ = fake_server(max_model_len=32768)
    turn = [{"role": "user", "content": "x"}]
    first = http.post(srv.url + "/v1/responses", json={"input": turn * (MAX_MESSAGES - 10), "max_output_tokens": 1})
    assert first.status_code == 200, first.text
    body = {"input": turn * 20, "previous_response_id": first.json()["id"], "max_output_tokens": 1}
    err = assert_error(http.post(srv.url + "/v1/responses", json=body), 400, param="input")
    assert str(MAX_MESSAGES) in err["message"]


def test_at_the_bounds_requests_are_served(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    ok = [
        ("/v1/completions", {**TEXT, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)}}),
        ("/v1/completions", {**TEXT, "stop_token_ids": [5] * MAX_STOP_TOKEN_IDS}),
        ("/v1/chat/completions", {**CHAT, "metadata": {str(i): "v" * 512 for i in range(16)}}),
        ("/v1/completions", {"prompt": list(range(100, 200)), "max_tokens": 1}),  # token ids: not items
    ]
    for path, body in ok:
        r = http.post(srv.url + path, json=body)
        assert r.status_code == 200, (path, r.text)


def test_nesting_is_bounded_before_anything_recursive_runs(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(12):  # OpenAI's structured outputs nest objects 10 deep: ~40 JSON levels here
        schema = {"type": "object", "properties": {"a": {"anyOf": [schema, {"type": "null"}]}}}
    r = http.post(
        srv.url + "/v1/chat/completions",
        json={**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
    )
    assert r.status_code == 200, r.text
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    r = http.post(srv.url + "/v1/completions", json={**TEXT, "structured_outputs": {"json": {"a": deep}}})
    err = assert_error(r, 400)
    assert (
        err["param"].startswith("structured_outputs.json.a[0][0]") and f"deeper than {MAX_JSON_DEPTH}" in err["message"]
    )


def test_lora_names_and_paths_are_bounded() -> None:
    from pydantic import ValidationError

    from servelm.server.limits import MAX_LORA_NAME_CHARS, MAX_PATH_CHARS
    from servelm.server.serving_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    with pytest.raises(ValidationError):
        LoadLoRAAdapterRequest(lora_name="n" * (MAX_LORA_NAME_CHARS + 1), lora_path="/p")
    with pytest.raises(ValidationError):
        LoadLoRAAdapterRequest(lora_name="n", lora_path="/" * (MAX_PATH_CHARS + 1))
    with pytest.raises(ValidationError):
        UnloadLoRAAdapterRequest(lora_name="n" * (MAX_LORA_NAME_CHARS + 1))


def test_sampling_params_hold_the_per_step_bounds_offline_too() -> None:
    """The engine trusts SamplingParams: offline use gets the same bounds the HTTP edge documents."""
    from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams

    SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert e.value.param == "stop_token_ids"
