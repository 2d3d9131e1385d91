"""Each family's tool-call parser (server/tool_parsers) on complete and streamed answers.

The answers are written the way each family writes calls (its chat template's format), from calls
given here as Python values; a parse must give those calls back (names, and arguments that load to
the same values), the text before them as content, and the same answer whether it arrives whole,
one character at a time or one token at a time (a real tokenizer's pieces, the family's markers as
single tokens). Malformed answers come back whole as content, as vLLM returns them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from servelm.server.tool_parsers import PARSERS, ParsedCall, ParsedOutput, ToolParser

Call = tuple[str, dict[str, Any]]

WEATHER: Call = ("get_weather", {"city": "Paris", "unit": "celsius"})
# Arguments holding each family's markers and separators inside strings, nested containers, numbers.
TRICKY: Call = ("run", {"code": 'print("<tool_call>; [TOOL_CALLS] }]")', "n": [1, -2.5e3, {"ok": True, "x": None}]})
EMPTY: Call = ("now", {})


def hermes(calls: list[Call]) -> str:  # Qwen3's template: one block per call, on their own lines
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def llama3(calls: list[Call]) -> str:  # Llama 3.1's JSON format, "; " between calls
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def llama3_tagged(calls: list[Call]) -> str:
    return "<|python_tag|>" + llama3(calls)


def mistral(calls: list[Call]) -> str:  # Mistral 7B v0.3
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def mistral_v11(calls: list[Call]) -> str:  # newer tokenizers: name[ARGS]{...} per call
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def granite(calls: list[Call]) -> str:  # Granite 3.0
    return "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def granite31(calls: list[Call]) -> str:  # Granite 3.1 writes the marker as text
    return "<tool_call>" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


FORMATS: list[tuple[str, Callable[[list[Call]], str]]] = [
    ("hermes", hermes),
    ("llama3_json", llama3),
    ("llama3_json", llama3_tagged),
    ("mistral", mistral),
    ("mistral", mistral_v11),
    ("granite", granite),
    ("granite", granite31),
]
# Families whose calls may follow text (the others' calls are the whole answer).
AFTER_TEXT = {hermes, llama3_tagged, mistral, mistral_v11}


def token_chunks(tok: Any, text: str) -> list[str]:
    """``text`` as a server streams it: each new token's text (a detokenizer's deltas)."""
    ids = tok.encode(text, add_special_tokens=False)
    out, prev = [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k])
        if now.endswith("\ufffd"):  # half a character: wait for the rest, as a detokenizer does
            continue
        out.append(now[len(prev) :])
        prev = now
    assert "".join(out) == text
    return out


def streamed(name: str, chunks: list[str]) -> ParsedOutput:
    """Feed ``chunks``; the deltas joined as an OpenAI client joins ``delta.tool_calls``, checking
    the stream's shape on the way: a call's first piece names it, later pieces only add arguments,
    indices come in order."""
    parser = PARSERS[name]()
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[list[str]] = []
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.index == len(calls), "a call is named once, in index order"
                calls.append([c.name, ""])
            else:
                assert c.index == len(calls) - 1, "arguments go to the call named last"
            calls[c.index][1] += c.arguments
    return ParsedOutput(content or None if calls else content, [ParsedCall(n, a) for n, a in calls])


def check(out: ParsedOutput, content: str | None, calls: list[Call]) -> None:
    assert out.content == content
    assert [c.name for c in out.calls] == [n for n, _ in calls]
    assert [json.loads(c.arguments) for c in out.calls] == [a for _, a in calls]


def all_ways(tok: Any, name: str, text: str) -> list[ParsedOutput]:
    """The complete parse, then the streamed ones (by character, by token, in two halves)."""
    half = len(text) // 2
    return [
        PARSERS[name]().parse(text),
        streamed(name, list(text)),
        streamed(name, token_chunks(tok, text)),
        streamed(name, [text[:half], text[half:]]),
    ]


@pytest.mark.parametrize("name,fmt", FORMATS, ids=[f.__name__ for _, f in FORMATS])
@pytest.mark.parametrize("calls", [[WEATHER], [WEATHER, TRICKY, EMPTY]], ids=["one", "three"])
def test_calls_complete_and_streamed(
    marker_tokenizer: Any, name: str, fmt: Callable[[list[Call]], str], calls: list[Call]
) -> None:
    text = fmt(calls)
    outs = all_ways(marker_tokenizer, name, text)
    for out in outs:
        check(out, None, calls)
    # The streamed arguments are the model's own text, so every way gives the same strings.
    assert all(out == outs[0] for out in outs)


@pytest.mark.parametrize(
    "name,fmt", [f for f in FORMATS if f[1] in AFTER_TEXT], ids=[f.__name__ for _, f in FORMATS if f in AFTER_TEXT]
)
def test_text_before_the_calls(marker_tokenizer: Any, name: str, fmt: Callable[[list[Call]], str]) -> None:
    # The whitespace between the text and the call is dropped, as a client shows it.
    for out in all_ways(marker_tokenizer, name, "Let me look that up: [1] {soon} <tool\n\n" + fmt([WEATHER, TRICKY])):
        check(out, "Let me look that up: [1] {soon} <tool", [WEATHER, TRICKY])


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize(
    "text",
    [
        "It is sunny in Paris.",
        "  \n  indented",
        "",
        "a < b and [x] {y}; <tool",
        "ends with a marker's start <|py",
        "[TOOL",
    ],
)
def test_text_answers_are_content_unchanged(marker_tokenizer: Any, name: str, text: str) -> None:
    for out in all_ways(marker_tokenizer, name, text):
        assert out == ParsedOutput(text, [])


MALFORMED = {
    "hermes": [
        "<tool_call>\nnot json at all\n</tool_call>",
        'Sure. <tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}} extra</tool_call>',
        '<tool_call>{"name": 5}</tool_call>',
    ],
    "llama3_json": ["{this is not json}", '{"answer": 42}', '<|python_tag|>{"name": "f", "parameters": {]}'],
    "mistral": [
        "[TOOL_CALLS] garbage!",
        "[TOOL_CALLS][1, 2]",
        '[TOOL_CALLS][{"name": "f", "arguments": {}},]',
        "[TOOL_CALLS]f[ARGS]oops",
    ],
    "granite": [
        "<|tool_call|>not an array",
        "[1] is a citation",
        '<|tool_call|>[{"arguments": {}}]',
        "<|tool_call|>[]",
    ],
}


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in MALFORMED.items() for t in ts])
def test_malformed_calls_are_content(marker_tokenizer: Any, name: str, text: str) -> None:
    assert PARSERS[name]().parse(text) == ParsedOutput(text, [])
    parser = PARSERS[name]()
    assert parser.parse(text) and parser.malformed
    # Streamed: what was sent as a call stays sent; a call not yet named comes back as content.
    for out in all_ways(marker_tokenizer, name, text)[1:]:
        if not out.calls:
            assert out.content == text


@pytest.mark.parametrize("name,fmt", FORMATS, ids=[f.__name__ for _, f in FORMATS])
def test_a_call_cut_short_is_content(marker_tokenizer: Any, name: str, fmt: Callable[[list[Call]], str]) -> None:
    text = fmt([WEATHER])
    cut = text[: text.index("Paris")]  # max_tokens ended it inside the arguments
    assert PARSERS[name]().parse(cut) == ParsedOutput(cut, [])


@pytest.mark.parametrize("name,fmt", FORMATS, ids=[f.__name__ for _, f in FORMATS])
@pytest.mark.parametrize("at", ["print", '"run"', "run"], ids=["in-arguments", "in-name", "in-name-string"])
def test_the_calls_before_a_cut_are_calls(
    marker_tokenizer: Any, name: str, fmt: Callable[[list[Call]], str], at: str
) -> None:
    # max_tokens ended the answer inside its second call: the first is whole and comes back as a call, the
    # cut one not at all (finish_reason "length" says it was cut), whether read whole or streamed.
    text = fmt([WEATHER, TRICKY, EMPTY])
    if at not in text:
        pytest.skip(f"{fmt.__name__} does not quote names")
    cut = text[: text.index(at)]
    check(PARSERS[name]().parse(cut), None, [WEATHER])
    for out in all_ways(marker_tokenizer, name, cut)[1:]:
        assert not out.content and out.calls[0] == ParsedCall(
            "get_weather", PARSERS[name]().parse(cut).calls[0].arguments
        )
        assert len(out.calls) <= 2  # streamed, the cut call's name may have gone out already
    if fmt in AFTER_TEXT:
        check(PARSERS[name]().parse("Sure.\n" + cut), "Sure.", [WEATHER])


@pytest.mark.parametrize("name,fmt", FORMATS, ids=[f.__name__ for _, f in FORMATS])
def test_the_name_comes_first_and_the_arguments_as_they_arrive(name: str, fmt: Callable[[list[Call]], str]) -> None:
    text = fmt([WEATHER])
    parser = PARSERS[name]()
    first = parser.feed(text[: text.index("Paris") + 2])
    assert [(c.index, c.name) for c in first.calls] == [(0, "get_weather")]
    assert first.calls[0].arguments.endswith('"city": "Pa') and not first.content
    rest = parser.feed(text[text.index("Paris") + 2 :])
    assert [c.name for c in rest.calls] == [None]
    assert json.loads(first.calls[0].arguments + rest.calls[0].arguments) == WEATHER[1]


def test_mistral_call_ids_fit_its_templates() -> None:
    # Mistral's templates refuse history whose tool call ids are not 9 letters and digits.
    ids = {PARSERS["mistral"].call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert PARSERS["hermes"].call_id().startswith("call_")


def test_every_vllm_name_is_served() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "granite"}
    assert all(issubclass(p, ToolParser) and p.name == n for n, p in PARSERS.items())


def test_answer_stream_as_openai_chat_deltas() -> None:
    # OpenAI streams a call as {index, id, type, function: {name, arguments}} and then {index, function: {arguments}}.
    from servelm.server.tool_parsers.answer import AnswerStream, answer_calls

    text = "Sure.\n" + hermes([WEATHER, EMPTY])
    stream = AnswerStream(PARSERS["hermes"])
    deltas = [d for d in (stream.chat_delta(ch) for ch in text) if d] + [stream.chat_delta("", final=True) or {}]
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    firsts = [c for c in calls if "id" in c]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "now"),
    ]
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls if "id" not in c)
    joined = ["".join(c["function"]["arguments"] for c in calls if c["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in joined] == [WEATHER[1], EMPTY[1]] and stream.called
    content, whole = answer_calls(PARSERS["hermes"], text)
    assert content == "Sure." and [c["function"]["arguments"] for c in whole or ()] == joined
    assert answer_calls(PARSERS["hermes"], "no call") == ("no call", None)
