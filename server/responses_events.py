"""``POST /v1/responses``, the output side: the output items of a response and, for a stream, the typed
events (``response.output_item.added``, ``response.output_text.delta``...) that announce them as they form."""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from servelm.server.tool_parsers.answer import Piece
from servelm.server.tools import ToolMode


def hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(message_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text, logprobs)] if status != "in_progress" else [],
    }


def call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The thinking before the answer (with --reasoning-parser), as a ``reasoning`` item of ``reasoning_text``."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


class StreamedReasoning:
    """The reasoning item of a streamed response: opened by its first thinking text, its text streamed as
    ``response.reasoning_text.delta`` events, closed when the answer begins or the output ends."""

    def __init__(self, job: ResponseEvents) -> None:
        self.job = job
        self.id = hex_id("rs")
        self.texts: list[str] = []
        self.open = False
        self.item: dict[str, Any] | None = None  # once closed

    def add(self, text: str) -> list[bytes]:
        job, events = self.job, []
        if not self.open:
            self.open = True
            events.append(
                job.event("response.output_item.added", output_index=0, item=reasoning_item(self.id, "", "in_progress"))
            )
            events.append(
                job.event(
                    "response.content_part.added",
                    item_id=self.id,
                    output_index=0,
                    content_index=0,
                    part={"type": "reasoning_text", "text": ""},
                )
            )
        self.texts.append(text)
        events.append(
            job.event("response.reasoning_text.delta", item_id=self.id, output_index=0, content_index=0, delta=text)
        )
        return events

    def close(self, status: str) -> list[bytes]:
        if not self.open or self.item is not None:
            return []
        job, text = self.job, "".join(self.texts)
        self.item = reasoning_item(self.id, text, status)
        return [
            job.event("response.reasoning_text.done", item_id=self.id, output_index=0, content_index=0, text=text),
            job.event(
                "response.content_part.done",
                item_id=self.id,
                output_index=0,
                content_index=0,
                part={"type": "reasoning_text", "text": text},
            ),
            job.event("response.output_item.done", output_index=0, item=self.item),
        ]


def output_items(
    tools: ToolMode | None, message_id: str, text: str, logprobs: list[dict[str, Any]], reason: str | None
) -> list[dict[str, Any]]:
    """A finished output as items: one ``function_call`` item per call it parses to (after a message of the
    text a family's calls follow), else one message."""
    content, calls = tools.answer(text) if tools is not None else (text, None)
    if calls is not None:
        head = [message_item(message_id, content, logprobs, "completed")] if content else []
        return head + [call_item(c, hex_id("fc")) for c in calls]
    return [message_item(message_id, text, logprobs, "incomplete" if reason == "length" else "completed")]


class ResponseEvents(Protocol):
    """The response a stream's events belong to: its tools, its message item's id, and its event writer
    (which numbers the events)."""

    tools: ToolMode | None
    message_id: str

    def event(self, kind: str, **fields: Any) -> bytes: ...


class StreamedOutput:
    """The output items of a streamed response as they form, and the events that announce them.

    Text streams as ``response.output_text.delta`` events of one message item; a named function's
    arguments stream as ``response.function_call_arguments.delta`` events of one call item; an array of
    calls ("required", or "auto" once the output starts with ``[``) is announced whole when the output
    ends and parses (text that does not, cut by ``max_output_tokens``, is sent as the message then).
    With a family's parser (--tool-call-parser), the text before the calls streams as the message and
    each call as its own item, its arguments as they arrive."""

    def __init__(self, job: ResponseEvents) -> None:
        self.job = job
        self.tools = job.tools
        self.output: list[dict[str, Any]] = []  # finished items
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.mode: str | None = None if self.tools is not None else "text"  # "text" | "named" | "calls"
        self.item: dict[str, Any] | None = None  # the item being streamed
        self.reason: str | None = None
        self.base = 0  # the first answer item's output_index (1 after a reasoning item)
        self.answer = self.tools.answer_stream() if self.tools is not None else None

    def add(self, text: str, logprobs: list[dict[str, Any]], reason: str | None) -> list[bytes]:
        if self.answer is not None:
            return self._family(self.answer.feed(text, final=reason is not None), logprobs, reason)
        job, events = self.job, []
        if self.mode is None and text:
            assert self.tools is not None
            self.mode = "calls" if self.tools.is_call(text) else "text"
            if self.mode == "calls" and self.tools.name is not None:
                self.mode = "named"
        self.text.append(text)
        self.logprobs.extend(logprobs)
        if self.mode == "text" or (self.mode is None and reason is not None):
            if self.item is None:
                events += self._open_message()
            if text or logprobs:
                events.append(
                    job.event(
                        "response.output_text.delta",
                        item_id=job.message_id,
                        output_index=self.base,
                        content_index=0,
                        delta=text,
                        logprobs=logprobs,
                    )
                )
        elif self.mode == "named":
            if self.item is None:
                assert self.tools is not None and self.tools.name is not None
                call = {"id": hex_id("call"), "function": {"name": self.tools.name, "arguments": ""}}
                self.item = call_item(call, hex_id("fc"), "in_progress")
                events.append(job.event("response.output_item.added", output_index=self.base, item=self.item))
            if text:
                events.append(
                    job.event(
                        "response.function_call_arguments.delta",
                        item_id=self.item["id"],
                        output_index=self.base,
                        delta=text,
                    )
                )
        if reason is not None:
            self.reason = reason
            events += self._close()
        return events

    def _open_message(self) -> list[bytes]:
        job = self.job
        self.mode = "text"
        self.item = message_item(job.message_id, "", [], "in_progress")
        return [
            job.event("response.output_item.added", output_index=self.base, item=self.item),
            job.event(
                "response.content_part.added",
                item_id=job.message_id,
                output_index=self.base,
                content_index=0,
                part=text_part("", []),
            ),
        ]

    def _close(self) -> list[bytes]:
        job, events = self.job, []
        text = "".join(self.text)
        if self.mode == "named" and self.item is not None:
            assert self.tools is not None
            calls = self.tools.parse(text)
            if calls is not None:
                item = {**self.item, "status": "completed", "arguments": calls[0]["function"]["arguments"]}
                events.append(
                    job.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=self.base,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
                events.append(job.event("response.output_item.done", output_index=self.base, item=item))
                self.output = [item]
                return events
            # Cut before the arguments were complete: the call item ends incomplete, as it read.
            item = {**self.item, "status": "incomplete", "arguments": text}
            events.append(job.event("response.output_item.done", output_index=self.base, item=item))
            self.output = [item]
            return events
        if self.mode == "calls":
            items = output_items(self.tools, job.message_id, text, [], self.reason)
            if items[0]["type"] == "function_call":
                for k, item in enumerate(items):
                    added = {**item, "status": "in_progress", "arguments": ""}
                    events.append(job.event("response.output_item.added", output_index=self.base + k, item=added))
                    events.append(
                        job.event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=self.base + k,
                            delta=item["arguments"],
                        )
                    )
                    events.append(
                        job.event(
                            "response.function_call_arguments.done",
                            item_id=item["id"],
                            output_index=self.base + k,
                            name=item["name"],
                            arguments=item["arguments"],
                        )
                    )
                    events.append(job.event("response.output_item.done", output_index=self.base + k, item=item))
                self.output = items
                return events
            # Not calls after all (cut by max_output_tokens): the text as the message.
            events += self._open_message()
            if text:
                events.append(
                    job.event(
                        "response.output_text.delta",
                        item_id=job.message_id,
                        output_index=self.base,
                        content_index=0,
                        delta=text,
                        logprobs=self.logprobs,
                    )
                )
        elif self.item is None:
            events += self._open_message()
        return events + self._message_done(text)

    def _message_done(self, text: str) -> list[bytes]:
        """The message item's closing events (it is always the first answer item)."""
        job = self.job
        message = message_item(
            job.message_id, text, self.logprobs, "incomplete" if self.reason == "length" else "completed"
        )
        part = message["content"][0]
        self.output.append(message)
        self.item = None
        return [
            job.event(
                "response.output_text.done",
                item_id=job.message_id,
                output_index=self.base,
                content_index=0,
                text=text,
                logprobs=self.logprobs,
            ),
            job.event(
                "response.content_part.done", item_id=job.message_id, output_index=self.base, content_index=0, part=part
            ),
            job.event("response.output_item.done", output_index=self.base, item=message),
        ]

    def _family(self, pieces: list[Piece], logprobs: list[dict[str, Any]], reason: str | None) -> list[bytes]:
        """A family parser's pieces as items: the text as the message, each call its own item."""
        job, events = self.job, []
        for p in pieces:
            if p.index is None:
                if self.item is None:
                    events += self._open_message()
                self.text.append(p.text)
                self.logprobs.extend(logprobs)
                events.append(
                    job.event(
                        "response.output_text.delta",
                        item_id=job.message_id,
                        output_index=self.base,
                        content_index=0,
                        delta=p.text,
                        logprobs=logprobs,
                    )
                )
                logprobs = []
                continue
            if p.name is not None:
                events += self._end_item()
                self.item = call_item(
                    {"id": p.id, "function": {"name": p.name, "arguments": ""}}, hex_id("fc"), "in_progress"
                )
                events.append(
                    job.event("response.output_item.added", output_index=self.base + len(self.output), item=self.item)
                )
            assert self.item is not None
            self.item["arguments"] += p.text
            if p.text:
                events.append(
                    job.event(
                        "response.function_call_arguments.delta",
                        item_id=self.item["id"],
                        output_index=self.base + len(self.output),
                        delta=p.text,
                    )
                )
        if reason is not None:
            self.reason = reason
            if self.item is None and not self.output:  # no text at all: an empty message
                events += self._open_message()
            events += self._end_item()
        return events

    def _end_item(self) -> list[bytes]:
        """Close the item being streamed (a family's message or call)."""
        item = self.item
        if item is None:
            return []
        if item["type"] == "message":
            return self._message_done("".join(self.text))
        job, index = self.job, self.base + len(self.output)
        done = {**item, "status": "incomplete" if self.reason == "length" else "completed"}
        self.output.append(done)
        self.item = None
        return [
            job.event(
                "response.function_call_arguments.done",
                item_id=done["id"],
                output_index=index,
                name=done["name"],
                arguments=done["arguments"],
            ),
            job.event("response.output_item.done", output_index=index, item=done),
        ]
