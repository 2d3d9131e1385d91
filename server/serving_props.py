"""llama-server's ``GET /props``: what this server serves, its chat template above all, so a user can
read the text every chat request (chat, Responses, Messages) is rendered through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from servelm.server.chat_template import served_chat_template
from servelm.server.errors import error_responses
from servelm.server.serving_common import ServingContext


def server_props(ctx: ServingContext) -> dict[str, Any]:
    """The fields of llama-server's answer that servelm has: the served chat template (``--chat-template``'s,
    else the model's own; null when there is none), the model's name and path, its special tokens and
    its context length."""
    tok = ctx.tokenizer
    return {
        "chat_template": served_chat_template(ctx),
        "model_alias": ctx.served_model_name,
        "model_path": ctx.model_path,
        "bos_token": getattr(tok, "bos_token", None),
        "eos_token": getattr(tok, "eos_token", None),
        "default_generation_settings": {"n_ctx": ctx.max_model_len},
        "modalities": {"vision": False, "audio": False},
    }


def install_props(app: FastAPI, serving: Callable[[Request], ServingContext]) -> None:
    """``serving``: the context of the model a request names (the default model's for /props)."""

    @app.get("/props", responses=error_responses(401, 503))
    async def props(raw: Request) -> dict[str, Any]:
        return server_props(serving(raw))
