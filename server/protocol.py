"""The OpenAI wire format that every generation surface shares: the sampling fields and their
extensions, response formats, usage, model cards and the SSE framing.

A generation request (completions, chat, responses) ignores top-level fields it does not know, as
vLLM does: the routers and gateways in front of a replica add their own engine's extensions
(``no_stop_trim``, ``return_hidden_states``...), and refusing them made every routed request fail.
Each ignored field is logged once per name and named in the response's ``x-servelm-ignored-fields``
header (``server.serving_fields``). Fields whose silent loss would change the result are declared
and refused by name in the serving code (each surface's ``refuse_unsupported``), as are the routers'
extensions when set to anything but their no-op default; harmless ones (``user``, ``metadata``...)
are accepted and ignored. Nested objects (messages, tools, response formats) and the other
endpoints' bodies still refuse unknown fields: nothing in front of a replica adds to them.
Every request model is a ``limits.RequestBody``: its body is walked once, before its
fields are validated, for strings that are no Unicode text and for nesting and size past the bounds.
Each surface's own models live beside this module: ``protocol_completions``, ``protocol_chat``,
``protocol_responses``, ``protocol_tokenize``. Streaming chunks are built as plain dicts in the
serving modules (the hot path).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from servelm.scheduler.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
)
from servelm.server.limits import RequestBody


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


# The longest client request id (``X-Request-Id`` or vLLM's ``request_id``) kept for logs and echoed.
MAX_REQUEST_ID_CHARS = 512


class ServedRequest(RequestBody):
    """The top level of a generation request: unknown fields land in ``model_extra`` and are ignored."""

    model_config = ConfigDict(extra="allow")

    # vLLM's: the client's id for this request, logged and echoed in X-Request-Id (the header wins)
    request_id: str | None = Field(default=None, max_length=MAX_REQUEST_ID_CHARS)


class SamplingExtensions(ServedRequest):
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
    no_stop_trim: bool | None = None  # SGLang's name for include_stop_str_in_output (its routers send it)

    @model_validator(mode="after")
    def _no_stop_trim_keeps_the_stop(self) -> SamplingExtensions:
        # One flag downstream: either name asks to keep the matched stop string (or stop token) in the output.
        if self.no_stop_trim:
            self.include_stop_str_in_output = True
        return self


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

    model_config = ConfigDict(extra="allow", json_schema_extra=_document_checks)

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
    # SGLang's, sent by both routers as false: refused by name when true (there are no hidden states to return)
    return_hidden_states: bool | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class GenerationResponse(BaseModel):
    """The envelope both completions and chat completions answer in; each names its ``object`` and
    its choices' type."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs`` (keyed by token id): the prompt's own token and the alternatives."""

    logprob: float
    rank: int
    decoded_token: str


# One per prompt token, the first null (nothing precedes it); present only when asked.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ModelCard(BaseModel):
    # A server of several models adds each model's state, aliases and load error.
    model_config = ConfigDict(extra="allow")

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
