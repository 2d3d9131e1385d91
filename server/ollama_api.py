"""Ollama's generation and embedding endpoints (``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``) over the OpenAI serving path: each request is translated (server/ollama_protocol.py),
served by the chat, completion or embeddings handler, and its answer, or its SSE chunks as they come,
translated into Ollama's JSON, or its NDJSON lines."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from servelm.server.errors import APIError
from servelm.server.gate import LOAD_WAIT_KEY, serving_of
from servelm.server.model_registry import ModelRegistry
from servelm.server.ollama_models import install_ollama_models
from servelm.server.ollama_protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    chat_request,
    done_reason,
    embedding_request,
    error_of,
    generate_request,
    tool_calls,
)
from servelm.server.protocol_chat import ChatCompletionRequest
from servelm.server.request_group import RequestGroup
from servelm.server.serving_chat import create_chat_completion
from servelm.server.serving_common import ServingContext
from servelm.server.serving_completions import create_completion
from servelm.server.serving_embeddings import create_embeddings

NDJSON = "application/x-ndjson"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def target(raw: Request, models: ModelRegistry, name: str) -> tuple[ServingContext, str]:
    """The context serving ``name`` and the model field its OpenAI request carries (the served id, or
    a LoRA adapter's name); 404 for a name no model has."""
    handle = models.resolve(name)
    ctx = serving_of(raw, models)
    return ctx, name if name in ctx.loras else handle.id if models.multi else ctx.served_model_name


class _Timing:
    """Ollama's durations (nanoseconds): the load wait, the prompt (to the first token), the rest."""

    def __init__(self, raw: Request) -> None:
        self.started = time.monotonic()
        self.load_s = float(raw.scope.get(LOAD_WAIT_KEY) or 0.0)
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def final(self, usage: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first or end
        usage = usage or {}
        return {
            "done": True, "done_reason": done_reason(reason),
            "total_duration": _ns(end - self.started + self.load_s), "load_duration": _ns(self.load_s),
            "prompt_eval_count": int(usage.get("prompt_tokens", 0)), "prompt_eval_duration": _ns(first - self.started),
            "eval_count": int(usage.get("completion_tokens", 0)), "eval_duration": _ns(end - first),
        }  # fmt: skip


def _answer(
    kind: str, text: str, thinking: str | None = None, calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The answer fields of a chat line (``message``) or a generate line (``response``)."""
    if kind == "generate":
        out: dict[str, Any] = {"response": text}
        if thinking:
            out["thinking"] = thinking
        return out
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


async def _serve(
    ctx: ServingContext, raw: Request, model: str, kind: str, oreq: Any, create: Callable[..., Awaitable[Response]]
) -> Response:
    timing = _Timing(raw)
    resp = await create(ctx, oreq, raw)
    if not oreq.stream:
        body = json.loads(bytes(resp.body))
        choice = body["choices"][0]
        msg = choice.get("message") or {}
        text = msg.get("content") if "message" in choice else choice.get("text")
        timing.first = timing.started  # no first-token time without a stream: the prompt is counted in eval
        line = {
            "model": model,
            "created_at": now_iso(),
            **_answer(kind, text or "", msg.get("reasoning_content"), tool_calls(msg.get("tool_calls"))),
        }
        return JSONResponse({**line, **timing.final(body.get("usage"), choice.get("finish_reason"))})
    group = resp.group  # type: ignore[attr-defined]
    return NDJSONResponse(_lines(resp.body_iterator, model, kind, timing), group)  # type: ignore[attr-defined]


async def _lines(events: AsyncIterator[Any], model: str, kind: str, timing: _Timing) -> AsyncIterator[bytes]:
    """The OpenAI stream's chunks as Ollama's lines: text as it comes, tool calls whole, then the
    ``done`` line with the counts; an in-band error as Ollama's ``{"error": ...}`` line."""
    usage: dict[str, Any] | None = None
    reason: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    try:
        async for event in events:
            for chunk in _sse_data(event):
                err = error_of(chunk)
                if err is not None:
                    yield _line({"error": err.message})
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", ()):
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or choice.get("text") or ""
                    thinking = delta.get("reasoning_content")
                    for call in delta.get("tool_calls") or ():
                        seen = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                        fn = call.get("function") or {}
                        seen["name"] = fn.get("name") or seen["name"]
                        seen["arguments"] += fn.get("arguments") or ""
                    reason = choice.get("finish_reason") or reason
                    if text or thinking:
                        timing.token()
                        yield _line(
                            {"model": model, "created_at": now_iso(), **_answer(kind, text, thinking), "done": False}
                        )
        if calls:
            timing.token()
            whole = tool_calls([{"function": calls[i]} for i in sorted(calls)])
            yield _line({"model": model, "created_at": now_iso(), **_answer(kind, "", None, whole), "done": False})
        yield _line({"model": model, "created_at": now_iso(), **_answer(kind, ""), **timing.final(usage, reason)})
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _sse_data(event: bytes | str) -> list[dict[str, Any]]:
    """The JSON objects of the ``data:`` lines of one or more SSE events (``[DONE]`` left out)."""
    text = event.decode() if isinstance(event, bytes) else event
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            out.append(json.loads(line[6:]))
    return out


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class NDJSONResponse(StreamingResponse):
    """Ollama's streamed answer; releases the engine requests behind it however it ends (as the SSE
    response it translates would)."""

    def __init__(self, body: AsyncIterator[bytes], group: RequestGroup) -> None:
        super().__init__(body, media_type=NDJSON)
        self._group = group

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._group.close()


def _loaded_only(kind: str, model: str, keep_alive: Any) -> JSONResponse:
    """Ollama's answer to a request without a prompt: the model is loaded (or, with keep_alive 0, unloaded)."""
    unload = keep_alive in (0, "0", "0s", "0m")
    return JSONResponse(
        {
            "model": model,
            "created_at": now_iso(),
            **_answer(kind, ""),
            "done": True,
            "done_reason": "unload" if unload else "load",
        }
    )


def install_ollama(app: FastAPI, models: ModelRegistry, version: str) -> None:
    """Ollama's API under ``/api/`` (the gate checks the API key and leases the model, as for /v1)."""
    install_ollama_models(app, models, version)

    @app.post("/api/chat", response_class=JSONResponse)
    async def api_chat(body: OllamaChatRequest, raw: Request) -> Response:
        if not body.messages:
            models.resolve(body.model)  # (404 for an unknown name)
            return _loaded_only("chat", body.model, body.keep_alive)
        ctx, name = target(raw, models, body.model)
        return await _serve(ctx, raw, body.model, "chat", chat_request(body, name), create_chat_completion)

    @app.post("/api/generate", response_class=JSONResponse)
    async def api_generate(body: OllamaGenerateRequest, raw: Request) -> Response:
        if not body.prompt and not body.images:
            models.resolve(body.model)
            return _loaded_only("generate", body.model, body.keep_alive)
        ctx, name = target(raw, models, body.model)
        oreq = generate_request(body, name)
        create = create_chat_completion if isinstance(oreq, ChatCompletionRequest) else create_completion
        return await _serve(ctx, raw, body.model, "generate", oreq, create)

    @app.post("/api/embed")
    async def api_embed(body: OllamaEmbedRequest, raw: Request) -> JSONResponse:
        timing = _Timing(raw)
        ctx, name = target(raw, models, body.model)
        out = await create_embeddings(ctx, embedding_request(body, name), raw)
        vectors = [d.embedding for d in out.data]
        end = time.monotonic()
        return JSONResponse({
            "model": body.model, "embeddings": vectors, "total_duration": _ns(end - timing.started + timing.load_s),
            "load_duration": _ns(timing.load_s), "prompt_eval_count": out.usage.prompt_tokens,
        })  # fmt: skip

    @app.post("/api/embeddings")
    async def api_embeddings(body: OllamaEmbedRequest, raw: Request) -> JSONResponse:
        ctx, name = target(raw, models, body.model)
        if body.prompt is None:
            raise APIError(
                400, "'prompt' is required by /api/embeddings (or use /api/embed with 'input').", param="prompt"
            )
        out = await create_embeddings(ctx, embedding_request(body, name), raw)
        return JSONResponse({"embedding": out.data[0].embedding})


__all__ = ["NDJSONResponse", "install_ollama"]
