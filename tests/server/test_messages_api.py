"""``/v1/messages`` (Anthropic's Messages API) driven by the official ``anthropic`` SDK: over a scripted engine,
the request reaches the engine as the equivalent chat request would, streams announce what the message
holds, errors come back in Anthropic's shape with the SDK's exception classes; on the default model
(greedy), the answer's tokens are the chat answer's, tool calls complete two turns, stop sequences stop."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest
from srv_harness import ServerThread, typed_sse_events

from servelm.scheduler.config import EngineConfig
from servelm.server.app import build_app
from servelm.server.async_engine import AsyncEngine
from servelm.server.errors import error_response, queue_full, unavailable

http = httpx.Client(timeout=60)
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    # No other properties: the default model, unconstrained, invents more and runs past max_tokens.
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


def client(srv: Any, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=120, **kw)


def post(srv: Any, path: str = "/v1/messages", headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return http.post(srv.url + path, json={"max_tokens": 5, "messages": ASK, **body}, headers=headers)


def chat(srv: Any, **body: Any) -> httpx.Response:
    return http.post(srv.url + "/v1/chat/completions", json={"max_tokens": 5, **body})


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


# -------------------------------------------------------------------------------- scripted engine


def test_create_is_the_chat_request_and_reads_as_the_sdk_message(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    msg = client(srv).messages.create(
        model="fake-model",
        max_tokens=5,
        system="Be brief.",
        messages=ASK,
        metadata={"user_id": "u-1"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},  # SDK 2.x has no sampling keywords
    )
    prompt, params = eng.prompts[-1], eng.last_params
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    c = chat(srv, messages=messages, temperature=0.5, top_p=0.9, top_k=7).json()
    assert eng.prompts[-1] == prompt  # the same rendered prompt as the equivalent chat request
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (5, 0.5, 0.9, 7)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == "fake-model"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == c["choices"][0]["message"]["content"] == eng.expected_text(5)
    assert (msg.stop_reason, msg.stop_sequence) == ("max_tokens", None)  # the script always runs to max_tokens
    assert (msg.usage.input_tokens, msg.usage.output_tokens, msg.usage.cache_read_input_tokens) == (len(prompt), 5, 0)
    # System blocks (cache_control accepted and ignored) render as the string does.
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    assert post(srv, system=system, anthropic_version="ignored").status_code == 200
    assert eng.prompts[-1] == prompt
    counted = client(srv).messages.count_tokens(model="fake-model", system="Be brief.", messages=ASK)
    assert counted.input_tokens == msg.usage.input_tokens


def test_stream_events_and_the_sdk_stream_helper(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    evs = typed_sse_events(post(srv, stream=True, max_tokens=3))
    assert [n for n, _ in evs] == [
        "message_start", "ping", "content_block_start", *["content_block_delta"] * 3, "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = evs[0][1]["message"]
    assert (
        start["content"] == []
        and start["stop_reason"] is None
        and start["usage"]["input_tokens"] == len(eng.prompts[-1])
    )
    assert evs[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta") == eng.expected_text(3)
    assert (
        evs[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        and evs[-2][1]["usage"]["output_tokens"] == 3
    )
    with client(srv).messages.stream(
        model="fake-model", max_tokens=4, messages=ASK, extra_headers={"anthropic-version": "2023-06-01"}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == eng.expected_text(4)
    assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == (
        "max_tokens",
        4,
        len(eng.prompts[-1]),
    )
    # Under tool_choice auto, an answer that does not start a call streams as text.
    evs = typed_sse_events(post(srv, stream=True, max_tokens=2, tools=[WEATHER]))
    assert [d["delta"]["type"] for n, d in evs if n == "content_block_delta"] == ["text_delta"] * 2
    assert evs[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_unknown_fields_are_ignored_and_named(shared_fake_server: Any) -> None:
    srv, _, _ = shared_fake_server
    r = post(srv, cache_control={"type": "ephemeral"}, speed="fast", thinking={"type": "disabled"})
    assert r.status_code == 200 and r.headers["x-servelm-ignored-fields"] == "cache_control, speed"
    schema = http.get(srv.url + "/openapi.json").json()
    responses = schema["paths"]["/v1/messages"]["post"]["responses"]
    assert sorted(responses) == ["200", "400", "401", "404", "413", "500", "503", "529"]
    assert responses["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AnthropicErrorResponse"
    }


def test_tool_history_and_tool_choice_reach_the_engine_as_chat_would_send_them(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12 C"}], "is_error": False},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]  # fmt: skip
    chat_history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "12 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    for choice, chat_choice in [
        ({"type": "any"}, "required"),
        ({"type": "auto"}, "auto"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
        ({"type": "none"}, "none"),
    ]:
        assert post(srv, messages=history, tools=[WEATHER], tool_choice=choice).status_code == 200
        prompt, so = eng.prompts[-1], eng.last_params.structured_output
        assert chat(srv, messages=chat_history, tools=[CHAT_WEATHER], tool_choice=chat_choice).status_code == 200
        assert eng.prompts[-1] == prompt, choice
        assert (so and so.value) == (eng.last_params.structured_output and eng.last_params.structured_output.value), (
            choice
        )
        assert (so is None) == (choice["type"] == "none")
    # disable_parallel_tool_use is chat's parallel_tool_calls: false (at most one call).
    post(srv, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert json.loads(eng.last_params.structured_output.value)["maxItems"] == 1
    counted = post(
        srv, "/v1/messages/count_tokens", messages=history, tools=[WEATHER], tool_choice={"type": "any"}
    ).json()
    assert counted == {
        "input_tokens": post(srv, messages=history, tools=[WEATHER], tool_choice={"type": "any"}).json()["usage"][
            "input_tokens"
        ]
    }


@pytest.mark.parametrize(
    "body, where",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}, "mcp_servers"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [*ASK, {"role": "assistant", "content": "The answer is"}]}, "messages[1].role"),
        ({"tools": [{**WEATHER, "name": "has space"}]}, "tools[0].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": None}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
    ],
)
def test_what_cannot_be_served_is_an_anthropic_400_naming_the_field(
    shared_fake_server: Any, body: dict, where: str
) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    assert where in assert_anthropic_error(post(srv, **body), 400, "invalid_request_error")
    assert len(eng.added) == before


def test_errors_raise_the_sdk_exception_classes(fake_server: Any) -> None:
    srv, _eng, _ = fake_server(api_key="sk-test")
    ok = client(srv, api_key="sk-test").messages.create(model="fake-model", max_tokens=2, messages=ASK)
    assert ok.usage.output_tokens == 2
    bearer = anthropic.Anthropic(base_url=srv.url, auth_token="sk-test", max_retries=0)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model="fake-model", messages=ASK).input_tokens == ok.usage.input_tokens
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(srv, api_key="wrong").messages.create(model="fake-model", max_tokens=2, messages=ASK)
    assert auth.value.body["error"]["type"] == "authentication_error"
    good = client(srv, api_key="sk-test")
    with pytest.raises(anthropic.NotFoundError) as missing:
        good.messages.create(model="no-such-model", max_tokens=2, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        good.messages.create(model="fake-model", max_tokens=2, messages=ASK, extra_body={"top_p": 3.0})
    with pytest.raises(anthropic.BadRequestError):
        good.messages.count_tokens(
            model="fake-model", messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]
        )
    # A request failing inside the engine mid-stream ends with Anthropic's error event, which the SDK raises.
    headers = {"x-api-key": "sk-test"}
    evs = typed_sse_events(post(srv, headers=headers, stream=True, messages=[{"role": "user", "content": "FAIL_ME"}]))
    assert evs[0][0] == "message_start" and evs[-1] == ("error", {"type": "error", "error": evs[-1][1]["error"]})
    assert evs[-1][1]["error"]["type"] == "api_error"
    with (
        pytest.raises(anthropic.APIStatusError),
        good.messages.stream(model="fake-model", max_tokens=2, messages=[{"role": "user", "content": "FAIL_ME"}]) as s,
    ):
        s.get_final_message()
    # OpenAI's paths keep OpenAI's shape, and take the key either way too.
    r = http.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "model": "nope"}, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_full_queue_is_529_overloaded(fake_server: Any) -> None:
    srv, eng, _ = fake_server(max_num_seqs=1, max_waiting_requests=1, step_time=0.02)
    results: list[int] = []

    def call() -> None:
        results.append(post(srv, max_tokens=30).status_code)

    threads = [threading.Thread(target=call) for _ in range(2)]  # 1 running + 1 waiting
    threads[0].start()
    _wait(lambda: len(eng.added) == 1)  # (adds still in the inbox count as waiting)
    threads[1].start()
    _wait(lambda: len(eng.added) == 2)
    with pytest.raises(anthropic.OverloadedError) as full:
        client(srv).messages.create(model="fake-model", max_tokens=1, messages=ASK)
    assert full.value.status_code == 529 and full.value.response.headers["retry-after"] == "1"
    assert full.value.body["error"]["type"] == "overloaded_error"
    for t in threads:
        t.join()
    assert results == [200, 200]


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_overloaded_and_unavailable_statuses() -> None:
    status, body = 529, {"type": "error", "error": {"type": "overloaded_error"}}
    r = error_response(queue_full(8), "/v1/messages")
    assert (
        r.status_code == status
        and json.loads(r.body)["error"]["type"] == body["error"]["type"]
        and r.headers["retry-after"] == "1"
    )
    r = error_response(unavailable("The server is shutting down.", code="shutting_down"), "/v1/messages/count_tokens")
    assert r.status_code == 503 and json.loads(r.body)["error"]["type"] == "api_error"
    assert error_response(queue_full(8), "/v1/chat/completions").status_code == 503


# -------------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def live() -> Iterator[ServerThread]:
    from servelm.scheduler.engine import Engine

    engine = Engine(EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=1024, max_num_seqs=4))
    srv = ServerThread(build_app(AsyncEngine(engine))).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow  # an engine on the default model
def test_greedy_tokens_are_the_chat_requests(live: ServerThread) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    msg = client(live).messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=24, extra_body=GREEDY, messages=messages
    )
    c = chat(live, messages=messages, max_tokens=24, temperature=0).json()
    ids = http.post(live.url + "/v1/chat/completions/render", json={"messages": messages}).json()["token_ids"]
    assert msg.content[0].text == c["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert msg.usage.output_tokens == c["usage"]["completion_tokens"] and msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(ids) == c["usage"]["prompt_tokens"]
    assert client(live).messages.count_tokens(model="SmolLM2-135M-Instruct", messages=messages).input_tokens == len(ids)
    # A stop sequence ends the answer before it and is named.
    cut = client(live).messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=24, extra_body=GREEDY, messages=messages, stop_sequences=["Paris"]
    )
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == (
        "stop_sequence",
        "Paris",
        "The capital of France is ",
    )


@pytest.mark.slow  # an engine on the default model
def test_tools_across_two_turns(live: ServerThread) -> None:
    sdk = client(live)
    # One call (left to repeat, the default model calls get_weather again and again, past max_tokens).
    one = {"type": "any", "disable_parallel_tool_use": True}
    first = sdk.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=40, extra_body=GREEDY, messages=ASK, tools=[WEATHER], tool_choice=one
    )
    assert first.stop_reason == "tool_use", first
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and isinstance(call.input["city"], str)
    # The same call, streamed: the SDK assembles the input from input_json_delta events.
    with sdk.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=40, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                             tool_choice={"type": "tool", "name": "get_weather"}) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert (
        streamed.stop_reason == "tool_use"
        and streamed.content[0].type == "tool_use"
        and streamed.content[0].name == "get_weather"
    )
    assert isinstance(streamed.content[0].input, dict) and "city" in streamed.content[0].input
    # Calls to any tool are announced whole once the output parses: the same call as unstreamed.
    with sdk.messages.stream(
        model="SmolLM2-135M-Instruct", max_tokens=40, extra_body=GREEDY, messages=ASK, tools=[WEATHER], tool_choice=one
    ) as stream:
        assert [(b.name, b.input) for b in stream.get_final_message().content] == [(call.name, call.input)]
    second = sdk.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=16, extra_body=GREEDY, tools=[WEATHER],
        messages=[*ASK, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12 C and cloudy"}]}],
    )  # fmt: skip
    assert (
        second.content[0].type == "text" and second.content[0].text and second.stop_reason in ("end_turn", "max_tokens")
    )
    none = sdk.messages.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=8,
        extra_body=GREEDY,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    assert none.content[0].type == "text"
