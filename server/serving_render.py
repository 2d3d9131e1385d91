"""vLLM's ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``: the token ids a
generation request's prompt becomes, without generating.

vllm-router's ``cache_aware`` policy asks each replica for them before it routes a request and matches
them against what it sent each replica before; a replica that cannot render gets its requests spread
as under ``round_robin``. The prompt is checked and encoded exactly as the generation endpoints do it
(in the tokenizer thread); sampling fields are not validated: nothing is generated.
"""

from __future__ import annotations

from typing import Any

from servelm.server.chat import chat_text_chars, normalize_messages, render_chat_prompt, template_kwargs
from servelm.server.chat_template import pick_chat_template
from servelm.server.errors import bad_request
from servelm.server.protocol_chat import ChatCompletionRequest
from servelm.server.protocol_completions import CompletionRequest
from servelm.server.serving_common import ServingContext, check_token_ids
from servelm.server.serving_completions import _check_prompt_sizes, _prepare_prompts, _split_prompt
from servelm.server.tools import render_kwargs, tool_mode


async def render_completion(ctx: ServingContext, req: CompletionRequest) -> list[dict[str, Any]]:
    """One ``{"token_ids": [...]}`` per prompt, as vLLM answers."""
    ctx.resolve_model(req.model)
    texts, given_ids = _split_prompt(req.prompt)
    _check_prompt_sizes(ctx, texts, given_ids)
    check_token_ids([t for t in given_ids if t is not None], ctx.vocab_size)
    prompt_ids, _ = await ctx.async_engine.run_blocking(_prepare_prompts, ctx.tokenizer, texts, given_ids, False)
    for i, ids in enumerate(prompt_ids):
        if not ids:  # as generation refuses it
            raise bad_request(f"Prompt {i} is empty (0 tokens).", param="prompt")
    return [{"token_ids": ids} for ids in prompt_ids]


async def render_chat(ctx: ServingContext, req: ChatCompletionRequest) -> dict[str, Any]:
    """``{"token_ids": [...]}``: the messages (and tools) through the chat template, as vLLM answers."""
    ctx.resolve_model(req.model)
    tools = tool_mode(req, ctx.tool_parser, ctx.auto_tool_choice)  # rendered as the request itself is
    messages = normalize_messages(req.messages)
    kwargs = template_kwargs(req.chat_template_kwargs)
    template = pick_chat_template(ctx, req.chat_template)
    text = chat_text_chars(req.messages, req.tools, kwargs, req.chat_template)
    ctx.check_prompt_chars(text, "messages", "the messages and tools have", "Please shorten the messages.")
    ids = await ctx.async_engine.run_blocking(
        lambda: render_chat_prompt(
            ctx.tokenizer,
            messages,
            **render_kwargs(tools),
            template_kwargs=kwargs,
            special_token_guard=ctx.special_token_guard,
            chat_template=template,
        )
    )
    return {"token_ids": ids}


__all__ = ["render_chat", "render_completion"]
