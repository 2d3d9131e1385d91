"""The wire format of ``POST /v1/chat/completions``: messages, tools, the request model and the
response's schema (``/v1/responses`` and ``/tokenize`` reuse the messages and tools)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from servelm.server.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOL_CALLS, check_metadata
from servelm.server.protocol import GenerationRequest, GenerationResponse, PromptLogprobs


class TextPart(BaseModel):
    """One element of a list-valued message ``content``; only ``{"type": "text"}`` is served."""

    model_config = ConfigDict(extra="allow")  # image_url, input_audio...: refused by type, with a clear message

    type: str
    text: str | None = None


# The roles a chat message may have ("developer" is OpenAI's newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant message's earlier tool call (in the history a client sends back)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = None  # the arguments always follow the schema, strict or not


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function to call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Checked in server.chat (with a message naming the message's index); the schema lists them.
    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None  # accepted; the chat template has no place for it
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's earlier thinking (vLLM's field; "reasoning" its newer name): templates that render
    # thinking (Qwen3's) read it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    # Declared so they are refused by name:
    function_call: Any | None = None
    refusal: str | None = None
    audio: Any | None = None


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Accepted and ignored (harmless):
    metadata: Annotated[dict[str, Any], AfterValidator(check_metadata)] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Declared so they are refused by name when set:
    functions: list[Any] | None = None
    function_call: Any | None = None
    audio: Any | None = None
    prediction: Any | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any | None = None
    # Extra variables for the chat template (vLLM's), e.g. {"enable_thinking": false} for Qwen3; names the
    # server itself passes (messages, tools, add_generation_prompt...) are refused by name.
    chat_template_kwargs: dict[str, Any] | None = None
    # A Jinja chat template for this request (vLLM's), served only with --trust-request-chat-template.
    chat_template: str | None = None
    # SGLang's, sent by both routers at these defaults; continue_final_message is refused by name when true.
    continue_final_message: bool | None = None
    # With --reasoning-parser: false leaves the thinking in the content (SGLang's); ignored without one.
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None  # accepted and ignored: the reasoning always streams as it comes
    # With --reasoning-parser: false drops the thinking from the answer (vLLM's); ignored without one.
    include_reasoning: bool | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking before the answer
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(GenerationResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None
