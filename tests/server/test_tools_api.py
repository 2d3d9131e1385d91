"""Tool calling at the edge (a scripted engine): what is refused, what reaches the engine, how the
history and the tools are rendered, and how constrained text becomes ``tool_calls``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from srv_harness import assert_error

from servelm.server.protocol_chat import ChatCompletionRequest
from servelm.server.serving_chat import _StreamedCalls
from servelm.server.tools import ToolMode, tool_mode

http = httpx.Client(timeout=30)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(srv: Any, **body: Any) -> httpx.Response:
    return http.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "florp"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "tool", "content": "12 C"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_what_cannot_be_served_is_400_naming_the_field(shared_fake_server: Any, body: dict, param: str) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    assert_error(chat(srv, **body), 400, param=param)
    assert len(eng.added) == before


def test_tool_choice_none_ignores_the_tools(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    r = chat(srv, tools=[WEATHER], tool_choice="none")
    assert r.status_code == 200 and eng.last_params.structured_output is None
    assert "get_weather" not in eng.tokenizer.decode(eng.prompts[-1])
    assert r.json()["choices"][0]["message"]["content"]


def test_required_and_named_calls_constrain_the_output_and_describe_the_tools(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    assert chat(srv, tools=[WEATHER, CLOCK], tool_choice="required").status_code == 200
    so = eng.last_params.structured_output
    schema = json.loads(so.value)
    assert so.compiled is not None and schema["type"] == "array" and schema["minItems"] == 1
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    # The default model's template has no tools: they are described in the system message.
    prompt = eng.tokenizer.decode(eng.prompts[-1])
    assert prompt.startswith("<|im_start|>system\nYou can call these functions:") and '"get_time"' in prompt
    assert chat(srv, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False).status_code == 200
    assert json.loads(eng.last_params.structured_output.value)["maxItems"] == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(srv, tools=[WEATHER, CLOCK], tool_choice=named).status_code == 200
    assert json.loads(eng.last_params.structured_output.value) == WEATHER["function"]["parameters"]
    assert "Call the function get_weather" in eng.tokenizer.decode(eng.prompts[-1])


def test_auto_lets_the_first_character_choose_between_text_and_calls(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    for extra in ({}, {"tool_choice": "auto"}):  # "auto" is the default with tools
        r = chat(srv, tools=[WEATHER, CLOCK], **extra)
        assert r.status_code == 200, r.text
        so = eng.last_params.structured_output
        assert so.kind == "grammar" and so.compiled is not None and so.value.startswith("start: calls | TEXT")
        prompt = eng.tokenizer.decode(eng.prompts[-1])
        assert "otherwise answer normally" in prompt and '"get_time"' in prompt
        # The scripted engine's text does not start with "[": a plain answer, no calls.
        msg = r.json()["choices"][0]
        assert msg["message"]["content"] and "tool_calls" not in msg["message"] and msg["finish_reason"] != "tool_calls"


def test_history_with_calls_and_results_is_rendered(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
    ]
    r = chat(srv, messages=history, tools=[WEATHER], tool_choice="none")
    assert r.status_code == 200, r.text
    prompt = eng.tokenizer.decode(eng.prompts[-1])
    assert '<|im_start|>assistant\n[{"name": "get_weather", "parameters": {"city": "Paris"}}]<|im_end|>' in prompt
    assert "<|im_start|>tool\n12 C, cloudy<|im_end|>" in prompt


def _mode(body: dict) -> ToolMode:
    mode = tool_mode(ChatCompletionRequest(messages=ASK, **body))
    assert mode is not None
    return mode


def test_constrained_text_parses_into_openai_tool_calls() -> None:
    required = _mode({"tools": [WEATHER, CLOCK], "tool_choice": "required"})
    calls = required.parse(
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    )
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert (
        all(c["type"] == "function" and c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    )
    assert required.parse('[{"name": "get_weather", "param') is None  # cut by max_tokens
    named = _mode({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    (call,) = named.parse('{"city": "Rome"}')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_auto_parses_an_array_and_leaves_text_alone() -> None:
    auto = _mode({"tools": [WEATHER]})
    assert auto.auto and auto.is_call("[{") and not auto.is_call("Sure")
    assert auto.parse("The weather is fine.") is None
    (call,) = auto.parse('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert call["function"]["name"] == "get_weather"
    streamed = _StreamedCalls(auto, 2)
    assert streamed.delta(0, "It is", finished=False) == ({"content": "It is"}, False)
    assert streamed.delta(0, " sunny.", finished=True) == ({"content": " sunny."}, False)
    assert streamed.delta(1, '[{"name": "get_weather", "parameters": ', finished=False) == (None, False)
    done, called = streamed.delta(1, '{"city": "Oslo"}}]', finished=True)
    assert called and done["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_auto_grammar_constrains_calls_and_frees_text(tiny_llama_dir: Any) -> None:
    """Through the compiler: text answers pass untouched, an answer that starts with "[" must be a
    valid call, and free text may not start with "[" or whitespace."""
    from servelm.runtime.tokenizer import load_tokenizer
    from servelm.scheduler.structured_output import GrammarCompiler

    tok = load_tokenizer(tiny_llama_dir)
    matcher = GrammarCompiler(tok, 49152, [2]).compile(_mode({"tools": [WEATHER, CLOCK]}).structured_output()).matcher

    def fits(text: str) -> bool:
        m = matcher()
        try:
            for t in tok.encode(text, add_special_tokens=False):
                m.accept(t)
        except ValueError:
            return False
        return True

    assert fits("It is sunny in Paris [citation needed].")
    assert fits('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    assert fits('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert not fits('[{"name": "get_news", "parameters": {}}]')  # not a declared tool
    assert not fits('[{"name": "get_weather", "parameters": {}}]')  # its required "city" is missing
    assert not fits("[1, 2, 3]")
    assert not fits(" leading space")


def test_streamed_calls() -> None:
    named = _StreamedCalls(
        _mode({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}), 1
    )
    first, called = named.delta(0, '{"ci', finished=False)
    (c,) = first["tool_calls"]
    assert called and c["id"].startswith("call_") and c["function"] == {"name": "get_weather", "arguments": '{"ci'}
    nxt, _ = named.delta(0, 'ty": "Rome"}', finished=True)
    assert nxt == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}
    required = _StreamedCalls(_mode({"tools": [WEATHER], "tool_choice": "required"}), 2)
    assert required.delta(0, '[{"name": "get_weather", ', finished=False) == (None, False)
    done, called = required.delta(0, '"parameters": {"city": "Oslo"}}]', finished=True)
    assert called and done["tool_calls"][0]["index"] == 0 and done["tool_calls"][0]["function"]["name"] == "get_weather"
    cut, called = required.delta(1, '[{"na', finished=True)
    assert not called and cut == {"content": '[{"na'}


def test_the_calls_before_a_cut_are_calls() -> None:
    # max_tokens ended the array inside its second call: the first is whole and comes back as a call.
    whole = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for mode in (_mode({"tools": [WEATHER, CLOCK], "tool_choice": "required"}), _mode({"tools": [WEATHER, CLOCK]})):
        for cut in (f'[{whole}, {{"name": "get_ti', f"[{whole}, ", f"[ {whole}\n,\n  {{", f"[{whole}"):
            (call,) = mode.parse(cut) or ()
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            assert mode.answer(cut)[0] is None
        assert mode.parse('[{"name": "get_weather", "parameters": {"city": "Par') is None  # no whole call: content
    streamed = _StreamedCalls(_mode({"tools": [WEATHER, CLOCK], "tool_choice": "required"}), 1)
    done, called = streamed.delta(0, f'[{whole}, {{"name": "get_time", "param', finished=True)
    assert called and [c["function"]["name"] for c in done["tool_calls"]] == ["get_weather"]
