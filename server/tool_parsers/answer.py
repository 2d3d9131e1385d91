"""A family parser's results in the shape the APIs share: OpenAI tool calls (chat's ``tool_calls``, which
Responses' ``function_call`` items and Messages' ``tool_use`` blocks are mapped from), whole or as
stream events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelm.server.tool_parsers.base import AnswerParser, ToolParser, Tools, parse_text
from servelm.server.tool_parsers.unmarked import UnmarkedCalls


def answer_parser(family: type[ToolParser], tools: Tools | None = None) -> AnswerParser:
    """One answer's parser: the family's markers, and an unmarked call of one of ``tools`` (the
    declared tools; none: markers only)."""
    return UnmarkedCalls(family(), tools) if tools else family()


def answer_calls(
    family: type[ToolParser], text: str, tools: Tools | None = None
) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A finished answer's content and OpenAI tool calls (None when it calls nothing, and the
    content is then the whole text)."""
    parsed = parse_text(answer_parser(family, tools), text)
    if not parsed.calls:
        return text, None
    calls = [
        {"id": family.call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.calls
    ]
    return parsed.content, calls


@dataclass
class Piece:
    """One step of a streamed answer: ``text`` of its content, or of call ``index``'s arguments; a call's
    first piece carries its ``id`` and ``name``."""

    text: str
    index: int | None = None  # None: content
    id: str | None = None
    name: str | None = None


class AnswerStream:
    """One streamed output through a family's parser: each text delta -> content and call pieces."""

    def __init__(self, family: type[ToolParser], tools: Tools | None = None) -> None:
        self.family = family
        self.parser = answer_parser(family, tools)

    @property
    def called(self) -> bool:
        """Whether the answer made calls (a call sent stays sent, even if the text went wrong later)."""
        return self.parser.calls > 0

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        deltas = [self.parser.feed(text)] if text else []
        if final:
            deltas.append(self.parser.finish())
        pieces: list[Piece] = []
        for d in deltas:
            if d.content:
                pieces.append(Piece(d.content))
            for c in d.calls:
                if c.name is not None:
                    pieces.append(Piece(c.arguments, c.index, self.family.call_id(), c.name))
                elif c.arguments:
                    pieces.append(Piece(c.arguments, c.index))
        return pieces

    def chat_delta(self, text: str, final: bool = False) -> dict[str, Any] | None:
        """The OpenAI chat ``delta`` for ``text`` (None when there is nothing to send yet): the first
        piece of a call has its id, type and name, later ones only arguments, as OpenAI streams them."""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for p in self.feed(text, final):
            if p.index is None:
                content.append(p.text)
            elif p.name is not None:
                calls.append(
                    {
                        "index": p.index,
                        "id": p.id,
                        "type": "function",
                        "function": {"name": p.name, "arguments": p.text},
                    }
                )
            else:
                calls.append({"index": p.index, "function": {"arguments": p.text}})
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = "".join(content)
        if calls:
            delta["tool_calls"] = calls
        return delta or None
