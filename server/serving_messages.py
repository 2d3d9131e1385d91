"""``POST /v1/messages`` (Anthropic's Messages API) and ``/v1/messages/count_tokens`` on top of the chat
machinery.

A request is translated into the equivalent chat request (``system`` a system message, ``tool_use`` blocks
an assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages, ``tools``/``tool_choice`` chat's),
then validated, rendered and queued exactly as ``/v1/chat/completions`` would (``serving_chat.start_chat``):
the prompt ids, the grammar and the sampled tokens are the chat request's. The answer is one ``text`` block,
or one ``tool_use`` block per call; streams send Anthropic's typed events (``server.messages_events``).
Every error on these paths leaves in Anthropic's shape (``errors.error_response``).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from servelm.server.errors import APIError, bad_request, loc_to_param, required_field, unsupported
from servelm.server.messages_events import MessageStream, content_blocks, stop_reason, thinking_block, usage
from servelm.server.protocol_chat import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from servelm.server.protocol_messages import ContentBlock, CountTokensRequest, MessagesRequest
from servelm.server.reasoning import split_reasoning
from servelm.server.responses_events import hex_id
from servelm.server.serving_chat import start_chat
from servelm.server.serving_common import ServingContext, until_disconnect
from servelm.server.serving_outputs import EventStreamResponse, UsageCounter, collect_choices, end_on_error
from servelm.server.serving_render import render_chat

# Blocks named in the refusal: what they would need (the reasoning parser, a vision model...).
_REFUSED_BLOCKS = {
    "image": "images are not supported (the served model reads text only)",
    "document": "documents are not supported (send their text as a text block)",
    "thinking": "'thinking' blocks are not supported: the served model has no reasoning output here (no --reasoning-parser)",
    "redacted_thinking": "'redacted_thinking' blocks are not supported: the served model has no reasoning output here (no --reasoning-parser)",
}


def refuse_unsupported(req: CountTokensRequest, reasoning: bool = False) -> None:
    """Fields this server cannot honour: 400 naming the field. ``reasoning``: a reasoning parser is set."""
    thinking = req.thinking
    if thinking is not None and not isinstance(thinking, dict):
        raise bad_request(
            '\'thinking\' must be an object such as {"type": "enabled", "budget_tokens": 1024}.', param="thinking"
        )
    if thinking is not None and thinking.get("type") not in ("disabled", "enabled", "adaptive"):
        raise bad_request(
            f"Invalid value for 'thinking.type': {thinking.get('type')!r} (expected enabled, adaptive or disabled).",
            param="thinking.type",
        )
    if thinking is not None and thinking.get("type") != "disabled" and not reasoning:
        raise unsupported(
            "thinking",
            "'thinking' is not supported: the served model has no reasoning output here (no --reasoning-parser)",
        )
    for name in ("mcp_servers", "container", "context_management", "output_format", "output_config"):
        if getattr(req, name) is not None:
            raise unsupported(name)


def _block_text(block: ContentBlock, where: str) -> str:
    if block.type != "text":
        raise unsupported(
            f"{where}.type",
            _REFUSED_BLOCKS.get(block.type, f"content blocks of type '{block.type}' are not supported here"),
        )
    if block.text is None:
        raise bad_request(f"Missing required parameter: '{where}.text'.", param=f"{where}.text")
    return block.text


def _text(content: str | list[ContentBlock], where: str) -> str:
    """Text, or text blocks read as paragraphs (as chat reads several text parts)."""
    if isinstance(content, str):
        return content
    return "\n".join(_block_text(b, f"{where}[{j}]") for j, b in enumerate(content))


def chat_messages(req: CountTokensRequest, reasoning: bool = False) -> tuple[list[ChatMessage], list[str]]:
    """``system`` and ``messages`` as chat messages, and for each the Messages field it came from; an
    assistant's ``thinking`` blocks become its ``reasoning_content`` when ``reasoning`` (a parser is set)."""
    out: list[ChatMessage] = []
    where: list[str] = []
    if req.system is not None:
        out.append(ChatMessage(role="system", content=_text(req.system, "system")))
        where.append("system")
    for i, m in enumerate(req.messages):
        w = f"messages[{i}]"
        if m.role not in ("user", "assistant"):
            raise bad_request(
                f"Invalid value for '{w}.role': {m.role!r} (expected user or assistant).", param=f"{w}.role"
            )
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            where.append(w)
            continue
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[ToolCall] = []
        for j, b in enumerate(m.content):
            bw = f"{w}.content[{j}]"
            if reasoning and m.role == "assistant" and b.type in ("thinking", "redacted_thinking"):
                # Redacted thinking is opaque (encrypted by Anthropic): nothing a template could render.
                if b.type == "thinking":
                    thoughts.append(str((b.model_extra or {}).get("thinking") or ""))
            elif b.type == "tool_use" and m.role == "assistant":
                call_input = required_field(b, "input", bw)
                arguments = json.dumps(call_input, ensure_ascii=False)
                calls.append(
                    ToolCall(
                        id=required_field(b, "id", bw),
                        function=FunctionCall(name=required_field(b, "name", bw), arguments=arguments),
                    )
                )
            elif b.type == "tool_result" and m.role == "user":
                # A tool message per result, before the turn's text (Anthropic puts results first).
                result = _text(b.content, f"{bw}.content") if b.content is not None else ""
                out.append(ChatMessage(role="tool", content=result, tool_call_id=required_field(b, "tool_use_id", bw)))
                where.append(bw)
            elif b.type in ("tool_use", "tool_result"):
                who = "assistant" if b.type == "tool_use" else "user"
                raise bad_request(f"'{bw}': {b.type} blocks are only allowed in {who} messages.", param=f"{bw}.type")
            else:
                texts.append(_block_text(b, bw))
        if texts or calls or thoughts or not m.content:
            out.append(
                ChatMessage(
                    role=m.role,
                    content="\n".join(texts) if texts or not calls else None,
                    tool_calls=calls or None,
                    reasoning_content="\n".join(thoughts) if thoughts else None,
                )
            )
            where.append(w)
    if req.messages[-1].role == "assistant":
        raise unsupported(
            f"messages[{len(req.messages) - 1}].role",
            "a final assistant message (prefilling the answer) is not supported: the last message must be the user's",
        )
    return out, where


def _tools(req: CountTokensRequest) -> list[Any] | None:
    """Chat tools as JSON, validated with the chat request (so a bad name is refused naming the tool)."""
    if req.tools is None:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.type not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"tools of type '{t.type}' are not supported (client tools only)")
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return tools


def _tool_choice(req: CountTokensRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("Missing required parameter: 'tool_choice.name'.", param="tool_choice.name")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_request(req: CountTokensRequest, reasoning: bool = False) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request that serves ``req``, and where each of its messages came from. ``reasoning``: a
    reasoning parser is set (``thinking`` is served; disabled, it is Qwen3's ``enable_thinking: false``)."""
    refuse_unsupported(req, reasoning)
    messages, where = chat_messages(req, reasoning)
    choice = req.tool_choice
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = dict(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=req.stop_sequences,
            stream=req.stream,
        )
    try:
        chat = ChatCompletionRequest(
            model=req.model,
            messages=messages,
            tools=_tools(req),
            tool_choice=_tool_choice(req),
            parallel_tool_calls=False if choice is not None and choice.disable_parallel_tool_use else None,
            chat_template_kwargs={"enable_thinking": False}
            if reasoning and (req.thinking or {}).get("type") == "disabled"
            else None,
            **fields,
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise bad_request(
            f"Invalid request: {err['msg']}", param=messages_param(loc_to_param(err["loc"]), where)
        ) from None
    return chat, where


_SIMPLE_PARAMS = {
    "stop": "stop_sequences",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}


def messages_param(param: str | None, where: list[str]) -> str | None:
    """The Messages field for a chat request's field named in an error."""
    if param is None:
        return None
    m = re.fullmatch(r"messages\[(\d+)\](.*)", param)
    if m:
        return where[int(m.group(1))] if int(m.group(1)) < len(where) else "messages"
    m = re.fullmatch(r"tools\[(\d+)\]\.function\.(\w+).*", param)
    if m:
        return f"tools[{m.group(1)}].{'input_schema' if m.group(2) == 'parameters' else m.group(2)}"
    return _SIMPLE_PARAMS.get(param, param)


async def create_message(ctx: ServingContext, req: MessagesRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    message_id = hex_id("msg")
    ctx.fields.note(raw, req, message_id, "/v1/messages")
    chat, where = to_chat_request(req, ctx.reasoning_parser is not None)
    try:
        start = await start_chat(ctx, chat, arrival, message_id)
    except APIError as e:
        e.param = messages_param(e.param, where)
        raise
    usage_counter = UsageCounter([len(start.prompt_ids)], 1)
    if req.stream:
        stream = MessageStream(message_id, start.model, start.tools, start.group, usage_counter, start.reasoning)
        return EventStreamResponse(end_on_error(stream.events(), start.group, stream.failed), start.group)

    async def collect() -> dict[str, Any]:
        matched: list[str | int | None] = [None]

        def take_stop(out: Any) -> None:
            for c in out.outputs:
                if c.finish_reason is not None:
                    matched[0] = c.stop_reason

        collected = await collect_choices(start.group, usage_counter, on_output=take_stop)
        text, thought = collected.text(0), []
        mode = start.reasoning
        if mode is not None:
            thinking, text = split_reasoning(mode.parser, mode.phase, text)
            thought = [thinking_block(thinking)] if thinking is not None and mode.include else []
        blocks = content_blocks(start.tools, text)
        reason, sequence = stop_reason(blocks[-1]["type"] == "tool_use", collected.finish[0], matched[0])
        blocks = thought + blocks
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": blocks,
            "model": start.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(usage_counter),
        }

    return JSONResponse(await until_disconnect(raw, collect(), start.group))


async def count_tokens(ctx: ServingContext, req: CountTokensRequest, raw: Request) -> dict[str, int]:
    """The prompt's tokens as ``create_message`` renders them (its usage's input plus cache-read tokens)."""
    ctx.fields.note(raw, req, hex_id("count"), "/v1/messages/count_tokens")
    chat, where = to_chat_request(req, ctx.reasoning_parser is not None)
    try:
        rendered = await render_chat(ctx, chat)
    except APIError as e:
        e.param = messages_param(e.param, where)
        raise
    return {"input_tokens": len(rendered["token_ids"])}
