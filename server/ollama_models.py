"""Ollama's model endpoints: ``/api/tags`` (every model), ``/api/ps`` (the loaded ones), ``/api/show``,
``/api/version``, and a clear refusal for ``/api/pull``, ``/api/push``, ``/api/delete``, ``/api/create``
and ``/api/copy``: models here are files named at start-up, not a registry's downloads."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from servelm.server.chat_template import served_chat_template
from servelm.server.errors import APIError, bad_request
from servelm.server.model_registry import ModelHandle, ModelRegistry
from servelm.server.ollama_protocol import OllamaShowRequest

# A model kept loaded has no expiry; Ollama's clients parse one, so it is far in the future, as Ollama's.
FOREVER = "2318-01-01T00:00:00Z"


def _path(handle: ModelHandle) -> Path | None:
    if handle.spec.config.model is not None:
        return Path(handle.spec.config.model)
    ctx = handle.ctx
    return Path(ctx.model_path) if ctx is not None and ctx.model_path else None


def _modified_at(handle: ModelHandle) -> str:
    path = _path(handle)
    try:
        stamp = path.stat().st_mtime if path is not None else 0.0
    except OSError:
        stamp = 0.0
    return datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(handle: ModelHandle) -> str:
    """An identifier of the model's files (not Ollama's content digest: the files are not hashed)."""
    return hashlib.sha256(f"{_path(handle)}:{_modified_at(handle)}".encode()).hexdigest()


def details(handle: ModelHandle) -> dict[str, Any]:
    path = _path(handle)
    info = handle.info
    arch = info.architecture if info is not None else None
    if arch:  # Ollama's family names: "llama" for LlamaForCausalLM, "gemma3", "qwen2"
        arch = str(arch).removesuffix("ForCausalLM").lower()
    quant = (info.quantization if info is not None else None) or handle.spec.config.quantization
    return {
        "parent_model": "",
        "format": "gguf" if path is not None and path.suffix == ".gguf" else "safetensors",
        "family": str(arch or ""),
        "families": [str(arch)] if arch else None,
        "parameter_size": "",
        "quantization_level": str(quant or ""),
    }


def _entry(handle: ModelHandle) -> dict[str, Any]:
    return {
        "name": handle.id, "model": handle.id, "modified_at": _modified_at(handle), "size": handle.spec.memory_bytes,
        "digest": _digest(handle), "details": details(handle),
    }  # fmt: skip


def _capabilities(handle: ModelHandle) -> list[str]:
    from servelm.server.serving_embeddings import is_encoder

    info = handle.info
    if info is None:
        return []
    return ["embedding"] if is_encoder(info) else ["completion", "tools"]


def _refusal(action: str) -> APIError:
    return APIError(
        501,
        f"servelm does not {action} models: it serves the model files named at start-up (--model, --models-file). "
        "Put the model's folder or GGUF file there instead.",
        code="not_supported",
    )


def install_ollama_models(app: FastAPI, models: ModelRegistry, version: str) -> None:
    """``version``: servelm's, which /api/version answers."""

    @app.get("/api/tags")
    async def api_tags() -> JSONResponse:
        return JSONResponse({"models": [_entry(h) for h in models.handles.values()]})

    @app.get("/api/ps")
    async def api_ps() -> JSONResponse:
        loaded = []
        for h in models.handles.values():
            if h.state != "loaded" or h.ctx is None:
                continue
            expires = (
                FOREVER
                if h.expires_at is None
                else datetime.fromtimestamp(h.expires_at, timezone.utc).isoformat().replace("+00:00", "Z")
            )
            loaded.append({**_entry(h), "expires_at": expires, "size_vram": 0, "context_length": h.ctx.max_model_len})
        return JSONResponse({"models": loaded})

    @app.post("/api/show")
    async def api_show(body: OllamaShowRequest) -> JSONResponse:
        name = body.model or body.name
        if not name:
            raise bad_request("'model' is required.", param="model")
        handle = models.resolve(name)
        ctx = handle.ctx
        info: dict[str, Any] = {"general.name": handle.id}
        d = details(handle)
        if ctx is not None:
            arch = d["family"] or "llama"
            info.update({"general.architecture": arch, f"{arch}.context_length": ctx.max_model_len})
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": (served_chat_template(ctx) or "") if ctx is not None else "",
            "details": d, "model_info": info, "capabilities": _capabilities(handle), "modified_at": _modified_at(handle),
        })  # fmt: skip

    @app.get("/api/version")
    async def api_version() -> JSONResponse:
        return JSONResponse({"version": version})

    for action in ("pull", "push", "delete", "create", "copy"):
        methods = ["POST", "DELETE"] if action == "delete" else ["POST"]  # Ollama's client deletes with DELETE
        app.add_api_route(f"/api/{action}", _refuser(action), methods=methods, include_in_schema=False)


def _refuser(action: str) -> Any:
    async def refuse() -> JSONResponse:
        raise _refusal(action)

    return refuse


__all__ = ["install_ollama_models"]
