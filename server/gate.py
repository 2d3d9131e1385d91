"""The gate every API request passes before its handler: API key, availability, body size, and on a
server of several models the lease of the model the request names (loaded first if need be)."""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.server.async_engine import AsyncEngine
from servelm.server.errors import (
    RETRY_AFTER_S,
    APIError,
    bad_request,
    error_response,
    payload_too_large,
    unauthorized,
    unavailable,
)
from servelm.server.model_registry import ModelRegistry
from servelm.server.model_specs import ModelSpecError, parse_keep_alive
from servelm.server.serving_common import ServingContext
from servelm.server.serving_embeddings import wrong_model_kind

# The largest /v1 request body read (413 beyond): 256 prompts of 8k token ids are ~13 MB of JSON.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
# Outside /v1 but gated like it (bodies read in the tokenizer thread; /props describes the model as /v1/models).
GATED_PATHS = frozenset({"/tokenize", "/detokenize", "/props"})
# Paths that name no model, or act on the registry itself, on a server of several models.
UNLEASED_PATHS = frozenset({
    "/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/api/tags", "/api/ps", "/api/show",
    "/api/version", "/api/pull", "/api/push", "/api/delete", "/api/create", "/api/copy",
})  # fmt: skip
# Ollama's paths by the OpenAI path that serves them (what a model of the wrong kind refuses).
OLLAMA_KIND = {
    "/api/chat": "/v1/chat/completions",
    "/api/generate": "/v1/completions",
    "/api/embed": "/v1/embeddings",
    "/api/embeddings": "/v1/embeddings",
}
# The scope key the gate leaves the leased model's context under, for ``serving_of``.
SERVING_KEY = "servelm.serving"
# The scope key of the seconds a request waited for its model to load (Ollama's load_duration).
LOAD_WAIT_KEY = "servelm.load_wait_s"
# The response header saying a request waited for its model to load (and how many seconds).
LOAD_HEADER = b"x-servelm-model-load-seconds"


def serving_of(request: Request, registry: ModelRegistry) -> ServingContext:
    """The context of the model this request leased (the default model's on a one-model server)."""
    ctx = request.scope.get(SERVING_KEY) or registry.default.ctx
    if ctx is None:
        raise unavailable(f"The model `{registry.default.id}` is not loaded.", code="model_not_loaded")
    return ctx


def gated(path: str) -> bool:
    return path.startswith("/v1/") or path.startswith("/api/") or path in GATED_PATHS


class GateMiddleware:
    """API-key check, availability check and body-size limit for ``/v1/*``, ``/api/*``, ``/tokenize``
    and ``/detokenize`` (pure ASGI: no per-chunk overhead on responses).

    ``/health``, ``/live``, ``/version`` and ``/metrics`` stay open (probes and scrapers carry no
    key), as do the docs. A dead engine or a draining server answers 503 before any body is parsed,
    and a POST body over ``max_body_bytes`` gets 413 before it is parsed (or, with a Content-Length,
    read). With several models, a request holds its model (``ModelRegistry.lease``) until its
    response has been sent, streams included.
    """

    def __init__(
        self,
        app: ASGIApp,
        registry: ModelRegistry,
        api_key: str | None,
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.app = app
        self.registry = registry
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not gated(scope["path"]):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        err = self._check_key(scope)
        body = b""
        if err is None and not self.registry.accepting:
            err = _shutting_down()
        multi = self.registry.multi
        if err is None and not multi:
            err = engine_error(self.registry.default.async_engine, path)
        if err is None and scope["method"] == "POST":
            scope = _as_json(scope)
            receive, err, body = await _read_body(scope, receive, self.max_body_bytes)
        if err is not None:
            await error_response(err, path)(scope, receive, send)
            return
        if multi and path not in UNLEASED_PATHS and not path.startswith(("/v1/responses/", "/v1/models")):
            await self._leased(scope, receive, send, body)
        else:
            await self.app(scope, receive, send)

    async def _leased(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        path = scope["path"]
        started = False

        async def send_marked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if waited is not None:
                    headers = [*message.get("headers", []), (LOAD_HEADER, f"{waited:.3f}".encode())]
                    message = {**message, "headers": headers}
            await send(message)

        waited: float | None = None
        try:
            name, keep_alive, data = _model_fields(body)
            if (
                keep_alive == 0
                and path in ("/api/generate", "/api/chat")
                and not data.get("prompt")
                and not data.get("messages")
            ):
                # Ollama's "unload this model": no lease (it would load it first); the handler answers.
                await self.registry.unload(self.registry.resolve(name), reason="request")
                await self.app(scope, receive, send_marked)
                return
            async with self.registry.lease(name, keep_alive) as lease:
                waited = lease.load_wait_s
                if waited is not None and self.registry.metrics is not None:
                    self.registry.metrics.waited(lease.ctx.served_model_name, waited)
                err = engine_error(lease.ctx.async_engine, path)
                if err is not None:
                    raise err
                await self.app({**scope, SERVING_KEY: lease.ctx, LOAD_WAIT_KEY: waited or 0.0}, receive, send_marked)
        except APIError as err:
            if started:
                raise
            await error_response(err, path)(scope, receive, send_marked)

    def _check_key(self, scope: Scope) -> APIError | None:
        if self.api_key is None:
            return None
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                given = token.strip() if scheme.lower() == b"bearer" else b""
                break
            if name == b"x-api-key":  # Anthropic's header (its SDK sends only this one)
                given = value.strip()
                break
        if not given or not hmac.compare_digest(given, self.api_key):
            return unauthorized()
        return None


def _shutting_down() -> APIError:
    err = unavailable("The server is shutting down and accepts no new requests.", code="shutting_down")
    err.headers = {"Retry-After": str(RETRY_AFTER_S)}  # (another replica takes the retry)
    return err


def engine_error(ae: AsyncEngine | None, path: str) -> APIError | None:
    """503 for an engine that is dead or draining, 400 for a path its model's kind does not serve."""
    if ae is None:
        return None
    if not ae.is_alive:
        reason = ae.dead_reason or "not running"
        return unavailable(f"The engine is not running ({reason}).", code="engine_dead")
    if not ae.is_accepting:
        return _shutting_down()
    # generation on an embedding model, and the converse
    return wrong_model_kind(OLLAMA_KIND.get(path, path), ae.info)


def _model_fields(body: bytes) -> tuple[str | None, Any, dict[str, Any]]:
    """The ``model`` a request body names, its ``keep_alive`` ("model": the model's own), and the body.
    A body that is not a JSON object names none: its handler answers it."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    name = data.get("model")
    keep: Any = "model"
    if data.get("keep_alive") is not None:
        try:
            keep = parse_keep_alive(data["keep_alive"])
        except ModelSpecError as e:
            raise bad_request(str(e), param="keep_alive") from None
    return (name if isinstance(name, str) else None), keep, data


async def _read_body(scope: Scope, receive: Receive, limit: int) -> tuple[Receive, APIError | None, bytes]:
    """Read the request body whole, up to ``limit`` bytes, and return a ``receive`` that replays it
    (then hands on to the client's: disconnects still reach the app), and the body. Past the limit: a 413."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.strip().isdigit() and int(value) > limit:
            return receive, payload_too_large(limit), b""
    chunks: list[bytes] = []
    size = 0
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left while sending: let the app see it
            pending: list[Message] = [message]
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return receive, payload_too_large(limit), b""
        chunks.append(chunk)
        if not message.get("more_body", False):
            body = b"".join(chunks)
            pending = [{"type": "http.request", "body": body, "more_body": False}]
            break

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay, None, body


def _as_json(scope: Scope) -> Scope:
    """Read every /v1 POST body as JSON: ``curl -d`` sends form-urlencoded, and the API only speaks JSON."""
    headers = scope.get("headers", [])
    for name, value in headers:
        if name == b"content-type" and value.split(b";")[0].strip().lower() == b"application/json":
            return scope
    fixed = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type", b"application/json")]
    return {**scope, "headers": fixed}


__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "GATED_PATHS", "LOAD_HEADER", "GateMiddleware", "serving_of"]
