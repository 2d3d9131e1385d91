"""The wire format of vLLM's ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelm.server.limits import MAX_MESSAGES, RequestBody
from servelm.server.protocol_chat import ChatMessage, ChatTool, NamedToolChoice


class TokenizeRequest(RequestBody):
    """``POST /tokenize`` (vLLM's): a ``prompt`` as /v1/completions would encode it, or chat ``messages``
    through the chat template as /v1/chat/completions would; exactly one of the two."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    # Default: the prompt gets the tokenizer's special tokens (as /v1/completions); the chat template
    # writes its own.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn marker
    return_token_strs: bool = False  # also the vocabulary strings of the ids
    # messages only: rendered with these tools as /v1/chat/completions would
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # messages only, as on /v1/chat/completions: extra template variables, and a request's own template
    # (with --trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    """``POST /detokenize`` (vLLM's): token ids -> text, special tokens included."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
