"""``POST /v1/responses``, the request side: a Responses request translated into the chat request that
serves it.

``instructions`` become a system message, the input items (messages, earlier ``function_call``s,
``function_call_output``s) become chat messages, function tools become chat tools and ``text.format``
the response format. An error found later in the chat request is reported under the Responses field
it came from (``responses_param``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from servelm.server.errors import bad_request, loc_to_param, required_field, unsupported
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
from servelm.server.protocol_responses import INCLUDE_LOGPROBS, InputPart, ResponsesRequest

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
# The SamplingExtensions fields a Responses request passes on unchanged.
_EXTENSIONS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "cache_salt",
    "priority",
    "chat_template_kwargs",
)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields this server cannot honour: 400 naming the field."""
    if req.background:
        raise unsupported("background", "'background' responses are not supported by this server")
    for name in ("conversation", "prompt", "context_management", "moderation"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    if req.reasoning is not None and (
        not isinstance(req.reasoning, dict) or any(v is not None for v in req.reasoning.values())
    ):
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


def input_messages(req: ResponsesRequest, reasoning: bool = False) -> tuple[list[ChatMessage], list[str]]:
    """``req.input`` as chat messages, and for each message the input field it came from (errors found
    later name it). Consecutive ``function_call`` items are one assistant message's calls. ``reasoning``
    (a reasoning parser is set): earlier ``reasoning`` items are accepted and left out, as chat templates
    leave out past turns' thinking."""
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
            arguments = required_field(item, "arguments", w)
            try:
                json.loads(arguments)
            except ValueError:
                raise bad_request(f"'{w}.arguments' is not valid JSON.", param=f"{w}.arguments") from None
            call = ToolCall(
                id=required_field(item, "call_id", w),
                function=FunctionCall(name=required_field(item, "name", w), arguments=arguments),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and where[-1].startswith("input["):
                last.tool_calls = [*(last.tool_calls or []), call]  # the same turn: text and/or calls
                continue
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "reasoning" and reasoning:
            continue
        elif kind == "function_call_output":
            output = _content(item.output, f"{w}.output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=required_field(item, "call_id", w)))
        else:
            raise unsupported(
                f"{w}.type", f"input items of type '{kind}' are not supported (messages and function calls only)"
            )
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
        raise unsupported(
            "tool_choice",
            f"'tool_choice' of type '{choice.type}' is not supported (none, auto, required or a function)",
        )
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


def to_chat_request(
    req: ResponsesRequest, history: list[ChatMessage], reasoning: bool = False
) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request that serves ``req`` after ``history``, and where each of its messages came from
    (``reasoning``: a reasoning parser is set)."""
    messages, where = input_messages(req, reasoning)
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
        raise bad_request(
            f"Invalid request: {err['msg']}", param=responses_param(loc_to_param(err["loc"]), where)
        ) from None
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
