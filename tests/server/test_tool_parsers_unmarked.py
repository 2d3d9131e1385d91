"""Calls written without the family's markers (server/tool_parsers/unmarked.py): the whole answer one
JSON call object, bare or in a fenced ```json block, as small models write them (Qwen2.5-Coder-0.5B/1.5B
answer "What is the weather like in Paris?" with a bare ``{"name": "get_weather", ...}`` under "auto").

Such an answer is a call only where that is unambiguous: it names a declared tool, has no other members,
its arguments are valid for the tool's schema, and nothing but whitespace (and the fence) surrounds it.
Everything else is the answer it was, whole and streamed: a normal answer that contains JSON stays one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_tool_parsers import WEATHER, check, hermes, token_chunks

from servelm.server.tool_parsers import PARSERS, ParsedCall, ParsedOutput, Tools
from servelm.server.tool_parsers.answer import AnswerStream, answer_calls
from servelm.server.tool_parsers.unmarked import UnmarkedCalls

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS: Tools = [("get_weather", CITY), ("now", {"type": "object", "properties": {}})]
CALL = json.dumps({"name": "get_weather", "arguments": WEATHER[1]})
PRETTY = json.dumps({"name": "get_weather", "arguments": WEATHER[1]}, indent=2)


def parse(name: str, text: str, tools: Tools = TOOLS) -> ParsedOutput:
    return UnmarkedCalls(PARSERS[name](), tools).parse(text)


def streamed(name: str, chunks: list[str], tools: Tools = TOOLS) -> ParsedOutput:
    parser = UnmarkedCalls(PARSERS[name](), tools)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[ParsedCall] = []
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.index == len(calls)
                calls.append(ParsedCall(c.name, ""))
            calls[c.index].arguments += c.arguments
    return ParsedOutput(content or None if calls else content, calls)


def all_ways(tok: Any, name: str, text: str, tools: Tools = TOOLS) -> list[ParsedOutput]:
    half = len(text) // 2
    return [
        parse(name, text, tools),
        streamed(name, list(text), tools),
        streamed(name, token_chunks(tok, text), tools),
        streamed(name, [text[:half], text[half:]], tools),
    ]


CALLS = {
    "bare": CALL,
    "bare-pretty": f"\n{PRETTY}\n",
    "fenced": f"```json\n{CALL}\n```",
    "fenced-pretty": f"```json\n{PRETTY}\n```\n",
    "fenced-no-language": f"```\n{CALL}\n```",
    "fenced-unclosed": f"```json\n{PRETTY}\n",  # the model ended before closing its block
    "parameters": json.dumps({"name": "get_weather", "parameters": WEATHER[1]}),  # as Llama writes it
    "arguments-first": json.dumps({"arguments": WEATHER[1], "name": "get_weather"}),
}


@pytest.mark.parametrize("name", ["hermes", "mistral", "granite"])
@pytest.mark.parametrize("text", list(CALLS.values()), ids=list(CALLS))
def test_an_unmarked_call_is_a_call(marker_tokenizer: Any, name: str, text: str) -> None:
    outs = all_ways(marker_tokenizer, name, text)
    for out in outs:
        check(out, None, [WEATHER])
    assert all(out == outs[0] for out in outs)  # the arguments are the model's own text, every way


def test_a_call_without_arguments_takes_none(marker_tokenizer: Any) -> None:
    for out in all_ways(marker_tokenizer, "hermes", '```json\n{"name": "now"}\n```'):
        assert out == ParsedOutput(None, [ParsedCall("now", "{}")])


def test_llama3_reads_its_own_bare_object_and_a_fenced_one(marker_tokenizer: Any) -> None:
    # A bare object is Llama 3's own format (its parser streams it); the fence is read here.
    for text in [json.dumps({"name": "get_weather", "parameters": WEATHER[1]}), f"```json\n{CALL}\n```"]:
        for out in all_ways(marker_tokenizer, "llama3_json", text):
            check(out, None, [WEATHER])


# Answers that contain JSON and are not calls: each comes back whole as content, however it streams.
NOT_CALLS = {
    "a-person": '{"name": "Alice", "age": 30, "city": "New York"}',
    "a-person-fenced": '```json\n{\n  "name": "Alice",\n  "age": 30,\n  "city": "New York"\n}\n```',
    "a-book-shaped-like-a-call": '```json\n{"name": "The Great Gatsby", "arguments": {"author": "F. Scott Fitzgerald"}}\n```',
    "an-undeclared-tool": '{"name": "hello", "arguments": {"type": "string"}}',
    "arguments-invalid": '```json\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n```',
    "arguments-wrong-type": '{"name": "get_weather", "arguments": {"city": 75}}',
    "arguments-not-an-object": '{"name": "get_weather", "arguments": "Paris"}',
    "an-enum-broken": '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',
    "another-member": '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 1}',
    "both-argument-keys": '{"name": "get_weather", "arguments": {"city": "Paris"}, "parameters": {"city": "Paris"}}',
    "text-before": f"Here is the call:\n```json\n{CALL}\n```",
    "text-after": f"{CALL}\nThat is how you would call it.",
    "text-after-the-fence": f"```json\n{CALL}\n```\nThat is how you would call it.",
    "two-objects": f"{CALL}\n{CALL}",
    "another-language": f"```python\n{CALL}\n```",
    "an-array": f"```json\n[{CALL}]\n```",
    "cut-short": CALL[: CALL.index("Paris")],
    "a-fence-half-closed": f"```json\n{CALL}\n``",
    "not-json": "```json\n{name: get_weather}\n```",
    "plain-text": "Bonjour",
    "a-brace-in-prose": "{braces} are fine here",
}


@pytest.mark.parametrize("name", ["hermes", "mistral", "granite"])
@pytest.mark.parametrize("text", list(NOT_CALLS.values()), ids=list(NOT_CALLS))
def test_an_answer_that_merely_contains_json_is_no_call(marker_tokenizer: Any, name: str, text: str) -> None:
    for out in all_ways(marker_tokenizer, name, text):
        assert out == ParsedOutput(text, [])


def test_without_declared_tools_nothing_is_read() -> None:
    assert parse("hermes", CALL, []) == ParsedOutput(CALL, [])


def test_the_family_markers_still_work_after_an_unmarked_start(marker_tokenizer: Any) -> None:
    # A fence that is no call and then a real <tool_call>: the family's parser reads the whole answer.
    text = "```json\n{}\n```\n" + hermes([WEATHER])
    for out in all_ways(marker_tokenizer, "hermes", text):
        check(out, "```json\n{}\n```", [WEATHER])


def test_held_back_only_while_it_can_be_a_call() -> None:
    parser = UnmarkedCalls(PARSERS["hermes"](), TOOLS)
    # The start of a fence and of a call's object is held: it may still become a call.
    assert not parser.feed("```json\n{\n")
    assert not parser.feed('  "name": "get_')
    # A name that is no declared tool decides it: everything so far goes out as content at once.
    assert parser.feed('x", "age": 3').content == '```json\n{\n  "name": "get_x", "age": 3'
    assert parser.feed("}").content == "}"
    # A code block in another language is content as soon as its language shows.
    other = UnmarkedCalls(PARSERS["hermes"](), TOOLS)
    assert other.feed("```py").content == "```py"


def test_a_whole_call_is_sent_at_the_end_as_tool_call_deltas() -> None:
    # Only the end tells that the object was the whole answer: the call goes out then, named and argued.
    stream = AnswerStream(PARSERS["hermes"], TOOLS)
    deltas = [stream.chat_delta(ch) for ch in f"```json\n{CALL}\n```"]
    assert not any(deltas)
    final = stream.chat_delta("", final=True)
    assert final is not None and "content" not in final and stream.called
    (call,) = final["tool_calls"]
    assert (call["index"], call["type"], call["function"]["name"]) == (0, "function", "get_weather")
    assert json.loads(call["function"]["arguments"]) == WEATHER[1] and call["id"].startswith("call_")


def test_answer_calls_reads_unmarked_calls_of_the_declared_tools() -> None:
    content, calls = answer_calls(PARSERS["hermes"], CALL, TOOLS)
    assert content is None and [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or ()
    ] == [WEATHER]
    assert answer_calls(PARSERS["hermes"], NOT_CALLS["a-person"], TOOLS) == (NOT_CALLS["a-person"], None)
    assert answer_calls(PARSERS["hermes"], CALL) == (CALL, None)  # no tools given: the family's markers only
