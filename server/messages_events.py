"""``POST /v1/messages``, the output side: the content blocks, stop reason and usage of an answer and, for a
stream, Anthropic's typed events (``message_start``, ``content_block_start``/``delta``/``stop``,
``message_delta``, ``message_stop``, ``ping``; ``error`` when the request fails mid-stream)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from servelm.server.errors import APIError, anthropic_error
from servelm.server.reasoning import ReasoningMode, ReasoningStream
from servelm.server.request_group import RequestGroup
from servelm.server.serving_outputs import UsageCounter, counted_outputs, dumps
from servelm.server.tool_parsers.answer import Piece
from servelm.server.tools import ToolMode


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as a ``tool_use`` block, its arguments parsed into ``input``."""
    function = call["function"]
    return {
        "type": "tool_use",
        "id": tool_use_id(),
        "name": function["name"],
        "input": json.loads(function["arguments"]),
    }


def thinking_block(text: str) -> dict[str, Any]:
    """The thinking before the answer (with --reasoning-parser). Its signature is empty: there is nothing
    to verify when the thinking comes back in a later turn's history."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_blocks(tools: ToolMode | None, text: str) -> list[dict[str, Any]]:
    """A finished output as blocks: one ``tool_use`` per call it parses to (after a ``text`` block of the
    text a family's calls follow), else one ``text`` block."""
    content, calls = tools.answer(text) if tools is not None else (text, None)
    if calls is not None:
        return ([{"type": "text", "text": content}] if content else []) + [tool_use_block(c) for c in calls]
    return [{"type": "text", "text": text}]


def stop_reason(called: bool, finish: str | None, matched: str | int | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``: whether the answer is complete calls, the engine's
    finish and the stop that matched."""
    if called:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str):  # a stop string (an int is a stop token id: the turn's end)
        return "stop_sequence", matched
    return "end_turn", None


def usage(counter: UsageCounter) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from ``input_tokens``; their sum is the
    prompt (what ``count_tokens`` returns)."""
    cached = counter.cached_tokens
    return {
        "input_tokens": counter.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": counter.completion_tokens,
    }


def event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n".encode()


class MessageStream:
    """One streamed answer: engine outputs -> Anthropic's events.

    Text streams as ``text_delta``s of one text block; a named tool's arguments stream as
    ``input_json_delta``s of one ``tool_use`` block; calls to any tool ("any", or "auto" once the output
    starts with ``[``) are announced whole when the output ends and parses (text that does not, cut by
    ``max_tokens``, is sent as a text block then). With a family's parser (--tool-call-parser), text
    and calls stream as the parser reads them: a ``tool_use`` block per call, its input as it arrives."""

    def __init__(
        self,
        message_id: str,
        model: str,
        tools: ToolMode | None,
        group: RequestGroup,
        counter: UsageCounter,
        reasoning: ReasoningMode | None = None,
    ) -> None:
        self.id = message_id
        self.split = ReasoningStream(reasoning.parser, reasoning.phase) if reasoning is not None else None
        self.show_thinking = reasoning is not None and reasoning.include
        self.thinking = False  # a thinking block is open
        self.model = model
        self.tools = tools
        self.group = group
        self.counter = counter
        self.mode: str | None = None if tools is not None else "text"  # "text" | "named" | "calls"
        self.texts: list[str] = []
        self.index = 0  # the next block's index
        self.open: dict[str, Any] | None = None  # the block being streamed
        self.called = False  # the answer is complete tool calls
        self.answer = tools.answer_stream() if tools is not None else None
        if self.answer is not None:
            self.mode = "family"

    def message(self) -> dict[str, Any]:
        prompt = self.counter.prompt_tokens
        return {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt, "output_tokens": 0},
        }  # fmt: skip

    async def events(self) -> AsyncIterator[bytes]:
        yield event("message_start", message=self.message())
        yield event("ping")
        finish: str | None = None
        matched: str | int | None = None
        async for _, out in counted_outputs(self.group, self.counter):
            for c in out.outputs:
                text = c.new_text
                if self.split is not None:
                    thinking, text = self.split.feed(text, final=c.finish_reason is not None)
                    for e in self._think(thinking, ends=bool(text) or c.finish_reason is not None):
                        yield e
                if self.split is None or text:
                    for e in self._add(text):
                        yield e
                if c.finish_reason is not None:
                    finish, matched = c.finish_reason, c.stop_reason
        self.group.close()
        for e in self._close():
            yield e
        reason, sequence = stop_reason(self.called, finish, matched)
        yield event(
            "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage(self.counter)
        )
        yield event("message_stop")

    def failed(self, err: APIError) -> bytes:
        """The stream's last word when the request fails: Anthropic's ``error`` event."""
        return event("error", error=anthropic_error(err)[1]["error"])

    def _start(self, block: dict[str, Any]) -> bytes:
        self.open = block
        return event("content_block_start", index=self.index, content_block=block)

    def _stop(self) -> bytes:
        self.open = None
        self.index += 1
        return event("content_block_stop", index=self.index - 1)

    def _think(self, text: str, ends: bool) -> list[bytes]:
        """A thinking block's events: opened by the first thinking text, closed (with its signature) when
        the answer begins or the output ends."""
        events: list[bytes] = []
        if text and self.show_thinking:
            if not self.thinking:
                self.thinking = True
                events.append(self._start(thinking_block("")))
            events.append(
                event("content_block_delta", index=self.index, delta={"type": "thinking_delta", "thinking": text})
            )
        if ends and self.thinking:
            self.thinking = False
            events.append(
                event("content_block_delta", index=self.index, delta={"type": "signature_delta", "signature": ""})
            )
            events.append(self._stop())
        return events

    def _add(self, text: str) -> list[bytes]:
        if self.answer is not None:
            return self._pieces(self.answer.feed(text))
        events: list[bytes] = []
        tools = self.tools
        if self.mode is None and text:
            assert tools is not None
            self.mode = "text" if not tools.is_call(text) else "named" if tools.name is not None else "calls"
        self.texts.append(text)
        if self.mode == "text":
            if self.open is None:
                events.append(self._start({"type": "text", "text": ""}))
            if text:
                events.append(
                    event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text})
                )
        elif self.mode == "named":
            if self.open is None:
                assert tools is not None and tools.name is not None
                events.append(self._start({"type": "tool_use", "id": tool_use_id(), "name": tools.name, "input": {}}))
            if text:
                events.append(
                    event(
                        "content_block_delta",
                        index=self.index,
                        delta={"type": "input_json_delta", "partial_json": text},
                    )
                )
        return events

    def _pieces(self, pieces: list[Piece]) -> list[bytes]:
        """A family parser's pieces as blocks: text into a text block, each call its own tool_use block."""
        events: list[bytes] = []
        for p in pieces:
            starts = p.name is not None or (p.index is None and (self.open is None or self.open["type"] != "text"))
            if starts and self.open is not None:
                events.append(self._stop())
            if p.index is None:
                if starts:
                    events.append(self._start({"type": "text", "text": ""}))
                events.append(
                    event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": p.text})
                )
                continue
            if p.name is not None:
                events.append(self._start({"type": "tool_use", "id": tool_use_id(), "name": p.name, "input": {}}))
            if p.text:
                events.append(
                    event(
                        "content_block_delta",
                        index=self.index,
                        delta={"type": "input_json_delta", "partial_json": p.text},
                    )
                )
        return events

    def _close(self) -> list[bytes]:
        if self.answer is not None:
            events = self._pieces(self.answer.feed("", final=True))
            self.called = self.answer.called
            if self.open is None:  # no text at all
                events.append(self._start({"type": "text", "text": ""}))
            return [*events, self._stop()]
        text = "".join(self.texts)
        if self.mode == "named" and self.open is not None:
            assert self.tools is not None
            # Cut before the arguments were complete, the block ends as it read and the stop is max_tokens.
            self.called = self.tools.parse(text) is not None
            return [self._stop()]
        events = []
        if self.mode == "calls":
            blocks = content_blocks(self.tools, text)
            if blocks[0]["type"] == "tool_use":
                self.called = True
                for block in blocks:
                    events.append(self._start({**block, "input": {}}))
                    partial = json.dumps(block["input"], ensure_ascii=False)
                    events.append(
                        event(
                            "content_block_delta",
                            index=self.index,
                            delta={"type": "input_json_delta", "partial_json": partial},
                        )
                    )
                    events.append(self._stop())
                return events
        if self.open is None:  # calls that did not parse, or no text at all
            events.append(self._start({"type": "text", "text": ""}))
            if self.mode == "calls" and text:
                events.append(
                    event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text})
                )
        events.append(self._stop())
        return events
