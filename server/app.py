"""The FastAPI application: routes, metrics wiring, and the lifespan that starts the engine threads
and drains them on shutdown (the gate in front of the routes is server/gate.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from servelm.metrics.observer import ObserverProxy
from servelm.server.async_engine import AsyncEngine
from servelm.server.errors import (
    document_validation_as_400,
    error_responses,
    install_error_handlers,
    model_not_found,
    unavailable,
)
from servelm.server.gate import DEFAULT_MAX_REQUEST_BYTES, GateMiddleware, serving_of
from servelm.server.model_registry import ModelRegistry
from servelm.server.ollama_api import install_ollama
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
from servelm.server.serving_embeddings import install_embeddings
from servelm.server.serving_fields import RequestHeadersMiddleware
from servelm.server.serving_lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from servelm.server.serving_messages import count_tokens, create_message
from servelm.server.serving_models import model_cards
from servelm.server.serving_playground import install_playground
from servelm.server.serving_props import install_props
from servelm.server.serving_render import render_chat, render_completion
from servelm.server.serving_responses import create_response, stored_response
from servelm.server.serving_tokenize import detokenize, tokenize

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0


def servelm_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("servelm")
    except PackageNotFoundError:
        return "0.1.0"


# ------------------------------------------------------------------------------------ metrics wiring


def create_prometheus_observer(engine: Any, registry: Any = None) -> Any | None:
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
    quantization = (
        runner.quantization
        if runner is not None and hasattr(runner, "quantization")
        else getattr(cfg, "quantization", None)
    )
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
    # ``registry``: a server of several models gives each model's series a registry of its own.
    return PrometheusObserver(
        str(engine.served_model_name), info, peak_flops, peak_bw, max_loras=max_loras, registry=registry
    )


def _render_metrics(registry: Any, models: ModelRegistry) -> tuple[bytes, str]:
    if models.multi and models.metrics is not None:
        from servelm.metrics.models import render_merged

        def registries() -> list[Any]:
            own = [getattr(h.observer, "registry", None) for h in models.handles.values()]
            return [models.metrics.registry, *(r for r in own if r is not None)]

        return render_merged(registries)
    if registry is not None:
        try:
            from servelm.metrics.prometheus import render_metrics

            return render_metrics(registry)
        except ImportError:
            pass
    # Fallback without metrics/prometheus: the bridge's own snapshot, in the text format.
    ae = models.default.async_engine
    if ae is None:
        return b"", "text/plain; version=0.0.4; charset=utf-8"
    s = ae.snapshot
    lines = [
        "# TYPE servelm_num_requests_running gauge",
        f"servelm_num_requests_running {s.num_running}",
        "# TYPE servelm_num_requests_waiting gauge",
        f"servelm_num_requests_waiting {s.num_waiting}",
        "# TYPE servelm_kv_cache_used_blocks gauge",
        f"servelm_kv_cache_used_blocks {s.num_used_blocks}",
    ]
    return ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8"


# ---------------------------------------------------------------------------------------------- app


def build_app(
    async_engine: AsyncEngine | None = None,
    *,
    registry: ModelRegistry | None = None,
    api_key: str | None = None,
    metrics_registry: Any = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    max_request_bytes: int | None = None,
    allow_runtime_lora_updating: bool = False,
    playground: bool = True,
) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine``, or over the models of ``registry`` (started and drained by the app's lifespan); ``max_request_bytes``: the largest /v1 POST body (default ``DEFAULT_MAX_REQUEST_BYTES``).
    ``allow_runtime_lora_updating``: serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
    ``playground``: serve the chat page at ``/`` and ``/playground`` (server/serving_playground.py)."""

    if registry is None:
        assert async_engine is not None, "build_app needs an engine or a model registry"
        registry = ModelRegistry.single(async_engine, ServingContext.from_engine(async_engine))
    models = registry

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        models.start()
        try:
            yield
        finally:
            await models.shutdown(drain_timeout_s)

    version = servelm_version()
    app = FastAPI(title="servelm", version=version, lifespan=lifespan)
    app.state.models = models
    # A one-model server's context (handlers of a server of several get theirs from the gate's lease).
    app.state.serving = models.default.ctx
    store = app.state.responses = ResponseStore()
    install_error_handlers(app)
    document_validation_as_400(app)
    app.add_middleware(
        GateMiddleware, registry=models, api_key=api_key, max_body_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
    )
    app.add_middleware(RequestHeadersMiddleware)  # outermost: the gate's refusals echo X-Request-Id too

    def serving(raw: Request) -> ServingContext:
        return serving_of(raw, models)

    # 429: every loaded LoRA adapter in use (--max-cpu-loras), which only a LoRA server returns.
    lora_429 = (429,) if models.default.info is not None and models.default.info.enable_lora else ()
    generation_errors = error_responses(400, 401, 404, 413, *lora_429, 500, 503)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=generation_errors)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(serving(raw), body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=generation_errors)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(serving(raw), body, raw)

    @app.post("/v1/responses", response_model=ResponseObject, responses=generation_errors)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(serving(raw), store, body, raw)

    @app.post(
        "/v1/messages",
        response_model=MessageObject,
        responses=error_responses(400, 401, 404, 413, *lora_429, 500, 503, 529, anthropic=True),
    )
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await create_message(serving(raw), body, raw)

    @app.post(
        "/v1/messages/count_tokens",
        response_model=TokenCount,
        responses=error_responses(400, 401, 404, 413, 503, anthropic=True),
    )
    async def messages_count_tokens(body: CountTokensRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await count_tokens(serving(raw), body, raw))

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
        return ModelList(data=model_cards(models))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404, 503))
    async def get_model(model_id: str) -> ModelCard:
        for card in model_cards(models):
            if card.id == model_id:
                return card
        raise model_not_found(model_id)

    if allow_runtime_lora_updating:

        @app.post(
            "/v1/load_lora_adapter",
            response_class=PlainTextResponse,
            responses=error_responses(400, 401, 413, 429, 503),
        )
        async def load_lora_route(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
            return await load_lora_adapter(serving(raw), body)

        @app.post(
            "/v1/unload_lora_adapter",
            response_class=PlainTextResponse,
            responses=error_responses(400, 401, 404, 413, 503),
        )
        async def unload_lora_route(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
            return await unload_lora_adapter(serving(raw), body)

    # vLLM's render endpoints: the prompt's token ids, which vllm-router's cache_aware policy routes on.
    @app.post("/v1/completions/render", responses=error_responses(400, 401, 404, 413, 503))
    async def completions_render(body: CompletionRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await render_completion(serving(raw), body))

    @app.post("/v1/chat/completions/render", responses=error_responses(400, 401, 404, 413, 503))
    async def chat_completions_render(body: ChatCompletionRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await render_chat(serving(raw), body))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 404, 413, 503))
    async def tokenize_route(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
        return await tokenize(serving(raw), body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 401, 404, 413, 503))
    async def detokenize_route(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        return await detokenize(serving(raw), body)

    # /health is readiness (503 while draining, as vLLM's and SGLang's); /live is liveness (vLLM's
    # /live): a draining pod must not be restarted by its liveness probe.
    @app.head("/health", include_in_schema=False)
    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        dead = models.dead_engine()
        if dead is not None:
            return unavailable(f"The engine is not running ({dead}).", "engine_dead").response()
        if not models.accepting or not models.default_accepting():
            return unavailable("The server is shutting down.", "shutting_down").response()
        return JSONResponse({"status": "ok"})

    @app.head("/live", include_in_schema=False)
    @app.get("/live", responses=error_responses(503))
    async def live() -> Response:
        dead = models.dead_engine()
        if dead is not None:
            return unavailable(f"The engine is not running ({dead}).", "engine_dead").response()
        return JSONResponse({"status": "ok" if models.accepting and models.default_accepting() else "draining"})

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse({"version": version})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        ae = models.default.async_engine
        if metrics_registry is None and not models.multi and ae is not None and not ae.in_process and ae.is_alive:
            # The engine's series live in its engine-core process (server.engine_core renders them).
            body, content_type = await ae.call("metrics", draining=True)
        else:
            body, content_type = _render_metrics(metrics_registry, models)
        return Response(body, media_type=None, headers={"Content-Type": content_type})

    install_props(app, serving)
    install_embeddings(app, serving)
    install_ollama(app, models, version)
    if playground:
        install_playground(app)
    return app


__all__ = ["GateMiddleware", "ObserverProxy", "build_app", "create_prometheus_observer", "servelm_version"]
