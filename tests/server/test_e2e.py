"""End to end on the default model: the official ``openai`` SDK and raw httpx against a live server.

One engine (SmolLM2-135M-Instruct, float32, CPU) serves the whole module through a real uvicorn
server on a loopback port. Offline greedy references come from the same engine's ``generate``
before the server starts, so "the server returns the engine's text" is checked token-exactly.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from srv_harness import ServerThread, parse_sse

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.app import ObserverProxy, build_app, create_prometheus_observer
from servelm.server.async_engine import AsyncEngine

pytestmark = pytest.mark.slow  # an engine on the default model

CHAT_Q = "What is the capital of France?"
COMPLETION_PROMPT = "The three primary colors are"
# Prompts for the concurrency test: distinct lengths and contents, each shared by several clients.
CONCURRENT_PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):",
    "The weather today is",
    "List three fruits:",
    "In 1969, astronauts",
    "The best way to learn a language is",
    "SELECT name FROM",
    "My favourite book is",
]
CONCURRENT_MAX_TOKENS = 24


@dataclass
class Live:
    srv: ServerThread
    engine: Any
    ae: AsyncEngine
    model: str
    chat_ids: list[int]
    chat_text: str  # offline greedy answer to CHAT_Q (chat template)
    completion_text: str  # offline greedy, 12 tokens, ignore_eos
    concurrent_texts: dict[str, str]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def live(request: pytest.FixtureRequest) -> Iterator[Live]:
    from servelm.scheduler.engine import Engine

    proxy = ObserverProxy()
    engine = Engine(EngineConfig(kv_cache_memory=256 * 2**20, max_model_len=2048, max_num_seqs=64), observer=proxy)
    tok = engine.tokenizer
    chat_ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": CHAT_Q}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    (chat,) = engine.generate([chat_ids], greedy)
    (compl,) = engine.generate(
        [tok.encode(COMPLETION_PROMPT)], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    conc = engine.generate(
        [tok.encode(p) for p in CONCURRENT_PROMPTS],
        SamplingParams(max_tokens=CONCURRENT_MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    assert engine.block_manager.num_used_blocks == 0
    # The references above come from the synchronous engine; the server then schedules ahead or not
    # (switching on is safe here: nothing is in flight).
    engine.async_scheduling = request.param
    observer = create_prometheus_observer(engine)
    proxy.target = observer
    ae = AsyncEngine(engine, observer=proxy)
    app = build_app(ae, metrics_registry=getattr(observer, "registry", None))
    srv = ServerThread(app).start()
    try:
        yield Live(
            srv,
            engine,
            ae,
            engine.served_model_name,
            chat_ids,
            chat.outputs[0].text,
            compl.outputs[0].text,
            {p: r.outputs[0].text for p, r in zip(CONCURRENT_PROMPTS, conc)},
        )
    finally:
        srv.stop()


def _idle_and_free(live: Live, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = live.ae.snapshot
        if s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0 and not live.ae._groups:
            break
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.05)
    # The engine thread is idle now, so reading the block manager from here is safe.
    assert live.engine.block_manager.num_used_blocks == 0


def test_reference_is_sane(live: Live) -> None:
    assert live.chat_text == "The capital of France is Paris."


# ------------------------------------------------------------------------------------- openai SDK


def test_sdk_chat_greedy_equals_offline(live: Live) -> None:
    c = live.client()
    r = c.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": CHAT_Q}], temperature=0, max_tokens=40
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.content == live.chat_text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(live.chat_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_sdk_chat_stream_with_usage(live: Live) -> None:
    c = live.client()
    stream = c.chat.completions.create(
        model=live.model,
        messages=[{"role": "user", "content": CHAT_Q}],
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == live.chat_text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(live.chat_ids)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sdk_completion_greedy_and_stream(live: Live) -> None:
    c = live.client()
    r = c.completions.create(
        model=live.model, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == live.completion_text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    parts = list(
        c.completions.create(
            model=live.model,
            prompt=COMPLETION_PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts) == live.completion_text
    assert parts[-1].choices[0].finish_reason == "length"


def test_sdk_n2_seeded_is_reproducible(live: Live) -> None:
    c = live.client()

    def run() -> list[str]:
        r = c.completions.create(
            model=live.model,
            prompt="Write a word:",
            n=2,
            max_tokens=10,
            temperature=1.0,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        assert [ch.index for ch in r.choices] == [0, 1]
        assert r.usage.completion_tokens == 20
        return [ch.text for ch in r.choices]

    first = run()
    assert first == run()
    assert first[0] != first[1]
    chat = c.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": "Say hi"}], n=2, max_tokens=8, seed=7
    )
    assert [ch.index for ch in chat.choices] == [0, 1]


def test_sdk_logprobs(live: Live) -> None:
    c = live.client()
    r = c.completions.create(
        model=live.model,
        prompt=COMPLETION_PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(r.choices[0].text) - len(lp.tokens[-1])
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 3 <= len(top) <= 4
        assert top[tok] == tlp and tlp == max(top.values())  # greedy picks the most likely token

    chat = c.chat.completions.create(
        model=live.model,
        messages=[{"role": "user", "content": CHAT_Q}],
        temperature=0,
        max_tokens=40,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == live.chat_text
    # Stopped on EOS, whose text is not returned: the other tokens' bytes spell the answer exactly.
    assert bytes(b for e in content[:-1] for b in e.bytes).decode() == live.chat_text
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)


def test_sdk_echo_scores_a_completion_as_generation_did(live: Live) -> None:
    """Scoring prompt + greedy completion (echo, max_tokens 0, as lm-evaluation-harness does) gives the
    completion's tokens the logprobs and alternatives generation gave them, from prefill rows instead
    of decode steps."""
    c = live.client()
    tok = live.engine.tokenizer
    prompt = tok.encode(COMPLETION_PROMPT)
    gen = c.completions.create(
        model=live.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    ).choices[0]
    gen_ids = tok.encode(gen.text, add_special_tokens=False)
    assert tok.decode(gen_ids) == gen.text and len(gen_ids) == 8  # re-encodes to the tokens generated
    scored = c.completions.create(
        model=live.model,
        prompt=prompt + gen_ids,
        max_tokens=0,
        echo=True,
        logprobs=3,
        extra_body={"prompt_logprobs": 3},
    )
    choice = scored.choices[0]
    assert choice.text == tok.decode(prompt) + gen.text and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(prompt) + 8
    lp = choice.logprobs
    n = len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.tokens[n:] == gen.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(gen.logprobs.token_logprobs, abs=1e-3)
    for mine, theirs in zip(lp.top_logprobs[n:], gen.logprobs.top_logprobs):
        assert set(mine) == set(theirs)
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-3)
    assert lp.text_offset[n] == len(tok.decode(prompt))
    # vLLM's prompt_logprobs view of the same scores: the prompt's token, then the 3 alternatives.
    vllm = choice.model_extra["prompt_logprobs"]
    assert len(vllm) == n + 8 and vllm[0] is None
    for j, (tid, entry) in enumerate(zip(prompt + gen_ids, vllm)):
        if j == 0:
            continue
        assert entry[str(tid)]["logprob"] == lp.token_logprobs[j]
        assert {v["decoded_token"] for v in entry.values()} == set(lp.top_logprobs[j])
    _idle_and_free(live)


def test_sdk_stop_strings(live: Live) -> None:
    c = live.client()
    r = c.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": CHAT_Q}], temperature=0, max_tokens=40, stop=[" Paris"]
    )
    assert r.choices[0].message.content == live.chat_text.split(" Paris")[0]
    assert r.choices[0].finish_reason == "stop"
    parts = list(
        c.chat.completions.create(
            model=live.model,
            messages=[{"role": "user", "content": CHAT_Q}],
            temperature=0,
            max_tokens=40,
            stop=" Paris",
            stream=True,
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == live.chat_text.split(" Paris")[0]


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}


def test_sdk_structured_outputs(live: Live) -> None:
    """response_format (json_schema, json_object; streamed too) and vLLM's structured_outputs
    (choice) on the real model: the text parses and follows the spec, greedy answers are stable."""
    c = live.client()
    msgs = [{"role": "user", "content": "Describe Paris as JSON with city, country and population."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    r = c.chat.completions.create(model=live.model, messages=msgs, temperature=0, max_tokens=100, response_format=fmt)
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"city", "country", "population"} and isinstance(obj["population"], int)
    assert (obj["city"], obj["country"]) == ("Paris", "France")
    assert r.choices[0].finish_reason == "stop"
    ask = [{"role": "user", "content": "Give me a JSON object about France."}]
    whole = c.chat.completions.create(
        model=live.model, messages=ask, temperature=0, max_tokens=150, response_format={"type": "json_object"}
    )
    parts = list(
        c.chat.completions.create(
            model=live.model,
            messages=ask,
            temperature=0,
            max_tokens=150,
            response_format={"type": "json_object"},
            stream=True,
        )
    )
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert isinstance(json.loads(text), dict) and text == whole.choices[0].message.content
    r = c.completions.create(
        model=live.model,
        prompt="Is Paris the capital of France? Answer:",
        max_tokens=10,
        n=3,
        temperature=1.0,
        seed=11,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}},
    )
    assert all(ch.text in (" yes", " no") and ch.finish_reason == "stop" for ch in r.choices)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=live.model, messages=msgs, max_tokens=5, extra_body={"structured_outputs": {"regex": "(unclosed"}}
        )
    assert e.value.body["param"] == "structured_outputs.regex"
    _idle_and_free(live)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string"}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


def test_sdk_tool_calls(live: Live) -> None:
    """tool_choice "required" and a named function on the real model, streamed and not: well-formed
    calls to the declared tools, the same calls either way, and a second turn with the result."""
    c = live.client()
    ask = [{"role": "user", "content": "What's the weather like in Paris?"}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    r = c.chat.completions.create(
        model=live.model, messages=ask, tools=tools, tool_choice="required", temperature=0, max_tokens=100
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert isinstance(args["city"], str) and set(args) <= {"city", "unit"}
        else:
            assert call.function.name == "get_time" and set(args) == {"tz"}
    streamed = list(
        c.chat.completions.create(
            model=live.model,
            messages=ask,
            tools=tools,
            tool_choice="required",
            temperature=0,
            max_tokens=100,
            stream=True,
        )
    )
    deltas = [d for p in streamed if p.choices for d in (p.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (t.function.name, t.function.arguments) for t in ch.message.tool_calls
    ]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(
        model=live.model, messages=ask, tools=tools, tool_choice=named, temperature=0, max_tokens=60
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)
    parts = list(
        c.chat.completions.create(
            model=live.model, messages=ask, tools=tools, tool_choice=named, temperature=0, max_tokens=60, stream=True
        )
    )
    deltas = [d for p in parts if p.choices for d in (p.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments

    history = ask + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 degrees celsius, cloudy"},
    ]
    r = c.chat.completions.create(model=live.model, messages=history, temperature=0, max_tokens=40)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # "auto" (the default): this small model answers in text; the answer is what it says without tools
    # unless that would start with "[" (the calls' array).
    r = c.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": CHAT_Q}], tools=tools, temperature=0, max_tokens=40
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == live.chat_text
    _idle_and_free(live)


def test_usage_counts_prefix_cached_tokens(live: Live) -> None:
    """usage.prompt_tokens_details.cached_tokens (input_tokens_details on /v1/responses): 0 for a new
    prompt, its full blocks when the same prompt comes again (the last token is always computed)."""
    c = live.client()
    prompt = f"Request {random.random()}: " + "a long shared preamble that fills a few blocks " * 4
    first = c.completions.create(model=live.model, prompt=prompt, max_tokens=2, temperature=0)
    again = c.completions.create(model=live.model, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    messages = [{"role": "user", "content": prompt}]
    chat = c.chat.completions.create(model=live.model, messages=messages, max_tokens=2, temperature=0)
    resp = c.responses.create(model=live.model, input=prompt, max_output_tokens=16, temperature=0, store=False)
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.input_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // 16 * 16
    _idle_and_free(live)


def _responses_tool(chat_tool: dict) -> dict:
    return {"type": "function", **chat_tool["function"]}


def test_sdk_responses(live: Live) -> None:
    """/v1/responses on the real model through the SDK: the greedy chat answer, streamed the same, a
    JSON-schema answer, required and named calls, and a second turn through previous_response_id."""
    c = live.client()
    r = c.responses.create(model=live.model, input=CHAT_Q, temperature=0, max_output_tokens=40)
    assert r.status == "completed" and r.output_text == live.chat_text
    assert r.usage.input_tokens == len(live.chat_ids) and r.usage.output_tokens > 0
    with c.responses.stream(model=live.model, input=CHAT_Q, temperature=0, max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == live.chat_text
    assert c.responses.retrieve(final.id).output_text == live.chat_text

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = c.responses.create(
        model=live.model,
        input="Name the capital of France as JSON.",
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema}},
    )
    assert set(json.loads(r.output_text)) == {"city"}

    ask = "What's the weather like in Paris?"
    tools = [_responses_tool(WEATHER_TOOL), _responses_tool(TIME_TOOL)]
    r = c.responses.create(
        model=live.model, input=ask, tools=tools, tool_choice="required", temperature=0, max_output_tokens=100
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and len(calls) == len(r.output) and all(o.call_id.startswith("call_") for o in calls)
    assert {o.name for o in calls} <= {"get_weather", "get_time"}
    chat = c.chat.completions.create(
        model=live.model,
        messages=[{"role": "user", "content": ask}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=100,
    )
    assert [(o.name, o.arguments) for o in calls] == [
        (t.function.name, t.function.arguments) for t in chat.choices[0].message.tool_calls
    ]

    named = {"type": "function", "name": "get_weather"}
    r = c.responses.create(
        model=live.model, input=ask, tools=tools, tool_choice=named, temperature=0, max_output_tokens=60
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    events = list(
        c.responses.create(
            model=live.model,
            input=ask,
            tools=tools,
            tool_choice=named,
            temperature=0,
            max_output_tokens=60,
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and events[-1].type == "response.completed"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees celsius, cloudy"}
    second = c.responses.create(
        model=live.model, previous_response_id=r.id, input=[result], temperature=0, max_output_tokens=40
    )
    history = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12 degrees celsius, cloudy"},
    ]  # fmt: skip
    same = c.chat.completions.create(model=live.model, messages=history, temperature=0, max_tokens=40)
    assert second.output_text and second.output_text == same.choices[0].message.content
    _idle_and_free(live)


def test_sdk_models_and_errors(live: Live) -> None:
    c = live.client()
    models = c.models.list()
    assert [m.id for m in models.data] == [live.model]
    assert models.data[0].owned_by == "servelm"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=live.model, prompt="x", max_tokens=5000)
    assert (
        e.value.body["param"] == "max_tokens"
        and "2048" in e.value.body["message"]
        and "5000" in e.value.body["message"]
    )


# ------------------------------------------------------------------------------------ raw framing


def test_raw_sse_bytes(live: Live) -> None:
    body = {
        "model": live.model,
        "messages": [{"role": "user", "content": CHAT_Q}],
        "temperature": 0,
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{live.srv.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and raw.startswith(b"data: {")
    events = parse_sse(raw)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == live.chat_text


# ---------------------------------------------------------------------------------- concurrency


async def _client(http: httpx.AsyncClient, url: str, model: str, prompt: str, drop_after: int | None) -> str | None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": CONCURRENT_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = ""
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: ") :]
            if data == "[DONE]":
                return text
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            seen += 1
            if drop_after is not None and seen >= drop_after:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


def test_64_concurrent_streams_with_disconnects(live: Live) -> None:
    rng = random.Random(0)
    jobs = []
    for i in range(64):
        prompt = CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)]
        drop = rng.randint(1, 6) if i % 4 == 3 else None  # a quarter disconnect mid-stream
        jobs.append((prompt, drop))

    async def main() -> list[str | None]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(_client(http, live.srv.url, live.model, p, d) for p, d in jobs))

    results = asyncio.run(main())
    for (prompt, drop), text in zip(jobs, results):
        if drop is None:
            assert text == live.concurrent_texts[prompt], prompt
    _idle_and_free(live)
    assert httpx.get(f"{live.srv.url}/health").status_code == 200
    metrics = httpx.get(f"{live.srv.url}/metrics").text
    usage = [ln for ln in metrics.splitlines() if ln.startswith("servelm_kv_cache_usage_perc")]
    assert usage and float(usage[0].split()[-1]) == 0.0


def test_servelm_bench_against_live_server(live: Live, tmp_path, capsys) -> None:
    """``servelm bench`` against the real engine: exact token counts with ignore_eos, plausible latencies."""
    import json

    from servelm.bench.loadgen import main as bench_main

    out = tmp_path / "servelm.bench.json"
    rc = bench_main(
        [
            "--base-url",
            live.srv.url,
            "--num-prompts",
            "6",
            "--input-len",
            "24",
            "--output-len",
            "8",
            "--range-ratio",
            "0.5",
            "--max-concurrency",
            "3",
            "--ignore-eos",
            "--seed",
            "3",
            "--disable-tqdm",
            "--result-json",
            str(out),
        ]
    )
    assert rc == 0
    assert "Output token throughput (tok/s):" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0 and r["model"] == live.model
    for q in r["requests"]:
        assert q["success"] and q["usage_reported"] and q["ttft"] > 0
        assert q["latency"] > q["ttft"]
    # With ignore_eos every request generates exactly the max_tokens it was sent.
    assert r["total_output_tokens"] == sum(q["output_len"] for q in r["requests"])
    assert all(4 <= q["output_len"] <= 12 for q in r["requests"])
    _idle_and_free(live)
