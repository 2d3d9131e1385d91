"""vLLM's renderer endpoints, ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``:
a generation request's prompt token ids, exactly as generation would encode them, nothing generated.

KV-aware routers (vllm-router ``--policy kv_aware``) call them on the replicas to learn a request's
tokens, then match its full blocks against the KV events each replica published. The answer keeps
vLLM's ``GenerateRequest`` shape: a list of them for completions (one per prompt), one for chat.
"""

from __future__ import annotations

from typing import Any

from servelm.server.chat import chat_text_chars, normalize_messages, render_chat_prompt
from servelm.server.errors import bad_request
from servelm.server.protocol_chat import ChatCompletionRequest
from servelm.server.protocol_completions import CompletionRequest
from servelm.server.serving_common import ServingContext, check_token_ids, random_id
from servelm.server.serving_completions import _check_prompt_sizes, _prepare_prompts, _split_prompt
from servelm.server.tools import render_kwargs, tool_mode


def _generate_request(request_id: str, token_ids: list[int], model: str, req: Any, max_tokens: int | None) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": max_tokens},
        "model": model,
        "stream": bool(req.stream),
        "cache_salt": req.cache_salt,
        "priority": req.priority or 0,
    }


async def render_completion(ctx: ServingContext, req: CompletionRequest) -> list[dict[str, Any]]:
    lora = ctx.resolve_model(req.model)
    texts, given_ids = _split_prompt(req.prompt)
    _check_prompt_sizes(ctx, texts, given_ids)
    check_token_ids([t for t in given_ids if t is not None], ctx.vocab_size)
    prompt_ids, _ = await ctx.async_engine.run_blocking(_prepare_prompts, ctx.tokenizer, texts, given_ids, False)
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise bad_request(f"Prompt {i} is empty (0 tokens).", param="prompt")
    request_id = random_id("cmpl")
    model = lora or ctx.served_model_name
    return [_generate_request(f"{request_id}-{i}", ids, model, req, req.max_tokens) for i, ids in enumerate(prompt_ids)]


async def render_chat(ctx: ServingContext, req: ChatCompletionRequest) -> dict[str, Any]:
    lora = ctx.resolve_model(req.model)
    tools = tool_mode(req)
    messages = normalize_messages(req.messages)
    ctx.check_prompt_chars(chat_text_chars(req.messages, req.tools), "messages", "the messages and tools have", "Please shorten the messages.")
    ids = await ctx.async_engine.run_blocking(lambda: render_chat_prompt(ctx.tokenizer, messages, **render_kwargs(tools)))
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _generate_request(random_id("chatcmpl"), ids, lora or ctx.served_model_name, req, max_tokens)


__all__ = ["render_chat", "render_completion"]
