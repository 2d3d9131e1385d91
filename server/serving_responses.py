"""``POST /v1/responses`` (OpenAI's Responses API) on top of the chat machinery.

A request is translated into a chat request (``server.responses_input``), then validated, rendered and
queued as ``/v1/chat/completions`` would (``server.serving_chat.start_chat``), with errors naming the
Responses field. The output is one ``message`` item, or one ``function_call`` item per call
(``server.responses_events``). Streams send OpenAI's typed events (``response.created`` ...
``response.completed``, or ``response.failed``), with no ``[DONE]``.

Finished responses are kept (unless ``store: false``) in a bounded in-memory store, so a request can
continue one with ``previous_response_id`` and ``GET /v1/responses/{id}`` returns it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.server.errors import APIError, bad_request
from servelm.server.logprobs import chat_logprobs_content
from servelm.server.protocol_chat import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from servelm.server.protocol_responses import ResponsesRequest
from servelm.server.reasoning import split_reasoning
from servelm.server.response_store import ResponseStore, StoredResponse
from servelm.server.responses_events import StreamedOutput, StreamedReasoning, hex_id, output_items, reasoning_item
from servelm.server.responses_input import refuse_unsupported, responses_param, to_chat_request
from servelm.server.serving_chat import ChatStart, start_chat
from servelm.server.serving_common import ServingContext, until_disconnect
from servelm.server.serving_outputs import (
    EventStreamResponse,
    UsageCounter,
    collect_choices,
    counted_outputs,
    dumps,
    end_on_error,
)


async def create_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    created = int(time.time())
    response_id = hex_id("resp")
    ctx.fields.note(raw, req, response_id, "/v1/responses")
    # With a reasoning parser the model thinks as it was trained to: 'reasoning' (effort, summary) is accepted.
    refuse_unsupported(req if ctx.reasoning_parser is None else req.model_copy(update={"reasoning": None}))
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise bad_request(
                f"Previous response with id '{req.previous_response_id}' not found (this server keeps the last "
                f"{store.capacity} stored responses, in memory).",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = previous.history
    chat, where = to_chat_request(req, history, ctx.reasoning_parser is not None)
    try:
        start = await start_chat(ctx, chat, arrival, response_id)
    except APIError as e:
        e.param = responses_param(e.param, where)
        raise
    job = _Response(ctx, store, req, chat, start, response_id, created)
    if req.stream:
        return EventStreamResponse(end_on_error(job.stream(), start.group, job.failed), start.group)
    body = await until_disconnect(raw, job.collect(), start.group)
    return JSONResponse(body)


class _Response:
    """One response in flight: engine outputs -> output items, the response object, stream events."""

    def __init__(
        self,
        ctx: ServingContext,
        store: ResponseStore,
        req: ResponsesRequest,
        chat: ChatCompletionRequest,
        start: ChatStart,
        response_id: str,
        created: int,
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.req = req
        self.chat = chat
        self.tools = start.tools
        self.start = start
        self.group = start.group
        self.model = start.model
        self.usage = UsageCounter([len(start.prompt_ids)], 1)
        self.id = response_id
        self.created = created
        self.message_id = hex_id("msg")
        self.want_logprobs = chat.logprobs
        self.seq = 0  # the next stream event's sequence_number
        self.streamed: StreamedOutput | None = None  # a stream's output so far
        self.thought: StreamedReasoning | None = None  # a stream's reasoning item

    # ---- the response object

    def body(self, status: str, output: list[dict[str, Any]], finished: bool) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        usage = None
        if finished:
            p, c = self.usage.prompt_tokens, self.usage.completion_tokens
            usage = {
                "input_tokens": p,
                "input_tokens_details": {"cached_tokens": self.usage.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": c,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": p + c,
            }
        choice = req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if finished and status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
            },
            "tool_choice": choice.model_dump(exclude_none=True)
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _finish(self, output: list[dict[str, Any]], reason: str | None) -> dict[str, Any]:
        """The final response object; stored unless ``store: false``."""
        status = "incomplete" if reason == "length" else "completed"
        body = self.body(status, output, finished=True)
        if self.req.store is not False:
            self.store.put(self.id, StoredResponse(body, self._history(output)))
        return body

    def _history(self, output: list[dict[str, Any]]) -> list[ChatMessage]:
        """The conversation a next turn continues: this one's messages, without its instructions, and its output."""
        messages = list(self.chat.messages[1:] if self.req.instructions is not None else self.chat.messages)
        calls = [
            ToolCall(id=o["call_id"], function=FunctionCall(name=o["name"], arguments=o["arguments"]))
            for o in output
            if o["type"] == "function_call"
        ]
        # A message item: the whole answer, or (with a family's parser) the text its calls follow.
        message = next((o for o in output if o["type"] == "message"), None)
        text = message["content"][0]["text"] if message is not None else None
        messages.append(ChatMessage(role="assistant", content=text, tool_calls=calls or None))
        return messages

    # ---- non-streaming

    async def collect(self) -> dict[str, Any]:
        collected = await collect_choices(self.group, self.usage)
        reason = collected.finish[0]
        lp = chat_logprobs_content(self.ctx.token_strings, collected.logprobs[0]) if self.want_logprobs else []
        text, thought = collected.text(0), []
        mode = self.start.reasoning
        if mode is not None:
            thinking, text = split_reasoning(mode.parser, mode.phase, text)
            if thinking is not None and mode.include:
                status = "incomplete" if reason == "length" and not text else "completed"
                thought = [reasoning_item(hex_id("rs"), thinking, status)]
        return self._finish(thought + output_items(self.tools, self.message_id, text, lp, reason), reason)

    # ---- streaming

    def event(self, kind: str, **fields: Any) -> bytes:
        """One typed stream event, numbered in the order the stream sends them."""
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n".encode()

    async def stream(self) -> AsyncIterator[bytes]:
        yield self.event("response.created", response=self.body("in_progress", [], finished=False))
        yield self.event("response.in_progress", response=self.body("in_progress", [], finished=False))
        self.streamed = events = StreamedOutput(self)
        split = self.start.splitter()
        mode = self.start.reasoning
        self.thought = thought = StreamedReasoning(self) if mode is not None and mode.include else None
        async for _, out in counted_outputs(self.group, self.usage):
            for c in out.outputs:
                # The thinking tokens' logprobs are not sent (they belong to no output_text).
                lp = (
                    chat_logprobs_content(self.ctx.token_strings, c.new_logprobs)
                    if self.want_logprobs and c.new_logprobs
                    else []
                )
                reason = c.finish_reason
                thinking, text = (
                    split.feed(c.new_text, final=reason is not None) if split is not None else ("", c.new_text)
                )
                if thought is not None:
                    for event in thought.add(thinking) if thinking else ():
                        yield event
                    if thought.open and (text or reason is not None):
                        for event in thought.close("incomplete" if reason == "length" and not text else "completed"):
                            yield event
                        events.base = 1
                if split is None or text or reason is not None:
                    for event in events.add(text, lp if not thinking else [], reason):
                        yield event
        self.group.close()
        kind = "response.incomplete" if events.reason == "length" else "response.completed"
        yield self.event(kind, response=self._finish(self._streamed_items(), events.reason))

    def _streamed_items(self) -> list[dict[str, Any]]:
        """The stream's output so far: its reasoning item (once closed), then the answer's items."""
        thought = self.thought
        head = [thought.item] if thought is not None and thought.item is not None else []
        return head + (self.streamed.output if self.streamed is not None else [])

    def failed(self, err: APIError) -> bytes:
        """The Responses stream's last word when the request fails: ``response.failed`` with what was output."""
        body = self.body("failed", self._streamed_items(), finished=False)
        body["error"] = {"code": "server_error", "message": err.message}
        return self.event("response.failed", response=body)


def stored_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")
    return stored.body
