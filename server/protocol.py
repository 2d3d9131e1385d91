"""The OpenAI wire format: request models (validated at the edge) and response models (for the schema).

Requests forbid unknown fields, like OpenAI ("Unrecognized request argument supplied"): a field we
do not know could change what the client expects, so it is refused rather than ignored. Fields that
OpenAI defines but we do not implement are declared here and refused by name in the serving code
(``_refuse_unsupported`` in each serving module); harmless ones (``user``, ``metadata``...) are accepted
and ignored. Every request model is a ``limits.RequestBody``: its body is walked once, before its
fields are validated, for strings that are no Unicode text and for nesting and size past the bounds.
Streaming chunks are built as plain dicts in the serving modules (the hot path).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, field_validator

from servelm.scheduler.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, RANGES
from servelm.server.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOL_CALLS, RequestBody, check_metadata

# --------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never obfuscate; accepted so SDK defaults pass


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's structured outputs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of the constraints."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # A JSON schema, its text, or a boolean schema (true: any JSON value; false: nothing, refused).
    json_: dict[str, Any] | StrictBool | str | None = Field(default=None, alias="json")
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = Field(default=None, min_length=1)  # the output is one of these
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (llama.cpp's)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool | None = None  # JSON: no whitespace outside strings


class SamplingExtensions(RequestBody):
    """vLLM-style extensions shared by both endpoints (not in OpenAI's API)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt (multi-tenant)
    cache_salt: str | None = None
    priority: int | None = None  # vLLM's: lower is served first (--scheduling-policy priority)


# Request fields whose range is SamplingParams' under another name.
_RANGE_ALIASES = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


def _document_checks(schema: dict[str, Any]) -> None:
    """Write into the schema what the serving code checks: each numeric parameter's range (the ones
    ``SamplingParams`` enforces), the bounds on stop strings and, for completions, that no prompt is
    empty."""
    for name, prop in schema["properties"].items():
        allowed = RANGES.get(_RANGE_ALIASES.get(name, name))
        branches = prop.get("anyOf", [prop])
        if allowed is not None and any(b.get("type") in ("integer", "number") for b in branches):
            prop.update(allowed.json_schema())
    if "prompt" in schema["properties"]:
        _non_empty_prompt(schema["properties"]["prompt"])
        # /v1/completions: max_tokens 0 with echo returns the prompt alone (scoring it with logprobs).
        schema["properties"]["max_tokens"]["minimum"] = 0
    for branch in schema["properties"].get("stop", {}).get("anyOf", []):
        if branch.get("type") == "string":
            branch.update(minLength=1, maxLength=MAX_STOP_CHARS)
        elif branch.get("type") == "array":
            branch["maxItems"] = MAX_STOP_STRINGS
            branch.get("items", {}).update(minLength=1, maxLength=MAX_STOP_CHARS)


def _non_empty_prompt(prompt: dict[str, Any]) -> None:
    # The serving code checks this after tokenising.
    for branch in prompt.get("anyOf", []):
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1
            items = branch.get("items", {})
            if items.get("type") == "string":
                items["minLength"] = 1
            elif items.get("type") == "array":
                items["minItems"] = 1


class GenerationRequest(SamplingExtensions):
    """Fields both generation endpoints share."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_document_checks)

    model: str | None = None  # None => the served model
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None  # accepted, ignored
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extension


# Token ids before strings: pydantic's smart union validates every member, and a member that fails
# collects an error per element; a 2.5M-id prompt took 0.6 s of the event loop with list[str] first,
# 0.05 s this way round (a list of strings pays ~0.2 us per string instead).
Prompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    # Declared so they are refused by name (not as "unrecognized"):
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_int(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("'logprobs' must be an integer in [0, 20] for /v1/completions (not a boolean)")
        return v


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


# -------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object (parallel lists, one entry per token)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs`` (keyed by token id): the prompt's own token and the alternatives."""

    logprob: float
    rank: int
    decoded_token: str


# One per prompt token, the first null (nothing precedes it); present only when asked.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


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
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "servelm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse(data: str) -> bytes:
    """One server-sent event."""
    return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
