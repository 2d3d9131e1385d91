"""Chat messages -> prompt token ids, through the model's own chat template.

Validation (which roles and content parts we serve) happens here on the event loop, before any
work is queued; rendering and tokenizing run in the tokenizer thread (``render_chat_prompt``).
"""

from __future__ import annotations

import json
from typing import Any

from servelm.server.chat_special_tokens import SpecialTokenGuard
from servelm.server.chat_template import ChatTemplate, render_error
from servelm.server.errors import bad_request, unsupported
from servelm.server.protocol_chat import CHAT_ROLES, ChatMessage, ChatTool
from servelm.server.tools import calls_as_content, describe_tools, template_knows_tools, tools_for_template

# OpenAI's "developer" role is the newer name for "system"; chat templates only know "system".
_ROLE_MAP = {role: "system" if role == "developer" else role for role in CHAT_ROLES}


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """``{"role", "content"}`` dicts for the chat template (plus ``tool_calls`` on an assistant message
    that made calls, ``tool_call_id`` on a tool result); 400 naming the field otherwise."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = _ROLE_MAP.get(m.role)
        if role is None:
            if m.role == "function":
                raise unsupported(
                    f"{where}.role",
                    "'function' messages (the deprecated function calling) are not supported; use 'tool'",
                )
            raise bad_request(
                f"Invalid value for '{where}.role': '{m.role}' (expected system, developer, user, assistant or tool)",
                param=f"{where}.role",
            )
        for field in ("function_call", "audio"):
            if getattr(m, field) not in (None, []):
                raise unsupported(f"{where}.{field}", f"'{where}.{field}' is not supported")
        if m.tool_calls and role != "assistant":
            raise bad_request(
                f"'{where}.tool_calls' is only allowed on assistant messages.", param=f"{where}.tool_calls"
            )
        if m.tool_call_id is not None and role != "tool":
            raise bad_request(
                f"'{where}.tool_call_id' is only allowed on tool messages.", param=f"{where}.tool_call_id"
            )
        msg: dict[str, Any] = {"role": role, "content": _content_text(m, where)}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments, f"{where}.tool_calls[{j}].function.arguments"),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
        thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thinking is not None:
            if role != "assistant":
                raise bad_request(
                    f"'{where}.reasoning_content' is only allowed on assistant messages.",
                    param=f"{where}.reasoning_content",
                )
            msg["reasoning_content"] = thinking
        if role == "tool":
            if m.tool_call_id is None:
                raise bad_request(f"Missing required parameter: '{where}.tool_call_id'.", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


# What render_chat_prompt passes the template itself (and what transformers' apply_chat_template takes as
# its own arguments): chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "chat_template", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask", "bos_token", "eos_token", "unk_token",
    "pad_token", "raise_exception", "strftime_now",
})  # fmt: skip


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` checked: 400 naming a variable the server sets itself."""
    for name in kwargs or {}:
        if name == "chat_template":
            raise bad_request(
                "'chat_template_kwargs.chat_template' is not read: send a template as the request's 'chat_template'.",
                param="chat_template_kwargs.chat_template",
            )
        if name in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(
                f"'chat_template_kwargs.{name}' is set by the server and cannot be overridden.",
                param=f"chat_template_kwargs.{name}",
            )
    return dict(kwargs or {})


def chat_text_chars(
    messages: list[ChatMessage],
    tools: list[ChatTool] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    template: str | None = None,
) -> int:
    """The characters the chat template renders from ``messages``, ``tools`` and ``template_kwargs``
    (their texts, earlier calls, the tools and the extra variables as JSON), and a request's own
    ``template``: what the bound on one request's text counts."""
    n = len(template or "")
    for m in messages:
        if isinstance(m.content, str):
            n += len(m.content)
        elif m.content:
            n += sum(len(p.text or "") for p in m.content)
        for c in m.tool_calls or ():
            n += len(c.id) + len(c.function.name) + len(c.function.arguments)
        n += len(m.tool_call_id or "") + len(m.reasoning_content or m.reasoning or "")
    if tools:
        n += len(json.dumps(tools_for_template(tools), ensure_ascii=False))
    if template_kwargs:
        n += len(json.dumps(template_kwargs, ensure_ascii=False, default=str))
    return n


def _arguments(text: str, where: str) -> Any:
    """A call's arguments as templates read them (the JSON object, not its text)."""
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(f"'{where}' is not valid JSON.", param=where) from None


def _content_text(m: ChatMessage, where: str) -> str:
    if m.content is None:
        if m.role == "assistant":  # (one that only made tool calls, say)
            return ""
        raise bad_request(f"Missing required parameter: '{where}.content'.", param=f"{where}.content")
    if isinstance(m.content, str):
        return m.content
    texts: list[str] = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise unsupported(
                f"{where}.content[{j}].type",
                f"content parts of type '{part.type}' are not supported (text only)",
            )
        if part.text is None:
            raise bad_request(
                f"Missing required parameter: '{where}.content[{j}].text'.", param=f"{where}.content[{j}].text"
            )
        texts.append(part.text)
    # Several text parts of one message read as separate paragraphs.
    return "\n".join(texts)


def render_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
    named_tool: str | None = None,
    describe: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    special_token_guard: SpecialTokenGuard | None = None,
    chat_template: ChatTemplate | None = None,
) -> list[int]:
    """Apply the chat template and tokenize the result.

    The template writes the special tokens (BOS, role markers) itself, so the text is encoded
    without adding special tokens again (unless ``add_special_tokens``, for /tokenize). ``tools`` go to
    a template that reads them, unless ``describe``, else into the system message
    (``server.tools.describe_tools``: ``describe`` words them for "auto"). ``template_kwargs``: the
    request's ``chat_template_kwargs``, checked by ``template_kwargs``. ``special_token_guard``: the
    special tokens the messages, tools and ``template_kwargs`` spell are encoded as text (None: read as
    tokens, --no-split-special-tokens-in-content). ``chat_template``: the template to render with
    (``server.chat_template.pick_chat_template``; None or no text: the tokenizer's own).
    """
    template = chat_template or ChatTemplate()
    text_of = template.text if template.text is not None else getattr(tokenizer, "chat_template", None)
    if not text_of:
        raise bad_request(
            "This model has no chat template: serve one with --chat-template, or use /v1/completions.", param="messages"
        )
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if template_knows_tools(text_of) and not describe:
        if tools:
            kwargs["tools"] = tools
    else:
        messages = calls_as_content(messages)
        if tools:
            messages = describe_tools(messages, tools, named_tool, auto=describe)
    guard = special_token_guard
    marked = guard.mark([messages, kwargs]) if guard is not None else None
    if marked is not None:
        messages, kwargs = marked
    if template.text is not None:
        kwargs["chat_template"] = template.text
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # jinja2's TemplateError, or a template that raises on what it does not expect
        raise render_error(template, e) from None
    if guard is not None and marked is not None:
        return guard.encode(text, add_special_tokens)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
