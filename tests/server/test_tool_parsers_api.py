"""``--tool-call-parser hermes --enable-auto-tool-choice`` with ``--reasoning-parser qwen3`` through a real
server (uvicorn, the engine, llguidance) on a Qwen3-shaped tiny model scripted to think and then write a
``<tool_call>`` (tests/scripted_model.py), with Qwen3's own chat template: the call comes back as chat's
``tool_calls``, a Responses ``function_call`` item and a Messages ``tool_use`` block, read by the official
``openai`` and ``anthropic`` SDKs, streamed (arguments as they arrive) and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from scripted_model import (
    anthropic_client,
    build_scripted_model,
    distinct_ids,
    openai_client,
    prompt_end_id,
    scripted_tokenizer,
    sdk_extra,
    serve_scripted,
)
from srv_harness import ServerThread, assert_error

from servelm.server.reasoning import PARSERS as REASONING
from servelm.server.tool_parsers import PARSERS

THINKING = "Weather needs the tool."
ARGS = {"city": "Paris"}
# Spelled so that the scripted model can write it with distinct tokens (no newline: the prompts end in those).
CALL = '<tool_call> {"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
# How Qwen3's template writes an earlier call back into the prompt.
RENDERED = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': ARGS})}\n</tool_call>"
PLAIN = "Sunny, no tool!"  # the script after an enable_thinking=false prompt
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MODEL = "scripted"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    },
]
http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = scripted_tokenizer()
    thinking_end, answer_end = prompt_end_id(tok), prompt_end_id(tok, enable_thinking=False)
    script = distinct_ids(tok, f"<think>{THINKING}</think>{CALL}", avoid={thinking_end, answer_end})
    plain = distinct_ids(tok, PLAIN, avoid={thinking_end, answer_end, *script})
    return build_scripted_model(tmp_path_factory.mktemp("scripted"), {thinking_end: script, answer_end: plain}, tok)


@pytest.fixture(scope="module")
def srv(folder: Path) -> Iterator[ServerThread]:
    server = serve_scripted(
        folder, MODEL, reasoning_parser=REASONING["qwen3"], tool_parser=PARSERS["hermes"], auto_tool_choice=True
    )
    try:
        yield server
    finally:
        server.stop()


oai, claude, extra = openai_client, anthropic_client, sdk_extra


# ------------------------------------------------------------------------------------------ chat


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_chat_returns_the_models_own_call(srv: ServerThread, choice: str) -> None:
    c = oai(srv).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=0
    )
    m = c.choices[0].message
    assert (
        c.choices[0].finish_reason == "tool_calls" and m.content is None and extra(m, "reasoning_content") == THINKING
    )
    assert m.tool_calls is not None and len(m.tool_calls) == 1
    call = m.tool_calls[0]
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather", ARGS)
    assert call.id.startswith("call_")


def test_chat_streams_the_arguments_as_they_arrive(srv: ServerThread) -> None:
    chunks = list(
        oai(srv).chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, stream=True
        )
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    pieces = [tc for d in deltas for tc in d.tool_calls or ()]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].type == "function"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 3  # the arguments came in several deltas, not whole at the end
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == ARGS
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == THINKING
    assert not "".join(d.content or "" for d in deltas)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_named_function_is_its_call(srv: ServerThread) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    c = oai(srv).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0
    )
    call = c.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments), c.choices[0].finish_reason) == (
        "get_weather",
        ARGS,
        "stop",
    )


def test_a_text_answer_stays_text(srv: ServerThread) -> None:
    body: dict[str, Any] = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    c = oai(srv).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, **body)
    assert (c.choices[0].message.content, c.choices[0].message.tool_calls, c.choices[0].finish_reason) == (
        PLAIN,
        None,
        "stop",
    )


def test_the_template_renders_the_tools_and_the_history(srv: ServerThread) -> None:
    # Qwen3's template writes the tools in <tools> and the earlier call and its result in its own format.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    ids = http.post(srv.url + "/v1/chat/completions/render", json={"messages": history, "tools": TOOLS}).json()[
        "token_ids"
    ]
    prompt = scripted_tokenizer().decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert RENDERED in prompt
    assert "<tool_response>\n22 C\n</tool_response>" in prompt
    c = oai(srv).chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=80, temperature=0)
    assert c.choices[0].message.tool_calls is not None  # the script answers any prompt with its call


def test_auto_without_enable_auto_tool_choice_is_refused(srv: ServerThread) -> None:
    srv.ctx.auto_tool_choice = False
    try:
        r = http.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert "--enable-auto-tool-choice" in assert_error(r, 400, "tool_choice")["message"]
        r = http.post(
            srv.url + "/v1/chat/completions",
            json={"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80},
        )
        assert (
            r.status_code == 200
            and r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        )
    finally:
        srv.ctx.auto_tool_choice = True


# ------------------------------------------------------------------------------------- responses


def test_responses_function_call_item(srv: ServerThread) -> None:
    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS
    ]
    r = oai(srv).responses.create(
        model=MODEL, input="Weather in Paris?", tools=tools, max_output_tokens=80, temperature=0
    )
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "function_call"]
    call = r.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", ARGS, "completed")
    with oai(srv).responses.stream(
        model=MODEL, input="Weather in Paris?", tools=tools, max_output_tokens=80, temperature=0
    ) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and json.loads("".join(deltas)) == ARGS
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert json.loads(final.output[1].arguments) == ARGS


# -------------------------------------------------------------------------------------- messages


def test_messages_tool_use_block(srv: ServerThread) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    m = claude(srv).messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=tools)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    use = m.content[1]
    assert (use.name, use.input) == ("get_weather", ARGS)
    with claude(srv).messages.stream(model=MODEL, max_tokens=80, messages=ASK, tools=tools) as s:
        events = list(s)
        final = s.get_final_message()
    parts = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(parts) > 3 and json.loads("".join(parts)) == ARGS
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == ARGS
    assert final.stop_reason == "tool_use"


# --------------------------------------------------------------------------------- without flags


def test_without_a_parser_nothing_changes(srv: ServerThread) -> None:
    srv.ctx.tool_parser = None
    try:
        ids = http.post(srv.url + "/v1/chat/completions/render", json={"messages": ASK, "tools": TOOLS}).json()[
            "token_ids"
        ]
        # "auto" keeps the JSON-array convention, described in the system message instead of <tools>.
        prompt = scripted_tokenizer().decode(ids)
        assert "You can call these functions" in prompt and "<tools>" not in prompt
        c = oai(srv).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
        # Its grammar keeps added tokens out of a text answer, so the script's <tool_call> cannot even start.
        assert c.choices[0].message.tool_calls is None and "<tool_call>" not in (c.choices[0].message.content or "")
    finally:
        srv.ctx.tool_parser = PARSERS["hermes"]


# ---------------------------------------------------------------------- a special-token marker

# Mistral's format, its marker a special token (as in Mistral's tokenizers): decoding must keep it.
MISTRAL = 'Checking.[TOOL_CALLS][ {"name":"get_weather","arguments":{"city":"Paris"}}]'


@pytest.fixture(scope="module")
def mistral_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tok = scripted_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    end = prompt_end_id(tok)
    script = distinct_ids(tok, MISTRAL, avoid={end, prompt_end_id(tok, enable_thinking=False)})
    folder = build_scripted_model(tmp_path_factory.mktemp("mistral"), {end: script}, tok)
    server = serve_scripted(folder, MODEL, tool_parser=PARSERS["mistral"], auto_tool_choice=True)
    try:
        yield server
    finally:
        server.stop()


def test_a_special_token_marker_reaches_the_parser(mistral_srv: ServerThread) -> None:
    c = oai(mistral_srv).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    m = c.choices[0].message
    assert (m.content, c.choices[0].finish_reason) == ("Checking.", "tool_calls")
    call = m.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates want such ids back
    chunks = list(
        oai(mistral_srv).chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, stream=True
        )
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    pieces = [tc for d in deltas for tc in d.tool_calls or ()]
    assert (
        pieces[0].function.name == "get_weather"
        and json.loads("".join(p.function.arguments or "" for p in pieces)) == ARGS
    )
    # Without tools the special token is skipped as usual (the grammar does not apply either).
    plain = oai(mistral_srv).chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0)
    assert plain.choices[0].message.content == MISTRAL.replace("[TOOL_CALLS]", "")


# ------------------------------------------------------------------------------------------ flags


def test_serve_flags(caplog: pytest.LogCaptureFixture) -> None:
    from servelm.server.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--tool-call-parser", "mistral", "--enable-auto-tool-choice"])
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == ("mistral", True)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.tool_call_parser, defaults.enable_auto_tool_choice) == (None, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "pythonic"])
    # Auto tool choice without a format to read is refused before anything loads.
    assert main(["serve", "--enable-auto-tool-choice"]) == 1
    assert "--enable-auto-tool-choice needs --tool-call-parser" in caplog.text
