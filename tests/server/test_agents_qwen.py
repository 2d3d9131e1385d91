"""Agent loops on a real chat model trained for tools: Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file, served as
stored with ``--tool-call-parser hermes --enable-auto-tool-choice`` and its own chat template, driven at
temperature 0 by the clients agents use: the OpenAI SDK, the Anthropic SDK on /v1/messages and LangChain's
``ChatOpenAI.bind_tools`` (issue 43, items 2 and 4).

Under "auto" this model does not write ``<tool_call>`` blocks: asked for the weather it answers with a bare
``{"name": "get_weather", "arguments": {"city": "Paris"}}``, which the server reads as the call it is (it
names a declared tool and its arguments fit the schema). Given the tool's result, it does not answer in a
sentence: it writes its call again and then the result it was given, ``{"sky": "sunny", "temperature_c":
22}``, and ends (the same with the Anthropic and LangChain clients). That final text is no call (two objects
are not one call) and carries the result, which is what these loops check; the 1.5B answers in a sentence
(scripts/bench_agents.py, docs/tools.md). A normal answer that contains JSON stays an answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scripted_model import anthropic_client, openai_client
from srv_harness import ServerThread

from servelm.server.tool_parsers import PARSERS

pytestmark = pytest.mark.slow  # a real model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB) behind a server

MODEL = "qwen05"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Get the current local time in a city", "parameters": CITY},
    },
]
ASK = "What is the weather like in Paris right now?"
RESULT = json.dumps({"city": "Paris", "sky": "sunny", "temperature_c": 22})


@pytest.fixture(scope="module")
def srv(qwen05_gguf: Path) -> Iterator[ServerThread]:
    from servelm.scheduler.config import EngineConfig
    from servelm.scheduler.engine import Engine
    from servelm.server.app import build_app
    from servelm.server.async_engine import AsyncEngine

    engine = Engine(
        EngineConfig(
            model=str(qwen05_gguf),
            served_model_name=MODEL,
            max_model_len=2048,
            kv_cache_memory=64 * 2**20,
            max_num_seqs=2,
        )
    )
    app = build_app(AsyncEngine(engine))
    app.state.serving.tool_parser = PARSERS["hermes"]
    app.state.serving.auto_tool_choice = True
    server = ServerThread(app, graceful_timeout=10).start(timeout=120)
    try:
        yield server
    finally:
        server.stop()


def get_weather(city: str) -> str:
    assert city == "Paris"
    return RESULT


def chat(
    srv: ServerThread, messages: list[dict[str, Any]], stream: bool, **kw: Any
) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of one answer, joined from its deltas when streamed."""
    client = openai_client(srv)
    kw = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 96, **kw}
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    content, calls = "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            assert d.function is not None
            if d.index not in calls:  # a call's first delta names it, as OpenAI streams calls
                assert d.id and d.function.name
                calls[d.index] = (d.function.name, "")
            calls[d.index] = (calls[d.index][0], calls[d.index][1] + (d.function.arguments or ""))
        content += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    return content or None, [calls[i] for i in sorted(calls)]


def test_auto_reads_the_bare_call_the_model_writes(srv: ServerThread) -> None:
    c = openai_client(srv).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=TOOLS,
        temperature=0,
        max_tokens=96,
        logprobs=True,
    )
    choice = c.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    written = "".join(t.token for t in choice.logprobs.content)
    assert written.lstrip().startswith('{"name": "get_weather"') and "<tool_call>" not in written  # no markers
    (call,) = choice.message.tool_calls or ()
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_sdk_loop(srv: ServerThread, stream: bool) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    content, calls = chat(srv, messages, stream)
    assert content is None and [n for n, _ in calls] == ["get_weather"]
    (name, arguments), args = calls[0], json.loads(calls[0][1])
    assert args == {"city": "Paris"}
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": get_weather(**args)},
    ]
    final, again = chat(srv, messages, stream)
    assert not again and final is not None and '"temperature_c": 22' in final, final


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_sdk_loop(srv: ServerThread, stream: bool) -> None:
    client = anthropic_client(srv)
    tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": CITY}
        for t in TOOLS
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]

    def ask() -> Any:
        kw = {"model": MODEL, "max_tokens": 96, "tools": tools, "messages": messages, "extra_body": {"temperature": 0}}
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    first = ask()
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id.startswith("toolu_")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": get_weather(**use.input)}],
        },
    ]
    final = ask()
    assert final.stop_reason == "end_turn" and [b.type for b in final.content] == ["text"]
    assert '"temperature_c": 22' in final.content[0].text, final.content[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_langchain_loop(srv: ServerThread, stream: bool) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran: list[str] = []

    @tool
    def get_weather_tool(city: str) -> str:
        """Get the current weather in a city"""
        ran.append(city)
        return get_weather(city)

    get_weather_tool.name = "get_weather"
    llm = ChatOpenAI(
        base_url=srv.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=96, max_retries=0
    )
    agent = llm.bind_tools([get_weather_tool])

    def ask(messages: list[Any]) -> AIMessage:
        if not stream:
            return agent.invoke(messages)
        chunks = list(agent.stream(messages))
        whole = chunks[0]
        for c in chunks[1:]:
            whole = whole + c
        return whole

    messages: list[Any] = [HumanMessage(ASK)]
    first = ask(messages)
    (call,) = first.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    messages += [first, ToolMessage(get_weather_tool.invoke(call["args"]), tool_call_id=call["id"])]
    final = ask(messages)
    assert ran == ["Paris"] and not final.tool_calls and '"temperature_c": 22' in str(final.content), final.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_example_is_an_answer_not_a_call(srv: ServerThread, stream: bool) -> None:
    # The acceptance of issue 43: with tools declared, "auto", an answer that is JSON stays an answer.
    content, calls = chat(srv, [{"role": "user", "content": "Give me a JSON example of a person."}], stream)
    assert not calls and content is not None
    body = content.strip().removeprefix("```json").removesuffix("```")
    person = json.loads(body)
    assert isinstance(person, dict) and "name" in person and "age" in person, content
