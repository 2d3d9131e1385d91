"""Ollama's request bodies (its docs/api.md) and their translation onto the OpenAI requests the
existing serving path takes: ``/api/chat`` and ``/api/generate`` become a chat completion (or a
completion for ``raw`` prompts), ``/api/embed`` an embeddings request. Fields Ollama's clients send
that change nothing here (``num_ctx``, ``num_gpu``...) are accepted and ignored, as Ollama ignores
options a model does not use."""

from __future__ import annotations

import json
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from servelm.server.errors import APIError, bad_request
from servelm.server.protocol_chat import ChatCompletionRequest
from servelm.server.protocol_completions import CompletionRequest
from servelm.server.protocol_embeddings import EmbeddingRequest

# Ollama's ``options`` that sampling honours, by the OpenAI request field they become.
OPTION_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "stop": "stop", "num_predict": "max_tokens", "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # Ollama's clients send fields of later versions; Ollama ignores them


class OllamaToolFunction(_Body):
    name: str
    arguments: dict[str, Any] | str = {}


class OllamaToolCall(_Body):
    function: OllamaToolFunction


class OllamaMessage(_Body):
    role: str
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class OllamaGenerationBody(_Body):
    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None
    think: Any = None


class OllamaChatRequest(OllamaGenerationBody):
    """``POST /api/chat``."""

    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaGenerationBody):
    """``POST /api/generate``."""

    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


class OllamaEmbedRequest(_Body):
    """``POST /api/embed`` (and the older ``/api/embeddings``, whose input is ``prompt``)."""

    model: str
    input: str | list[str] | None = None
    prompt: str | None = None
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None


class OllamaShowRequest(_Body):
    """``POST /api/show`` (older clients name the model ``name``)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


def _refuse_images(images: list[Any] | None, param: str) -> None:
    if images:
        raise bad_request(
            "Images are not supported: servelm serves text models only.", param=param, code="images_not_supported"
        )


def sampling_fields(options: dict[str, Any] | None) -> dict[str, Any]:
    """The OpenAI sampling fields of Ollama's ``options``."""
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        field = OPTION_FIELDS.get(key)
        if field is None or value is None:
            continue
        if key == "num_predict" and isinstance(value, int) and value < 0:
            continue  # -1: until the model stops, -2: until the context is full; both are the default here
        out[field] = value
    return out


def format_fields(fmt: str | dict[str, Any] | None) -> dict[str, Any]:
    """Ollama's ``format`` ("json", or a JSON schema) as OpenAI's ``response_format``."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise bad_request(f"'format' must be \"json\" or a JSON schema, not {fmt!r}.", param="format")


def _openai_message(m: OllamaMessage, i: int, call_ids: list[str]) -> dict[str, Any]:
    _refuse_images(m.images, f"messages[{i}].images")
    msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            args = call.function.arguments
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            call_ids.append(call_id)
            calls.append({"id": call_id, "type": "function", "function": {
                "name": call.function.name, "arguments": args if isinstance(args, str) else json.dumps(args)}})  # fmt: skip
        msg["tool_calls"] = calls
    if m.role == "tool":
        # Ollama's tool messages name the tool, OpenAI's the call: answer the earliest call not yet answered.
        msg["tool_call_id"] = call_ids.pop(0) if call_ids else f"call_{i}"
        if m.tool_name:
            msg["name"] = m.tool_name
    return msg


M = TypeVar("M", bound=BaseModel)


def _validated(cls: type[M], data: dict[str, Any]) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"Invalid request: {where}: {first.get('msg')}", param=where or None) from None


def chat_request(req: OllamaChatRequest, model: str) -> ChatCompletionRequest:
    """``/api/chat`` as a chat completion of ``model`` (the served name), streaming when Ollama's does."""
    if not req.messages:
        raise bad_request("'messages' must hold at least one message.", param="messages")
    call_ids: list[str] = []
    messages = [_openai_message(m, i, call_ids) for i, m in enumerate(req.messages)]
    data: dict[str, Any] = {
        "model": model,
        "messages": messages,
        **sampling_fields(req.options),
        **format_fields(req.format),
    }
    if req.tools:
        data["tools"] = req.tools
    if req.stream:
        data.update(stream=True, stream_options={"include_usage": True})
    return _validated(ChatCompletionRequest, data)


def generate_request(req: OllamaGenerateRequest, model: str) -> ChatCompletionRequest | CompletionRequest:
    """``/api/generate``: the prompt (after ``system``) through the chat template, or as it is with ``raw``."""
    _refuse_images(req.images, "images")
    if req.suffix:
        raise bad_request("'suffix' (fill-in-the-middle) is not supported.", param="suffix")
    if req.template:
        raise bad_request(
            "'template' (a Go template) is not supported: servelm renders with the model's chat template.",
            param="template",
        )
    if req.context:
        raise bad_request(
            "'context' (deprecated by Ollama) is not supported: send the conversation to /api/chat.", param="context"
        )
    fields: dict[str, Any] = {"model": model, **sampling_fields(req.options), **format_fields(req.format)}
    if req.stream:
        fields.update(stream=True, stream_options={"include_usage": True})
    if req.raw:
        return _validated(CompletionRequest, {**fields, "prompt": req.prompt or ""})
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": req.prompt or ""})
    return _validated(ChatCompletionRequest, {**fields, "messages": messages})


def embedding_request(req: OllamaEmbedRequest, model: str) -> EmbeddingRequest:
    inputs = req.input if req.input is not None else req.prompt
    if inputs is None or inputs == []:
        raise bad_request("'input' must be a text or a list of texts.", param="input")
    data: dict[str, Any] = {"model": model, "input": inputs, "truncate_prompt_tokens": -1 if req.truncate else None}
    if req.dimensions is not None:
        data["dimensions"] = req.dimensions
    return _validated(EmbeddingRequest, data)


def tool_calls(openai_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    if not openai_calls:
        return None
    out = []
    for call in openai_calls:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"name": fn.get("name", ""), "arguments": args if isinstance(args, dict) else {}}})
    return out


def done_reason(finish_reason: str | None) -> str:
    """OpenAI's finish reason as Ollama's ``done_reason`` (a call ends with "stop" there)."""
    return "length" if finish_reason == "length" else "stop"


def error_of(chunk: dict[str, Any]) -> APIError | None:
    """The error an OpenAI stream reported in-band, if this chunk is one."""
    err = chunk.get("error")
    if not isinstance(err, dict):
        return None
    return APIError(500, str(err.get("message", "the request failed")), code=err.get("code"))


__all__ = [
    "OllamaChatRequest",
    "OllamaEmbedRequest",
    "OllamaGenerateRequest",
    "OllamaShowRequest",
    "chat_request",
    "done_reason",
    "embedding_request",
    "generate_request",
    "tool_calls",
]
