"""Forced tool calls on a real chat model trained for tools: Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file,
served as stored with ``--tool-call-parser hermes``, asked through the official OpenAI SDK at temperature
0 (issue 43, item 3).

Asked for the weather, this model would answer with a bare JSON object and end; held to ``<tool_call>``
blocks, it wants to end where the grammar has no end yet. Wide whitespace gaps in the grammar were where
its probability went (``} \\n  </tool_call>\\n\\n  <tool_call>\\n   {...``, call after call, until
``max_tokens``, and none came back). Here: one call and then the end when parallel calls are off and for a
named function; under "required" with parallel calls on (OpenAI's default) the model may repeat its call,
but every gap holds one whitespace character at most and every whole call comes back, cut or not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scripted_model import openai_client
from srv_harness import ServerThread

from servelm.server.tool_parsers import PARSERS

pytestmark = pytest.mark.slow  # Qwen2.5-Coder-0.5B's GGUF file (491 MB)

MODEL = "qwen05"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
# What may stand between a marker and the JSON, and between two blocks (re.DOTALL: JSON spans lines).
_GAPS = re.compile(r"<tool_call>(\s*)\{|\}(\s*)</tool_call>|</tool_call>(\s*)<tool_call>")
_BLOCK = re.compile(r"<tool_call>\s?(\{.*?\})\s?</tool_call>", re.DOTALL)


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
            max_model_len=1024,
            kv_cache_memory=32 * 2**20,
            max_num_seqs=2,
        )
    )
    app = build_app(AsyncEngine(engine))
    app.state.serving.tool_parser = PARSERS["hermes"]
    server = ServerThread(app, graceful_timeout=10).start(timeout=120)
    try:
        yield server
    finally:
        server.stop()


def ask(srv: ServerThread, **kw: Any) -> Any:
    return openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, **kw)


def test_one_call_and_the_end_when_parallel_calls_are_off(srv: ServerThread) -> None:
    c = ask(srv, tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or ()
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert c.usage is not None and c.usage.completion_tokens < 32  # the call, then the end


def test_a_named_function_is_one_call_and_the_end(srv: ServerThread) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    c = ask(srv, tool_choice=named, max_tokens=64)
    (call,) = c.choices[0].message.tool_calls or ()
    assert (c.choices[0].finish_reason, json.loads(call.function.arguments)) == ("stop", {"city": "Paris"})


def test_required_returns_every_whole_call_with_no_room_to_wander(srv: ServerThread) -> None:
    c = ask(srv, tool_choice="required", max_tokens=48, logprobs=True)
    choice = c.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    text = "".join(t.token for t in choice.logprobs.content)  # what the model wrote, markers included
    assert all(len(gap) <= 1 for m in _GAPS.finditer(text) for gap in m.groups() if gap is not None), repr(text)
    whole = [json.loads(b) for b in _BLOCK.findall(text)]
    calls = choice.message.tool_calls or []
    assert whole and all(b == {"name": "get_weather", "arguments": {"city": "Paris"}} for b in whole), repr(text)
    # Every whole call comes back, cut by max_tokens or not (a call whose JSON closed before the cut too).
    assert [json.loads(k.function.arguments) for k in calls[: len(whole)]] == [b["arguments"] for b in whole]
    assert len(whole) <= len(calls) <= len(whole) + 1 and choice.message.content is None
    assert choice.finish_reason in ("tool_calls", "length")
    assert text.endswith("</tool_call>") or choice.finish_reason == "length"


def test_streamed_required_calls_arrive_whole(srv: ServerThread) -> None:
    chunks = list(ask(srv, tool_choice="required", max_tokens=48, stream=True, logprobs=True))
    text = "".join(
        t.token for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content or ()
    )
    assert all(len(gap) <= 1 for m in _GAPS.finditer(text) for gap in m.groups() if gap is not None), repr(text)
    pieces = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    args: dict[int, str] = {}
    for p in pieces:
        args[p.index] = args.get(p.index, "") + ((p.function and p.function.arguments) or "")
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish in (["tool_calls"], ["length"])
    complete = [json.loads(a) for i, a in sorted(args.items()) if i < len(args) - 1 or finish == ["tool_calls"]]
    assert complete and all(a == {"city": "Paris"} for a in complete)
