"""``--reasoning-parser qwen3`` through a real server (uvicorn, the engine, the scheduler) on a Qwen3-shaped
tiny model scripted to think and then answer (tests/scripted_model.py), with Qwen3's own chat template:
the thinking comes back as chat's ``reasoning_content``, a Responses ``reasoning`` item and a Messages
``thinking`` block, read by the official ``openai`` and ``anthropic`` SDKs, streamed as unstreamed;
``enable_thinking: false`` reaches the template; a JSON schema constrains the answer, not the thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from scripted_model import (
    anthropic_client,
    build_scripted_model,
    distinct_ids,
    openai_client,
    prompt_end_id,
    scripted_server,
    scripted_tokenizer,
    sdk_extra,
)
from srv_harness import ServerThread, assert_error, typed_sse_events

from servelm.server.reasoning import PARSERS

THINKING = "Two and two make four."
ANSWER = '{"answer": "four"}'
PLAIN = "Plain reply!"  # the script after an enable_thinking=false prompt
ASK = [{"role": "user", "content": "What is two and two?"}]
MODEL = "scripted"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
# The schema the constrained tests ask for (the script's own answer, {"answer": "four"}, breaks it), and
# every JSON value it accepts.
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": [4, 5]}},
    "required": ["answer"],
    "additionalProperties": False,
}
SCHEMA_ANSWERS = ({"answer": 4}, {"answer": 5})
http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tok = scripted_tokenizer()
    thinking_end, answer_end = prompt_end_id(tok), prompt_end_id(tok, enable_thinking=False)
    script = distinct_ids(tok, f"<think>{THINKING}</think>{ANSWER}", avoid={thinking_end, answer_end})
    plain = distinct_ids(tok, PLAIN, avoid={thinking_end, answer_end, *script})
    folder = build_scripted_model(tmp_path_factory.mktemp("scripted"), {thinking_end: script, answer_end: plain}, tok)
    with scripted_server(folder, MODEL, reasoning_parser=PARSERS["qwen3"]) as server:
        yield server


# ------------------------------------------------------------------------------------------ chat


def test_chat_splits_thinking_from_the_answer_streamed_as_unstreamed(srv: ServerThread) -> None:
    c = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
    m = c.choices[0].message
    assert (sdk_extra(m, "reasoning_content"), m.content, c.choices[0].finish_reason) == (THINKING, ANSWER, "stop")
    chunks = list(
        openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, stream=True)
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    thinking = "".join(sdk_extra(d, "reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (thinking, content) == (THINKING, ANSWER)
    # The thinking streams first, delta by delta, and no delta carries both.
    kinds = [("r" if sdk_extra(d, "reasoning_content") else "") + ("c" if d.content else "") for d in deltas]
    kinds = [k for k in kinds if k]
    assert "rc" not in kinds and kinds == sorted(kinds, key=lambda k: k != "r") and kinds.count("r") > 1
    # Each of n choices is split on its own.
    chunks = list(
        openai_client(srv).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=40, temperature=0, stream=True, n=2
        )
    )
    for i in range(2):
        deltas = [c.delta for ch in chunks for c in ch.choices if c.index == i]
        assert "".join(sdk_extra(d, "reasoning_content") or "" for d in deltas) == THINKING
        assert "".join(d.content or "" for d in deltas) == ANSWER


def test_thinking_cut_by_max_tokens_is_all_reasoning(srv: ServerThread) -> None:
    c = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    m = c.choices[0].message
    assert c.choices[0].finish_reason == "length" and m.content is None
    assert THINKING.startswith(sdk_extra(m, "reasoning_content")) and len(sdk_extra(m, "reasoning_content")) > 3
    chunks = list(
        openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, stream=True)
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(sdk_extra(d, "reasoning_content") or "" for d in deltas) == sdk_extra(m, "reasoning_content")
    assert not "".join(d.content or "" for d in deltas)


def test_enable_thinking_false_reaches_the_template(srv: ServerThread) -> None:
    c = openai_client(srv).chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=40,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    m = c.choices[0].message
    assert (m.content, sdk_extra(m, "reasoning_content")) == (PLAIN, None)
    ids = http.post(
        srv.url + "/v1/chat/completions/render",
        json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    assert scripted_tokenizer().decode(ids["token_ids"]).endswith("<think>\n\n</think>\n\n")
    for name in ("messages", "tools", "add_generation_prompt"):
        r = http.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {name: 1}})
        assert name in assert_error(r, 400, f"chat_template_kwargs.{name}")["message"]


def test_include_and_separate_reasoning(srv: ServerThread) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0}
    m = http.post(srv.url + "/v1/chat/completions", json={**body, "include_reasoning": False}).json()["choices"][0][
        "message"
    ]
    assert m["content"] == ANSWER and "reasoning_content" not in m
    m = http.post(srv.url + "/v1/chat/completions", json={**body, "separate_reasoning": False}).json()["choices"][0][
        "message"
    ]
    assert m["content"] == f"<think>{THINKING}</think>{ANSWER}" and "reasoning_content" not in m


def test_without_a_parser_the_text_is_all_answer(srv: ServerThread) -> None:
    ctx = srv.ctx
    ctx.reasoning_parser = None
    try:
        m = (
            openai_client(srv)
            .chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
            .choices[0]
            .message
        )
        assert m.content == f"<think>{THINKING}</think>{ANSWER}" and sdk_extra(m, "reasoning_content") is None
        r = http.post(
            srv.url + "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 5,
                "messages": ASK,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
        )
        assert r.status_code == 400 and "thinking" in r.json()["error"]["message"]
    finally:
        ctx.reasoning_parser = PARSERS["qwen3"]


def test_a_json_schema_constrains_the_answer_not_the_thinking(srv: ServerThread) -> None:
    # The script's answer ({"answer": "four"}) breaks this schema: the grammar must change the answer,
    # while the thinking (no JSON at all) passes untouched.
    schema = SCHEMA
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}
    for stream in (False, True):
        r = http.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0,
                                                             "response_format": fmt, "stream": stream})  # fmt: skip
        assert r.status_code == 200, r.text
        if stream:
            deltas = [
                json.loads(line[6:])["choices"][0]["delta"]
                for line in r.text.splitlines()
                if line.startswith("data: {")
            ]
            thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
        else:
            m = r.json()["choices"][0]["message"]
            thinking, content = m["reasoning_content"], m["content"]
        assert thinking == THINKING
        assert json.loads(content) in SCHEMA_ANSWERS


# ------------------------------------------------------------------------------------- responses


def test_responses_reasoning_item_then_the_message(srv: ServerThread) -> None:
    resp = openai_client(srv).responses.create(
        model=MODEL, input="What is two and two?", max_output_tokens=40, temperature=0
    )
    Response.model_validate(resp.model_dump())
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    reasoning = resp.output[0]
    assert reasoning.content is not None and [c.text for c in reasoning.content] == [THINKING]
    assert resp.output_text == ANSWER
    r = http.post(srv.url + "/v1/responses", json={"model": MODEL, "input": "What is two and two?", "max_output_tokens": 40,
                                                   "temperature": 0, "stream": True})  # fmt: skip
    events = typed_sse_events(r)
    for _, data in events:
        EVENTS.validate_python(data)
    names = [n for n, _ in events]
    assert "response.reasoning_text.delta" in names and names.index("response.reasoning_text.done") < names.index(
        "response.output_text.delta"
    )
    thinking = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert (thinking, text) == (THINKING, ANSWER)
    added = [(d["output_index"], d["item"]["type"]) for n, d in events if n == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == THINKING
    # The SDK's stream helper assembles the same response; a next turn may send the reasoning item back.
    with openai_client(srv).responses.stream(
        model=MODEL, input="What is two and two?", max_output_tokens=40, temperature=0
    ) as s:
        done = s.get_final_response()
    assert [o.type for o in done.output] == ["reasoning", "message"] and done.output_text == ANSWER
    follow = openai_client(srv).responses.create(
        model=MODEL, max_output_tokens=40, temperature=0, reasoning={"effort": "low"},
        input=[*ASK, *[o.model_dump(exclude_none=True) for o in done.output], {"role": "user", "content": "And three?"}],
    )  # fmt: skip
    assert follow.output_text == ANSWER


# -------------------------------------------------------------------------------------- messages


def test_messages_thinking_block_then_the_text(srv: ServerThread) -> None:
    msg = anthropic_client(srv).messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body={"temperature": 0},
                                      thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.stop_reason == "end_turn"
    assert (msg.content[0].thinking, msg.content[1].text) == (THINKING, ANSWER)
    with anthropic_client(srv).messages.stream(
        model=MODEL, max_tokens=40, messages=ASK, extra_body={"temperature": 0}
    ) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert (
        "thinking_delta" in kinds
        and "signature_delta" in kinds
        and kinds.index("signature_delta") < kinds.index("text_delta")
    )
    # Disabled thinking is Qwen3's enable_thinking=false; thinking blocks in the history are accepted.
    off = anthropic_client(srv).messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body={"temperature": 0},
                                      thinking={"type": "disabled"})  # fmt: skip
    assert [(b.type, b.text) for b in off.content] == [("text", PLAIN)]
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": "And three?"},
    ]
    again = anthropic_client(srv).messages.create(
        model=MODEL, max_tokens=40, messages=history, extra_body={"temperature": 0}
    )
    assert [b.type for b in again.content] == ["thinking", "text"]


def test_scripted_model_is_what_transformers_generates(srv: ServerThread, tmp_path: Path) -> None:
    """The reference the server is checked against: transformers' greedy decoding of the same folder."""
    from scripted_model import scripted_greedy

    tok = scripted_tokenizer()
    ctx = srv.ctx
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    out = scripted_greedy(Path(ctx.model_path), ids)
    assert tok.decode(out, skip_special_tokens=True) == f"<think>{THINKING}</think>{ANSWER}"


def test_a_named_tool_call_follows_the_thinking(srv: ServerThread) -> None:
    params = SCHEMA
    tool = {"type": "function", "function": {"name": "report", "parameters": params}}
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "report"}}}  # fmt: skip
    c = openai_client(srv).chat.completions.create(**body)
    m = c.choices[0].message
    assert (
        sdk_extra(m, "reasoning_content") == THINKING
        and m.tool_calls is not None
        and m.tool_calls[0].function.name == "report"
    )
    assert json.loads(m.tool_calls[0].function.arguments) in SCHEMA_ANSWERS
    chunks = list(openai_client(srv).chat.completions.create(**body, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    calls = [d for d in deltas if d.tool_calls]
    # The call's first delta (its id and name) comes once the thinking is over.
    assert "".join(sdk_extra(d, "reasoning_content") or "" for d in deltas[: deltas.index(calls[0])]) == THINKING
    assert not any(sdk_extra(d, "reasoning_content") for d in deltas[deltas.index(calls[0]) :])
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in calls)
    assert json.loads(arguments) == json.loads(m.tool_calls[0].function.arguments)


def test_template_variables_count_against_the_prompt_bound(srv: ServerThread) -> None:
    # Refused before tokenizing, as long messages are: a template may render any variable it is given.
    big = {"chat_template_kwargs": {"notes": "x" * (srv.ctx.max_prompt_chars + 1)}}
    for path in ("/v1/chat/completions", "/v1/chat/completions/render"):
        r = http.post(srv.url + path, json={"model": MODEL, "messages": ASK, "max_tokens": 5, **big})
        assert "maximum context length" in assert_error(r, 400, "messages")["message"]


# ------------------------------------------------------------- a prompt that opens the thinking itself


@pytest.fixture(scope="module")
def opened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """Qwen3's template with the generation prompt of its Thinking-2507 and DeepSeek-R1 successors, which
    end in ``<think>\\n``: the model writes only the thinking's end tag. Served with ``deepseek_r1``."""
    tok = scripted_tokenizer()
    tail = (
        "    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    )
    assert tail in tok.chat_template
    tok.chat_template = tok.chat_template.replace(
        tail, "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if false %}\n"
    )
    script = distinct_ids(tok, f"{THINKING}</think>{ANSWER}", avoid={prompt_end_id(tok)})
    folder = build_scripted_model(tmp_path_factory.mktemp("opened"), {prompt_end_id(tok): script}, tok)
    with scripted_server(folder, MODEL, reasoning_parser=PARSERS["deepseek_r1"]) as server:
        yield server


def test_thinking_opened_by_the_prompt(opened: ServerThread) -> None:
    ids = http.post(opened.url + "/v1/chat/completions/render", json={"messages": ASK}).json()["token_ids"]
    assert scripted_tokenizer().decode(ids).endswith("<think>\n")
    c = openai_client(opened).chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
    assert (sdk_extra(c.choices[0].message, "reasoning_content"), c.choices[0].message.content) == (THINKING, ANSWER)
    chunks = list(
        openai_client(opened).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=40, temperature=0, stream=True
        )
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(sdk_extra(d, "reasoning_content") or "" for d in deltas) == THINKING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    # The grammar requires the thinking to close before the answer it constrains.
    schema = SCHEMA
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}
    m = http.post(
        opened.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "response_format": fmt},
    ).json()["choices"][0]["message"]
    assert m["reasoning_content"] == THINKING
    assert json.loads(m["content"]) in SCHEMA_ANSWERS
