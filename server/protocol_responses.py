"""The wire format of OpenAI's Responses API (``POST /v1/responses``): the request model.

As in ``server.protocol``, the request ignores unknown top-level fields (logged, named in a response
header), and fields OpenAI defines but this server cannot honour (hosted tools, background mode,
reusable prompts...) are declared so that ``server.responses_input`` refuses them by name. Input items and tools are kept loose here (their
kinds are many and grow): the serving code checks each one and names the item it refuses.
Responses are built as plain dicts (``server.serving_responses``, ``server.responses_events``); the schema
shows their shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from servelm.scheduler.sampling_params import MAX_LOGIT_BIAS
from servelm.server.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, check_metadata
from servelm.server.protocol import SamplingExtensions, StreamOptions


class InputPart(BaseModel):
    """One content part of an input message: ``input_text``, an earlier answer's ``output_text`` or
    ``refusal``; other kinds (images, files, audio) are refused by type."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    refusal: str | None = None


# An input message's content, or a function call's output: text, or at most MAX_CONTENT_PARTS parts.
Content = str | Annotated[list[InputPart], Field(max_length=MAX_CONTENT_PARTS)] | None


class InputItem(BaseModel):
    """One item of ``input``: a message (``type`` "message" or omitted), an earlier ``function_call``, or
    a ``function_call_output``. Other item types are refused by type."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None
    role: str | None = None
    content: Content = None
    id: str | None = None
    status: str | None = None
    # function_call / function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Content = None


class ResponsesTool(BaseModel):
    """A tool: ``{"type": "function", "name", "description", "parameters", "strict"}``. Hosted tools
    (web search, file search, MCP...) are refused by type."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = Field(default=None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = None  # the arguments always follow the schema, strict or not


class ResponsesToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "name"}``."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None


class ResponsesFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: ResponsesFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a hint this server has no use for


# The ``include`` values this server knows; only the logprobs one changes the output.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (
    INCLUDE_LOGPROBS,
    "reasoning.encrypted_content",  # sent by stateless clients; there is no reasoning to include
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
)


class ResponsesRequest(SamplingExtensions):
    """``POST /v1/responses``."""

    model: str | None = None  # None => the served model
    # None only with previous_response_id
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None  # a system message before the input (not carried to the next turn)
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[ResponsesTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    store: bool | None = None  # default true: kept for previous_response_id and GET /v1/responses/{id}
    metadata: Annotated[dict[str, str], AfterValidator(check_metadata)] | None = None  # echoed back
    truncation: Literal["auto", "disabled"] | None = None
    # servelm's extensions, as on the other endpoints:
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # Accepted and ignored (harmless):
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None  # bounds hosted-tool calls; there are none here
    # Extra chat-template variables, as on chat (vLLM's), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # Declared so they are refused by name when set:
    background: bool | None = None
    conversation: Any | None = None
    prompt: Any | None = None
    reasoning: Any | None = None  # accepted (its effort and summary ignored) with --reasoning-parser
    context_management: Any | None = None
    moderation: Any | None = None


# -------------------------------------------------------------------------------------------- responses


class ResponseObject(BaseModel):
    """The response object (for the schema; built as a dict by ``server.serving_responses``). Output
    items are ``{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text",
    ...}]}`` or ``{"type": "function_call", "call_id", "name", "arguments"}``, after a ``{"type":
    "reasoning", "content": [{"type": "reasoning_text", "text"}]}`` item with --reasoning-parser."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool
