"""``/v1/responses`` over a scripted engine: the official SDK's types accept what we send, the request
reaches the engine as the equivalent chat request would, streams announce what the response holds,
stored responses continue a conversation, and what cannot be served is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from srv_harness import assert_error, typed_sse_events

from servelm.server.protocol_responses import ResponsesRequest
from servelm.server.response_store import ResponseStore, StoredResponse
from servelm.server.responses_events import StreamedOutput
from servelm.server.responses_input import responses_param, to_chat_request
from servelm.server.serving_responses import _Response
from servelm.server.tools import tool_mode

http = httpx.Client(timeout=30)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def post(srv: Any, **body: Any) -> httpx.Response:
    return http.post(srv.url + "/v1/responses", json={"max_output_tokens": 5, **body})


def chat(srv: Any, **body: Any) -> httpx.Response:
    return http.post(srv.url + "/v1/chat/completions", json={"max_tokens": 5, **body})


def events(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event; the data checked against the SDK's event types."""
    out = typed_sse_events(r)
    for _, data in out:
        EVENTS.validate_python(data)
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    return out


def test_text_response_is_the_chat_answer_and_matches_the_sdk_types(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    r = post(
        srv, input="Hello there", instructions="Be brief.", temperature=0.5, top_p=0.9, seed=7, metadata={"k": "v"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    Response.model_validate(body)  # the SDK's own model, required fields and all
    prompt, params = eng.prompts[-1], eng.last_params
    c = chat(srv, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert eng.prompts[-1] == prompt  # the same rendered prompt as the equivalent chat request
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (5, 0.5, 0.9, 7)
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == "fake-model"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"][0]["text"] == c.json()["choices"][0]["message"]["content"] == eng.expected_text(5)
    # The scripted engine always runs to max_tokens: OpenAI calls that incomplete.
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert item["status"] == "incomplete"
    assert body["usage"]["input_tokens"] == len(prompt) and body["usage"]["output_tokens"] == 5
    assert body["usage"]["total_tokens"] == len(prompt) + 5
    assert (body["instructions"], body["metadata"], body["temperature"], body["store"]) == (
        "Be brief.",
        {"k": "v"},
        0.5,
        True,
    )


def test_the_official_sdk_reads_responses_and_streams(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="fake-model", input="Hi", max_output_tokens=4)
    assert r.output_text == eng.expected_text(4)
    stream = client.responses.create(model="fake-model", input="Hi", max_output_tokens=4, stream=True)
    deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text and len(deltas) == 4


def test_stream_events_announce_what_the_response_holds(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    evs = events(post(srv, input="Hello", stream=True, max_output_tokens=3))
    names = [n for n, _ in evs]
    assert names == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    created, final = evs[0][1]["response"], evs[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
    assert text == eng.expected_text(3) == final["output"][0]["content"][0]["text"]
    assert evs[-2][1]["item"] == final["output"][0]
    assert final["usage"]["output_tokens"] == 3
    # Stored like a non-streamed response.
    assert http.get(f"{srv.url}/v1/responses/{final['id']}").json() == final


def test_logprobs_are_included_when_asked(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    body = post(srv, input="Hi", include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=3).json()
    Response.model_validate(body)
    assert eng.last_params.logprobs == 2
    lps = body["output"][0]["content"][0]["logprobs"]
    assert len(lps) == 3 and all(lp["logprob"] == -0.25 and len(lp["top_logprobs"]) == 2 and lp["bytes"] for lp in lps)
    assert "".join(lp["token"] for lp in lps) == eng.expected_text(3)
    plain = post(srv, input="Hi", top_logprobs=2).json()  # OpenAI: only with the include
    assert eng.last_params.logprobs is None and plain["output"][0]["content"][0]["logprobs"] == []
    evs = events(
        post(
            srv, input="Hi", include=["message.output_text.logprobs"], top_logprobs=1, max_output_tokens=2, stream=True
        )
    )
    assert [len(d["logprobs"]) for n, d in evs if n == "response.output_text.delta"] == [1, 1]


def test_items_reach_the_engine_as_the_equivalent_chat_history(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 C, cloudy"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It is 12 C.", "annotations": []}],
        },
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert post(srv, input=items, tools=[WEATHER], tool_choice="required").status_code == 200
    prompt, so = eng.prompts[-1], eng.last_params.structured_output
    messages = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
        {"role": "assistant", "content": "It is 12 C."},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    assert chat(srv, messages=messages, tools=[CHAT_WEATHER], tool_choice="required").status_code == 200
    assert eng.prompts[-1] == prompt
    assert eng.last_params.structured_output.value == so.value and so.compiled is not None
    named = post(srv, input="Paris?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert named.status_code == 200 and json.loads(eng.last_params.structured_output.value) == WEATHER["parameters"]
    Response.model_validate(named.json())
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    r = post(srv, input="A city?", text={"format": fmt})
    assert r.status_code == 200 and json.loads(eng.last_params.structured_output.value) == schema
    assert r.json()["text"]["format"] == fmt
    assert post(srv, input="JSON?", text={"format": {"type": "json_object"}}).status_code == 200
    assert eng.last_params.structured_output.value == '{"type": "object"}'


def test_previous_response_id_continues_the_stored_conversation(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    first = post(srv, input="My name is Ada.", instructions="Be terse.", max_output_tokens=3).json()
    second = post(srv, input="What is my name?", previous_response_id=first["id"], max_output_tokens=2)
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == first["id"]
    answer = first["output"][0]["content"][0]["text"]
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "What is my name?"},
    ]
    prompt = eng.prompts[-1]
    chat(srv, messages=messages)
    assert eng.prompts[-1] == prompt  # instructions do not carry over; the answer does
    third = post(srv, input="Again?", previous_response_id=second.json()["id"]).json()
    assert "My name is Ada." in eng.tokenizer.decode(eng.prompts[-1]) and third["status"] == "incomplete"
    # store: false keeps nothing.
    unstored = post(srv, input="x", store=False).json()
    assert unstored["store"] is False
    assert_error(http.get(f"{srv.url}/v1/responses/{unstored['id']}"), 404, param="response_id", code="not_found")
    assert_error(post(srv, input="y", previous_response_id=unstored["id"]), 400, param="previous_response_id")
    # GET returns it; DELETE removes it.
    assert http.get(f"{srv.url}/v1/responses/{first['id']}").json() == first
    assert http.delete(f"{srv.url}/v1/responses/{first['id']}").json() == {
        "id": first["id"],
        "object": "response",
        "deleted": True,
    }
    assert_error(http.get(f"{srv.url}/v1/responses/{first['id']}"), 404)
    assert_error(http.delete(f"{srv.url}/v1/responses/{first['id']}"), 404)
    r = http.put(f"{srv.url}/v1/responses/{first['id']}")
    assert_error(r, 405)
    assert r.headers["allow"] == "DELETE, GET"  # both routes' methods


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]},
            "input[0].arguments",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "florp"}}], "tool_choice": "required"}, "tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "florp"}}}},
            "text.format.schema",
        ),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "include": ["everything"]}, "include[0]"),
        ({"input": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_what_cannot_be_served_is_400_naming_the_field(shared_fake_server: Any, body: dict, param: str) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    assert_error(http.post(srv.url + "/v1/responses", json=body), 400, param=param)
    assert len(eng.added) == before


def test_unknown_model_and_too_long_input(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    assert_error(post(srv, input="x", model="gpt-9"), 404, param="model", code="model_not_found")
    # Longer than any max_model_len tokens can spell: refused before tokenizing.
    limit = srv.config.app.state.serving.max_prompt_chars
    assert_error(post(srv, input="x" * (limit + 1)), 400, param="input")
    assert_error(
        post(srv, input=[{"role": "user", "content": "ok"}, {"role": "user", "content": "x" * limit}]),
        400,
        param="input",
    )
    # Too long with the tokens asked for (the scripted engine names max_tokens): the Responses name.
    assert_error(post(srv, input="word " * 300), 400, param="max_output_tokens")
    assert len(eng.added) == before


def test_error_fields_are_named_as_the_responses_api_names_them() -> None:
    where = ["instructions", "input[0]", "input[2]"]
    assert responses_param("messages[1].content[0].type", where) == "input[0].content[0].type"
    assert responses_param("messages[2].tool_calls[0].function.arguments", where) == "input[2].arguments"
    assert responses_param("messages[2].tool_call_id", where) == "input[2].call_id"
    assert responses_param("tools[3].function.parameters", where) == "tools[3].parameters"
    assert responses_param("max_completion_tokens", where) == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema", where) == "text.format.schema"
    assert responses_param("seed", where) == "seed" and responses_param(None, where) is None


def test_consecutive_function_calls_are_one_assistant_turn() -> None:
    call = {"type": "function_call", "name": "get_weather", "arguments": "{}"}
    req = ResponsesRequest(
        input=[{"role": "user", "content": "Both?"}, {**call, "call_id": "a"}, {**call, "call_id": "b"}]
    )
    chat, where = to_chat_request(req, [])
    assert [m.role for m in chat.messages] == ["user", "assistant"] and where == ["input[0]", "input[1]"]
    assert [c.id for c in chat.messages[1].tool_calls] == ["a", "b"]


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("b") is None and store.get("a") is not None
    assert store.delete("a") and not store.delete("a")
    off = ResponseStore(capacity=0)
    off.put("x", StoredResponse({}, []))
    assert len(off) == 0


# ---- streamed tool calls, without a server ----------------------------------------------------------


class _Job(_Response):
    def __init__(self, body: dict[str, Any]) -> None:
        chat, _ = to_chat_request(ResponsesRequest(input="Weather?", **body), [])
        self.tools = tool_mode(chat)
        self.message_id = "msg_1"
        self.seq = 0


def _run(
    body: dict[str, Any], pieces: list[str], reason: str = "stop"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    job = _Job(body)
    out = StreamedOutput(job)
    raw: list[bytes] = []
    for k, p in enumerate(pieces):
        raw += out.add(p, [], reason if k == len(pieces) - 1 else None)
    evs = [json.loads(e.decode().split("\ndata: ")[1]) for e in raw]
    for e in evs:
        EVENTS.validate_python(e)
    return evs, out.output


def test_a_named_function_streams_its_arguments() -> None:
    evs, output = _run(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, ['{"city"', ': "Rome"}']
    )
    assert [e["type"] for e in evs] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    (item,) = output
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert json.loads(item["arguments"]) == {"city": "Rome"} == json.loads("".join(e["delta"] for e in evs[1:3]))
    assert evs[0]["item"]["call_id"] == item["call_id"] and evs[0]["item"]["id"] == item["id"]


def test_an_array_of_calls_is_announced_when_it_parses() -> None:
    text = [
        '[{"name": "get_weather", ',
        '"parameters": {"city": "Oslo"}}, ',
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]',
    ]
    evs, output = _run({"tools": [WEATHER], "tool_choice": "required"}, text)
    assert [e["type"] for e in evs].count("response.output_item.done") == 2
    assert [json.loads(o["arguments"]) for o in output] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.added"] == [0, 1]
    assert output[0]["call_id"] != output[1]["call_id"]
    # "auto": the first character decides; text streams as text.
    evs, output = _run({"tools": [WEATHER]}, ["It is", " sunny."])
    assert "".join(e.get("delta", "") for e in evs if e["type"] == "response.output_text.delta") == "It is sunny."
    assert output[0]["type"] == "message" and output[0]["content"][0]["text"] == "It is sunny."
    # Cut by max_output_tokens before the array closed: the text as an incomplete message.
    evs, output = _run({"tools": [WEATHER], "tool_choice": "required"}, ['[{"na'], reason="length")
    assert output[0]["type"] == "message" and output[0]["status"] == "incomplete"
    assert output[0]["content"][0]["text"] == '[{"na'


def _wait(cond: Any, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_client_that_leaves_has_its_response_aborted(fake_server: Any) -> None:
    import socket

    srv, eng, _ = fake_server(step_time=0.01)
    with http.stream(
        "POST", f"{srv.url}/v1/responses", json={"input": "x", "max_output_tokens": 200, "stream": True}
    ) as r:
        it = r.iter_raw()
        next(it)
    _wait(lambda: len(eng.aborted) == 1)
    body = json.dumps({"input": "x", "max_output_tokens": 200}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    _wait(lambda: len(eng.added) == 2 and eng.steps > 2)
    s.close()
    _wait(lambda: len(eng.aborted) == 2)
    _wait(lambda: eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished_requests())
    # An engine failure mid-stream ends the stream with response.failed, and the server stays up.
    evs = events(post(srv, input="FAIL_ME", stream=True))
    assert [n for n, _ in evs][-1] == "response.failed" and evs[-1][1]["response"]["error"]["code"] == "server_error"
    assert_error(post(srv, input="FAIL_ME"), 500)
    assert http.get(f"{srv.url}/health").status_code == 200
