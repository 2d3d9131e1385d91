"""``POST /v1/responses`` (OpenAI's Responses API) on top of the chat machinery.

A request is translated into a chat request: ``instructions`` become a system message, the input items
(messages, earlier ``function_call``s, ``function_call_output``s) become chat messages, function tools
become chat tools and ``text.format`` the response format; it is then validated, rendered and queued as
``/v1/chat/completions`` would (``server.serving_chat.start_chat``), with errors naming the Responses
field. The output is one ``message`` item, or one ``function_call`` item per call. Streams send
OpenAI's typed events (``response.created`` ... ``response.completed``), with no ``[DONE]``.

Finished responses are kept (unless ``store: false``) in a bounded in-memory store, so a request can
continue one with ``previous_response_id`` and ``GET /v1/responses/{id}`` returns it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from servelm.server.errors import APIError, bad_request, loc_to_param, unsupported
from servelm.server.logprobs import chat_logprobs_content
from servelm.server.protocol import JsonSchemaFormat, ResponseFormat
from servelm.server.protocol_chat import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from servelm.server.protocol_responses import INCLUDE_LOGPROBS, InputItem, InputPart, ResponsesRequest
from servelm.server.response_store import ResponseStore, StoredResponse
from servelm.server.serving_chat import ChatStart, start_chat
from servelm.server.serving_common import EventStreamResponse, ServingContext, check_output_error, output_error, until_disconnect

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
# The SamplingExtensions fields a Responses request passes on unchanged.
_EXTENSIONS = (
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "cache_salt", "priority",
)


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ------------------------------------------------------------------------------------- the request


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise unsupported("background", "'background' responses are not supported by this server")
    for name in ("conversation", "prompt", "context_management", "moderation"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    if req.reasoning is not None and (not isinstance(req.reasoning, dict) or any(v is not None for v in req.reasoning.values())):
        raise unsupported("reasoning", "'reasoning' is not supported: the served model is not a reasoning model")
    if req.truncation == "auto":
        raise unsupported(
            "truncation", "'truncation: auto' is not supported: a conversation longer than the context is refused"
        )
    if req.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "'prompt_logprobs' is not supported on /v1/responses")


def _part_text(part: InputPart, where: str) -> str:
    if part.type in _TEXT_PARTS:
        if part.text is None:
            raise bad_request(f"Missing required parameter: '{where}.text'.", param=f"{where}.text")
        return part.text
    if part.type == "refusal":  # an earlier answer's refusal, as it read
        return part.refusal or ""
    raise unsupported(f"{where}.type", f"content parts of type '{part.type}' are not supported (text only)")


def _content(content: str | list[InputPart] | None, where: str) -> str:
    if content is None:
        raise bad_request(f"Missing required parameter: '{where}'.", param=where)
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(p, f"{where}[{k}]") for k, p in enumerate(content))


def _required(item: InputItem, name: str, where: str) -> str:
    value = getattr(item, name)
    if value is None:
        raise bad_request(f"Missing required parameter: '{where}.{name}'.", param=f"{where}.{name}")
    return value


def input_messages(req: ResponsesRequest) -> tuple[list[ChatMessage], list[str]]:
    """``req.input`` as chat messages, and for each message the input field it came from (errors found
    later name it). Consecutive ``function_call`` items are one assistant message's calls."""
    if req.input is None:
        raise bad_request("Missing required parameter: 'input'.", param="input")
    if isinstance(req.input, str):
        return [ChatMessage(role="user", content=req.input)], ["input"]
    messages: list[ChatMessage] = []
    where: list[str] = []
    for j, item in enumerate(req.input):
        w = f"input[{j}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role not in _ROLES:
                raise bad_request(
                    f"Invalid value for '{w}.role': {item.role!r} (expected user, assistant, system or developer).",
                    param=f"{w}.role",
                )
            messages.append(ChatMessage(role=item.role, content=_content(item.content, f"{w}.content")))
        elif kind == "function_call":
            arguments = _required(item, "arguments", w)
            try:
                json.loads(arguments)
            except ValueError:
                raise bad_request(f"'{w}.arguments' is not valid JSON.", param=f"{w}.arguments") from None
            call = ToolCall(id=_required(item, "call_id", w), function=FunctionCall(name=_required(item, "name", w), arguments=arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and where[-1].startswith("input["):
                last.tool_calls = [*(last.tool_calls or []), call]  # the same turn: text and/or calls
                continue
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = _content(item.output, f"{w}.output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=_required(item, "call_id", w)))
        else:
            raise unsupported(f"{w}.type", f"input items of type '{kind}' are not supported (messages and function calls only)")
        where.append(w)
    if not messages:
        raise bad_request("'input' is empty.", param="input")
    return messages, where


def _tools(req: ResponsesRequest) -> list[ChatTool] | None:
    if req.tools is None:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise unsupported(f"tools[{i}].type", f"tools of type '{t.type}' are not supported (function tools only)")
        if t.name is None:
            raise bad_request(f"Missing required parameter: 'tools[{i}].name'.", param=f"tools[{i}].name")
        fn = FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)
        tools.append(ChatTool(type="function", function=fn))
    return tools


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise unsupported("tool_choice", f"'tool_choice' of type '{choice.type}' is not supported (none, auto, required or a function)")
    if choice.name is None:
        raise bad_request("Missing required parameter: 'tool_choice.name'.", param="tool_choice.name")
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else ResponseFormat(type=fmt.type)
    for name, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if value is None:
            raise bad_request(f"Missing required parameter: 'text.format.{name}'.", param=f"text.format.{name}")
    schema = JsonSchemaFormat(name=fmt.name or "", description=fmt.description, schema=fmt.schema_, strict=fmt.strict)
    return ResponseFormat(type="json_schema", json_schema=schema)


def wants_logprobs(req: ResponsesRequest) -> bool:
    return INCLUDE_LOGPROBS in (req.include or ())


def to_chat_request(req: ResponsesRequest, history: list[ChatMessage]) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request that serves ``req`` after ``history``, and where each of its messages came from."""
    messages, where = input_messages(req)
    messages = [*history, *messages]
    where = ["previous_response_id"] * len(history) + where
    if req.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
        where.insert(0, "instructions")
    logprobs = wants_logprobs(req)
    fields: dict[str, Any] = {name: getattr(req, name) for name in _EXTENSIONS}
    try:
        chat = ChatCompletionRequest(
            model=req.model,
            messages=messages,
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            logprobs=logprobs,
            top_logprobs=req.top_logprobs if logprobs else None,
            stream=req.stream,
            tools=_tools(req),
            tool_choice=_tool_choice(req),
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=_response_format(req),
            **fields,
        )
    except ValidationError as e:  # a combination the field-by-field checks above let through
        err = e.errors()[0]  # (more messages than a request may have, with the history, say)
        raise bad_request(f"Invalid request: {err['msg']}", param=responses_param(loc_to_param(err["loc"]), where)) from None
    return chat, where


_SIMPLE_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}


def responses_param(param: str | None, where: list[str]) -> str | None:
    """The Responses field for a chat request's field named in an error."""
    if param is None:
        return None
    m = re.fullmatch(r"messages\[(\d+)\](.*)", param)
    if m:
        rest = m.group(2)
        if rest.startswith(".tool_calls"):
            rest = ".arguments" if rest.endswith(".arguments") else ""
        return where[int(m.group(1))] + rest.replace(".tool_call_id", ".call_id")
    m = re.fullmatch(r"tools\[(\d+)\]\.function\.(.*)", param)
    if m:
        return f"tools[{m.group(1)}].{m.group(2)}"
    return _SIMPLE_PARAMS.get(param, param)


# ------------------------------------------------------------------------------------ the handler


async def create_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    created = int(time.time())
    _refuse_unsupported(req)
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
    chat, where = to_chat_request(req, history)
    response_id = _hex_id("resp")
    try:
        start = await start_chat(ctx, chat, arrival, response_id)
    except APIError as e:
        e.param = responses_param(e.param, where)
        raise
    job = _Response(ctx, store, req, chat, start, response_id, created)
    if req.stream:
        return EventStreamResponse(job.stream(), start.group)
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
        self.group = start.group
        self.model = start.model
        self.num_prompt_tokens = len(start.prompt_ids)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.id = response_id
        self.created = created
        self.message_id = _hex_id("msg")
        self.want_logprobs = chat.logprobs
        self.seq = 0  # the next stream event's sequence_number

    # ---- the response object

    def body(self, status: str, output: list[dict[str, Any]], finished: bool) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        usage = None
        if finished:
            p, c = self.num_prompt_tokens, self.num_output_tokens
            usage = {
                "input_tokens": p,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens, "cache_write_tokens": 0},
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
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            "tool_choice": choice.model_dump(exclude_none=True) if choice is not None and not isinstance(choice, str) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _message(self, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_text_part(text, logprobs)] if status != "in_progress" else [],
        }

    @staticmethod
    def _call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
        return {
            "id": item_id,
            "type": "function_call",
            "status": status,
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
        }

    def _output(self, text: str, logprobs: list[dict[str, Any]], reason: str | None) -> list[dict[str, Any]]:
        calls = self.tools.parse(text) if self.tools is not None else None
        if calls is not None:
            return [self._call_item(c, _hex_id("fc")) for c in calls]
        return [self._message(text, logprobs, "incomplete" if reason == "length" else "completed")]

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
        calls = [ToolCall(id=o["call_id"], function=FunctionCall(name=o["name"], arguments=o["arguments"])) for o in output if o["type"] == "function_call"]
        if calls:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=calls))
        else:
            messages.append(ChatMessage(role="assistant", content=output[0]["content"][0]["text"]))
        return messages

    # ---- non-streaming

    async def collect(self) -> dict[str, Any]:
        texts: list[str] = []
        logprobs: list[Any] = []
        reason = None
        async for out in self.group:
            check_output_error(out)
            self.num_cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                texts.append(c.new_text)
                if c.new_logprobs:
                    logprobs.extend(c.new_logprobs)
                if c.finish_reason is not None:
                    reason = c.finish_reason
                self.num_output_tokens = c.num_output_tokens
        lp = chat_logprobs_content(self.ctx.token_strings, logprobs) if self.want_logprobs else []
        return self._finish(self._output("".join(texts), lp, reason), reason)

    # ---- streaming

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {_dumps(data)}\n\n".encode()

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self.body("in_progress", [], finished=False))
        yield self._event("response.in_progress", response=self.body("in_progress", [], finished=False))
        events = _StreamedOutput(self)
        try:
            async for out in self.group:
                check_output_error(out)
                self.num_cached_tokens = out.num_cached_tokens
                for c in out.outputs:
                    self.num_output_tokens = c.num_output_tokens
                    lp = chat_logprobs_content(self.ctx.token_strings, c.new_logprobs) if self.want_logprobs and c.new_logprobs else []
                    for event in events.add(c.new_text, lp, c.finish_reason):
                        yield event
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client in-band
            err = output_error(exc)
            body = self.body("failed", events.output, finished=False)
            body["error"] = {"code": "server_error", "message": err.message}
            yield self._event("response.failed", response=body)
            return
        finally:
            self.group.close()
        kind = "response.incomplete" if events.reason == "length" else "response.completed"
        yield self._event(kind, response=self._finish(events.output, events.reason))


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


class _StreamedOutput:
    """The output items of a streamed response as they form, and the events that announce them.

    Text streams as ``response.output_text.delta`` events of one message item; a named function's
    arguments stream as ``response.function_call_arguments.delta`` events of one call item; an array of
    calls ("required", or "auto" once the output starts with ``[``) is announced whole when the output
    ends and parses (text that does not, cut by ``max_output_tokens``, is sent as the message then)."""

    def __init__(self, job: _Response) -> None:
        self.job = job
        self.tools = job.tools
        self.output: list[dict[str, Any]] = []  # finished items
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.mode: str | None = None if self.tools is not None else "text"  # "text" | "named" | "calls"
        self.item: dict[str, Any] | None = None  # the item being streamed
        self.reason: str | None = None

    def add(self, text: str, logprobs: list[dict[str, Any]], reason: str | None) -> list[bytes]:
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
                events.append(job._event("response.output_text.delta", item_id=job.message_id, output_index=0,
                                         content_index=0, delta=text, logprobs=logprobs))
        elif self.mode == "named":
            if self.item is None:
                assert self.tools is not None and self.tools.name is not None
                call = {"id": _hex_id("call"), "function": {"name": self.tools.name, "arguments": ""}}
                self.item = job._call_item(call, _hex_id("fc"), "in_progress")
                events.append(job._event("response.output_item.added", output_index=0, item=self.item))
            if text:
                events.append(job._event("response.function_call_arguments.delta", item_id=self.item["id"], output_index=0, delta=text))
        if reason is not None:
            self.reason = reason
            events += self._close()
        return events

    def _open_message(self) -> list[bytes]:
        job = self.job
        self.mode = "text"
        self.item = job._message("", [], "in_progress")
        return [
            job._event("response.output_item.added", output_index=0, item=self.item),
            job._event("response.content_part.added", item_id=job.message_id, output_index=0, content_index=0,
                       part=_text_part("", [])),
        ]

    def _close(self) -> list[bytes]:
        job, events = self.job, []
        text = "".join(self.text)
        if self.mode == "named" and self.item is not None:
            assert self.tools is not None
            calls = self.tools.parse(text)
            if calls is not None:
                item = {**self.item, "status": "completed", "arguments": calls[0]["function"]["arguments"]}
                events.append(job._event("response.function_call_arguments.done", item_id=item["id"], output_index=0,
                                         name=item["name"], arguments=item["arguments"]))
                events.append(job._event("response.output_item.done", output_index=0, item=item))
                self.output = [item]
                return events
            # Cut before the arguments were complete: the call item ends incomplete, as it read.
            item = {**self.item, "status": "incomplete", "arguments": text}
            events.append(job._event("response.output_item.done", output_index=0, item=item))
            self.output = [item]
            return events
        if self.mode == "calls":
            items = job._output(text, [], self.reason)
            if items[0]["type"] == "function_call":
                for k, item in enumerate(items):
                    added = {**item, "status": "in_progress", "arguments": ""}
                    events.append(job._event("response.output_item.added", output_index=k, item=added))
                    events.append(job._event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                                             delta=item["arguments"]))
                    events.append(job._event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                             name=item["name"], arguments=item["arguments"]))
                    events.append(job._event("response.output_item.done", output_index=k, item=item))
                self.output = items
                return events
            # Not calls after all (cut by max_output_tokens): the text as the message.
            events += self._open_message()
            if text:
                events.append(job._event("response.output_text.delta", item_id=job.message_id, output_index=0,
                                         content_index=0, delta=text, logprobs=self.logprobs))
        elif self.item is None:
            events += self._open_message()
        message = job._message(text, self.logprobs, "incomplete" if self.reason == "length" else "completed")
        part = message["content"][0]
        events.append(job._event("response.output_text.done", item_id=job.message_id, output_index=0, content_index=0,
                                 text=text, logprobs=self.logprobs))
        events.append(job._event("response.content_part.done", item_id=job.message_id, output_index=0, content_index=0,
                                 part=part))
        events.append(job._event("response.output_item.done", output_index=0, item=message))
        self.output = [message]
        return events


def stored_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")
    return stored.body
