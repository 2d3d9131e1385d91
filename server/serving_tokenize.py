"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the server's own tokenization, so a client can
count a prompt's tokens (or see where a chat template puts them) exactly as generation would encode it.

Same checks as the generation endpoints: the model name, the chat messages, a prompt's characters
against what ``max_model_len`` tokens can spell (tokenizing an unbounded text would hold the
tokenizer thread), token ids inside the vocabulary and at most ``max_model_len`` of them. The work
runs in the tokenizer thread.
"""

from __future__ import annotations

from typing import Any

from servelm.server.chat import chat_text_chars, normalize_messages, render_chat_prompt, template_kwargs
from servelm.server.chat_template import pick_chat_template
from servelm.server.errors import bad_request
from servelm.server.protocol_chat import ChatCompletionRequest
from servelm.server.protocol_tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from servelm.server.serving_common import ServingContext, check_token_ids
from servelm.server.tools import render_kwargs, tool_mode


def _encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    ctx.resolve_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request(
            "Give exactly one of 'prompt' and 'messages'.", param="prompt" if req.prompt is None else "messages"
        )
    if req.prompt is not None:
        for name in ("tools", "tool_choice", "chat_template", "chat_template_kwargs"):
            if getattr(req, name) is not None:
                raise bad_request(f"'{name}' goes with 'messages'.", param=name)
    run = ctx.async_engine.run_blocking
    if req.prompt is not None:
        ctx.check_prompt_chars(len(req.prompt), "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await run(_encode_prompt, ctx.tokenizer, req.prompt, special)
    else:
        assert req.messages is not None
        tools = tool_mode(ChatCompletionRequest(messages=req.messages, tools=req.tools, tool_choice=req.tool_choice))
        messages = normalize_messages(req.messages)
        kwargs = template_kwargs(req.chat_template_kwargs)
        template = pick_chat_template(ctx, req.chat_template)
        text = chat_text_chars(req.messages, req.tools, kwargs, req.chat_template)
        ctx.check_prompt_chars(text, "messages", "the messages and tools have", "Please shorten the messages.")
        ids = await run(
            lambda: render_chat_prompt(
                ctx.tokenizer,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                add_special_tokens=bool(req.add_special_tokens),
                **render_kwargs(tools),
                template_kwargs=kwargs,
                special_token_guard=ctx.special_token_guard,
                chat_template=template,
            )
        )
    strs = await run(ctx.tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    ctx.resolve_model(req.model)
    if len(req.tokens) > ctx.max_model_len:  # decoding them would hold the tokenizer thread
        raise bad_request(
            f"'tokens' holds {len(req.tokens)} ids, more than this model's maximum context length "
            f"({ctx.max_model_len}): no sequence of this model is longer.",
            param="tokens",
        )
    check_token_ids([req.tokens], ctx.vocab_size, param="tokens")
    text = await ctx.async_engine.run_blocking(ctx.tokenizer.decode, req.tokens)
    return DetokenizeResponse(prompt=text)


__all__ = ["detokenize", "tokenize"]
