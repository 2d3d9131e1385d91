"""The wire format of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

As on the OpenAI surfaces, unknown top-level fields are ignored (logged, named in
``x-servelm-ignored-fields``); fields Anthropic defines that would change the answer and that this server
cannot honour (``thinking`` without --reasoning-parser, MCP servers, containers...) are declared so that ``server.serving_messages``
refuses them by name. Content blocks and tools are kept loose here (their kinds are many and grow): the
serving code checks each one and names the block it refuses. Responses are plain dicts
(``server.serving_messages``, ``server.messages_events``); ``MessageObject`` shows their shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelm.server.limits import MAX_CONTENT_PARTS, MAX_MESSAGES
from servelm.server.protocol import ServedRequest


class ContentBlock(BaseModel):
    """One content block of a message or of ``system``: ``text``, ``tool_use`` (an assistant's earlier
    call) or ``tool_result``; other kinds (images, documents, thinking...) are refused by type.
    ``cache_control`` and ``citations`` are accepted and ignored (there is no prompt-cache pricing here)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any | None = None
    # tool_result: its content is text or text blocks
    tool_use_id: str | None = None
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    is_error: bool | None = None
    cache_control: Any | None = None


Blocks = Annotated[list[ContentBlock], Field(max_length=MAX_CONTENT_PARTS)]


class MessageParam(BaseModel):
    """One turn of ``messages``: a ``user`` or ``assistant`` role and its text or blocks."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(json_schema_extra={"enum": ["user", "assistant"]})
    content: str | Blocks


class MessagesTool(BaseModel):
    """A client tool: ``{"name", "description", "input_schema"}`` (``type`` absent or "custom"); Anthropic's
    server and computer-use tools (``web_search_...``, ``bash_...``) are refused by type."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: Any | None = None


class MessagesToolChoice(BaseModel):
    """``auto`` (the model decides), ``any`` (some tool), ``tool`` (the one ``name``d) or ``none``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(ServedRequest):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model: str | None = None  # None => the served model (Anthropic requires it; any served name works)
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Blocks | None = None
    tools: list[MessagesTool] | None = Field(default=None, max_length=128)
    tool_choice: MessagesToolChoice | None = None
    # Declared so they are refused by name when set:
    thinking: Any | None = None
    mcp_servers: Any | None = None
    container: Any | None = None
    context_management: Any | None = None
    output_format: Any | None = None
    output_config: Any | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int  # required by Anthropic
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Accepted and ignored (harmless):
    metadata: dict[str, Any] | None = None  # {"user_id"}: Anthropic's abuse tracking
    service_tier: str | None = None
    inference_geo: str | None = None


# -------------------------------------------------------------------------------------------- responses


class MessageObject(BaseModel):
    """The response (for the schema; built as a dict). ``content`` holds ``{"type": "text", "text"}`` or
    ``{"type": "tool_use", "id": "toolu_...", "name", "input"}`` blocks."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: dict[str, Any]


class TokenCount(BaseModel):
    input_tokens: int
