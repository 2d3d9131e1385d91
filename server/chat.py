"""Chat messages -> prompt token ids, through the model's own chat template.

Validation (which roles and content parts we serve) happens here on the event loop, before any
work is queued; rendering and tokenizing run in the tokenizer thread (``render_chat_prompt``).
"""

from __future__ import annotations

from typing import Any

from server.errors import bad_request, unsupported
from server.protocol import CHAT_ROLES, ChatMessage

# OpenAI's "developer" role is the newer name for "system"; chat templates only know "system".
_ROLE_MAP = {role: "system" if role == "developer" else role for role in CHAT_ROLES}


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Plain ``{"role", "content"}`` dicts for the chat template; 400 naming the field otherwise."""
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = _ROLE_MAP.get(m.role)
        if role is None:
            if m.role in ("tool", "function"):
                raise unsupported(f"{where}.role", f"'{m.role}' messages are not supported (this server has no tool calling)")
            raise bad_request(
                f"Invalid value for '{where}.role': '{m.role}' (expected system, developer, user or assistant)",
                param=f"{where}.role",
            )
        for field in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if getattr(m, field) not in (None, []):
                raise unsupported(f"{where}.{field}", f"'{where}.{field}' is not supported (no tool calling or audio)")
        out.append({"role": role, "content": _content_text(m, where)})
    return out


def _content_text(m: ChatMessage, where: str) -> str:
    if m.content is None:
        if m.role == "assistant":
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
            raise bad_request(f"Missing required parameter: '{where}.content[{j}].text'.", param=f"{where}.content[{j}].text")
        texts.append(part.text)
    # Several text parts of one message read as separate paragraphs.
    return "\n".join(texts)


def render_chat_prompt(
    tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, add_special_tokens: bool = False
) -> list[int]:
    """Apply the chat template and tokenize the result.

    The template writes the special tokens (BOS, role markers) itself, so the text is encoded
    without adding special tokens again (unless ``add_special_tokens``, for /tokenize).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions instead.", param="messages")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
