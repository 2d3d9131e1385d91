"""The FastAPI application: routes, the auth/availability gate, metrics wiring, and the lifespan
that starts the engine thread and drains it on shutdown."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.metrics.observer import Observer, RequestStats, StepStats
from servelm.server.async_engine import AsyncEngine
from servelm.server.errors import (
    RETRY_AFTER_S,
    APIError,
    document_validation_as_400,
    error_response,
    error_responses,
    install_error_handlers,
    model_not_found,
    payload_too_large,
    unauthorized,
    unavailable,
)
from servelm.server.protocol import ModelCard, ModelList
from servelm.server.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from servelm.server.protocol_completions import CompletionRequest, CompletionResponse
from servelm.server.protocol_messages import CountTokensRequest, MessageObject, MessagesRequest, TokenCount
from servelm.server.protocol_responses import DeletedResponse, ResponseObject, ResponsesRequest
from servelm.server.protocol_tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from servelm.server.response_store import ResponseStore
from servelm.server.serving_chat import create_chat_completion
from servelm.server.serving_common import ServingContext
from servelm.server.serving_completions import create_completion
from servelm.server.serving_embeddings import install_embeddings, wrong_model_kind
from servelm.server.serving_fields import RequestHeadersMiddleware
from servelm.server.serving_lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_lora_adapter,
    lora_cards,
    unload_lora_adapter,
)
from servelm.server.serving_messages import count_tokens, create_message
from servelm.server.serving_playground import install_playground
from servelm.server.serving_props import install_props
from servelm.server.serving_render import render_chat, render_completion
from servelm.server.serving_responses import create_response, stored_response
from servelm.server.serving_tokenize import detokenize, tokenize

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# The largest /v1 request body read (413 beyond): 256 prompts of 8k token ids are ~13 MB of JSON.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
# Outside /v1 but gated like it (bodies read in the tokenizer thread; /props describes the model as /v1/models).
GATED_PATHS = frozenset({"/tokenize", "/detokenize", "/props"})


def servelm_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("servelm")
    except PackageNotFoundError:
        return "0.1.0"


# ------------------------------------------------------------------------------------ metrics wiring


class ObserverProxy:
    """An ``Observer`` whose target is set after the engine exists.

    The Prometheus observer wants the engine's resolved facts (dtype, blocks...) as labels, while
    the engine wants its observer at construction: the engine gets this proxy, the proxy gets the
    real observer once both exist. Until then events are dropped (the engine is still loading).
    """

    def __init__(self, target: Observer | None = None) -> None:
        self.target = target

    def on_step(self, stats: StepStats) -> None:
        if self.target is not None:
            self.target.on_step(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        if self.target is not None:
            self.target.on_request_finished(stats)

    def on_request_rejected(self) -> None:
        if self.target is not None:
            self.target.on_request_rejected()


def create_prometheus_observer(engine: Any) -> Any | None:
    """A ``metrics.prometheus.PrometheusObserver`` describing ``engine``, or None if metrics/ lacks it."""
    try:
        from servelm.metrics.prometheus import PrometheusObserver
    except ImportError:
        log.warning("servelm.metrics.prometheus is not available: /metrics will only show basic engine gauges")
        return None
    cfg = engine.config
    cap = getattr(engine, "capacity", None)
    # What runs: the runner resolves ``--quantization auto`` at load.
    runner = getattr(engine, "runner", None)
    quantization = runner.quantization if runner is not None and hasattr(runner, "quantization") else getattr(cfg, "quantization", None)
    info = {
        "model": str(getattr(cfg, "model", None) or engine.served_model_name),
        "dtype": str(cfg.dtype),
        "device": str(cfg.device),
        "block_size": str(getattr(cap, "block_size", cfg.block_size)),
        "num_blocks": str(getattr(cap, "num_blocks", "")),
        "max_model_len": str(cfg.max_model_len),
        "quantization": str(quantization or "none"),
    }
    try:
        from servelm.metrics.roofline import device_peaks

        peak_flops, peak_bw = device_peaks(str(cfg.device))
    except Exception as e:  # utilization gauges are a nicety, serving is not
        log.warning("could not determine device peaks (%s); utilization gauges will read 0", e)
        peak_flops, peak_bw = float("inf"), float("inf")
    max_loras = cfg.max_loras if getattr(engine, "enable_lora", False) else None
    return PrometheusObserver(str(engine.served_model_name), info, peak_flops, peak_bw, max_loras=max_loras)


def _render_metrics(registry: Any, async_engine: AsyncEngine) -> tuple[bytes, str]:
    if registry is not None:
        try:
            from servelm.metrics.prometheus import render_metrics

            return render_metrics(registry)
        except ImportError:
            pass
    # Fallback without metrics/prometheus: the bridge's own snapshot, in the text format.
    s = async_engine.snapshot
    lines = [
        "# TYPE servelm_num_requests_running gauge",
        f"servelm_num_requests_running {s.num_running}",
        "# TYPE servelm_num_requests_waiting gauge",
        f"servelm_num_requests_waiting {s.num_waiting}",
        "# TYPE servelm_kv_cache_used_blocks gauge",
        f"servelm_kv_cache_used_blocks {s.num_used_blocks}",
    ]
    return ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8"


# --------------------------------------------------------------------------------------------- gate


class GateMiddleware:
    """API-key check, availability check and body-size limit for ``/v1/*``, ``/tokenize`` and
    ``/detokenize`` (pure ASGI: no per-chunk overhead on responses).

    ``/health``, ``/live``, ``/version`` and ``/metrics`` stay open (probes and scrapers carry no
    key), as do the docs. A dead engine or a draining server answers 503 before any body is parsed,
    and a POST body over ``max_body_bytes`` gets 413 before it is parsed (or, with a Content-Length,
    read).
    """

    def __init__(
        self,
        app: ASGIApp,
        async_engine: AsyncEngine,
        api_key: str | None,
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.app = app
        self.async_engine = async_engine
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in GATED_PATHS):
            err = self._check(scope)
            if err is None and scope["method"] == "POST":
                scope = _as_json(scope)
                receive, err = await _read_body(scope, receive, self.max_body_bytes)
            if err is not None:
                await error_response(err, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        if self.api_key is not None:
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
        ae = self.async_engine
        if not ae.is_alive:
            reason = ae.dead_reason or "not running"
            return unavailable(f"The engine is not running ({reason}).", code="engine_dead")
        if not ae.is_accepting:
            err = unavailable("The server is shutting down and accepts no new requests.", code="shutting_down")
            err.headers = {"Retry-After": str(RETRY_AFTER_S)}  # (another replica takes the retry)
            return err
        return wrong_model_kind(scope["path"], ae.engine)  # generation on an embedding model, and the converse


async def _read_body(scope: Scope, receive: Receive, limit: int) -> tuple[Receive, APIError | None]:
    """Read the request body whole, up to ``limit`` bytes, and return a ``receive`` that replays it
    (then hands on to the client's: disconnects still reach the app). Past the limit: a 413."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.strip().isdigit() and int(value) > limit:
            return receive, payload_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left while sending: let the app see it
            pending: list[Message] = [message]
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return receive, payload_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
            break

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay, None


def _as_json(scope: Scope) -> Scope:
    """Read every /v1 POST body as JSON: ``curl -d`` sends form-urlencoded, and the API only speaks JSON."""
    headers = scope.get("headers", [])
    for name, value in headers:
        if name == b"content-type" and value.split(b";")[0].strip().lower() == b"application/json":
            return scope
    fixed = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type", b"application/json")]
    return {**scope, "headers": fixed}


# ---------------------------------------------------------------------------------------------- app


def build_app(
    async_engine: AsyncEngine,
    *,
    api_key: str | None = None,
    metrics_registry: Any = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    max_request_bytes: int | None = None,
    allow_runtime_lora_updating: bool = False,
    playground: bool = True,
) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine`` (started and drained by the app's lifespan); ``max_request_bytes``: the largest /v1 POST body (default ``DEFAULT_MAX_REQUEST_BYTES``).
    ``allow_runtime_lora_updating``: serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
    ``playground``: serve the chat page at ``/`` and ``/playground`` (server/serving_playground.py)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown(drain_timeout_s)

    version = servelm_version()
    app = FastAPI(title="servelm", version=version, lifespan=lifespan)
    ctx = ServingContext.from_engine(async_engine)
    app.state.serving = ctx
    store = app.state.responses = ResponseStore()
    install_error_handlers(app)
    document_validation_as_400(app)
    app.add_middleware(GateMiddleware, async_engine=async_engine, api_key=api_key, max_body_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
    app.add_middleware(RequestHeadersMiddleware)  # outermost: the gate's refusals echo X-Request-Id too

    def model_card() -> ModelCard:
        return ModelCard(
            id=ctx.served_model_name, created=ctx.created, root=ctx.model_path, max_model_len=ctx.max_model_len
        )

    # 429: every loaded LoRA adapter in use (--max-cpu-loras), which only a LoRA server returns.
    lora_429 = (429,) if getattr(async_engine.engine, "enable_lora", False) else ()
    generation_errors = error_responses(400, 401, 404, 413, *lora_429, 500, 503)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=generation_errors)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=generation_errors)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, body, raw)

    @app.post("/v1/responses", response_model=ResponseObject, responses=generation_errors)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, store, body, raw)

    @app.post("/v1/messages", response_model=MessageObject, responses=error_responses(400, 401, 404, 413, *lora_429, 500, 503, 529, anthropic=True))
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await create_message(ctx, body, raw)

    @app.post("/v1/messages/count_tokens", response_model=TokenCount, responses=error_responses(400, 401, 404, 413, 503, anthropic=True))
    async def messages_count_tokens(body: CountTokensRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await count_tokens(ctx, body, raw))

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=error_responses(401, 404, 503))
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored_response(store, response_id))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(401, 404, 503))
    async def delete_response(response_id: str) -> DeletedResponse:
        stored_response(store, response_id)  # 404 when unknown
        store.delete(response_id)
        return DeletedResponse(id=response_id, deleted=True)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401, 503))
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(), *lora_cards(ctx)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404, 503))
    async def get_model(model_id: str) -> ModelCard:
        if model_id == ctx.served_model_name:
            return model_card()
        for card in lora_cards(ctx):
            if card.id == model_id:
                return card
        raise model_not_found(model_id)

    if allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 401, 413, 429, 503))
        async def load_lora_route(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            return await load_lora_adapter(ctx, body)

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 401, 404, 413, 503))
        async def unload_lora_route(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            return await unload_lora_adapter(ctx, body)

    # vLLM's render endpoints: the prompt's token ids, which vllm-router's cache_aware policy routes on.
    @app.post("/v1/completions/render", responses=error_responses(400, 401, 404, 413, 503))
    async def completions_render(body: CompletionRequest) -> JSONResponse:
        return JSONResponse(await render_completion(ctx, body))

    @app.post("/v1/chat/completions/render", responses=error_responses(400, 401, 404, 413, 503))
    async def chat_completions_render(body: ChatCompletionRequest) -> JSONResponse:
        return JSONResponse(await render_chat(ctx, body))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 404, 413, 503))
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(ctx, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 401, 404, 413, 503))
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(ctx, body)

    # /health is readiness (503 while draining, as vLLM's and SGLang's); /live is liveness (vLLM's
    # /live): a draining pod must not be restarted by its liveness probe.
    @app.head("/health", include_in_schema=False)
    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        if not async_engine.is_alive:
            return unavailable(f"The engine is not running ({async_engine.dead_reason or 'stopped'}).", "engine_dead").response()
        if not async_engine.is_accepting:
            return unavailable("The server is shutting down.", "shutting_down").response()
        return JSONResponse({"status": "ok"})

    @app.head("/live", include_in_schema=False)
    @app.get("/live", responses=error_responses(503))
    async def live() -> Response:
        if not async_engine.is_alive:
            return unavailable(f"The engine is not running ({async_engine.dead_reason or 'stopped'}).", "engine_dead").response()
        return JSONResponse({"status": "ok" if async_engine.is_accepting else "draining"})

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse({"version": version})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        body, content_type = _render_metrics(metrics_registry, async_engine)
        return Response(body, media_type=None, headers={"Content-Type": content_type})

    install_props(app, ctx)
    install_embeddings(app, ctx)
    if playground:
        install_playground(app)
    return app


__all__ = ["GateMiddleware", "ObserverProxy", "build_app", "create_prometheus_observer", "servelm_version"]
