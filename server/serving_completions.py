"""``POST /v1/completions``: prompts (text or token ids, one or many) -> choices, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.errors import bad_request, unsupported
from servelm.server.logprobs import completion_logprobs, join_logprobs, prompt_logprobs_object, vllm_prompt_logprobs
from servelm.server.protocol import sse
from servelm.server.protocol_completions import CompletionRequest
from servelm.server.request_group import RequestGroup
from servelm.server.serving_beam import beam_search_params
from servelm.server.serving_common import (
    ServingContext,
    add_requests,
    check_token_ids,
    common_sampling_params,
    random_id,
    until_disconnect,
)
from servelm.server.serving_outputs import UsageCounter, collect_choices, counted_outputs, dumps, event_stream


def _split_prompt(prompt: Any) -> tuple[list[str | None], list[list[int] | None]]:
    """OpenAI's four prompt forms -> per prompt either its text or its token ids."""
    if isinstance(prompt, str):
        return [prompt], [None]
    if not prompt:
        raise bad_request("'prompt' must not be empty.", param="prompt")
    # The request model validated ``prompt`` as one member of its union: the list is homogeneous.
    first = prompt[0]
    if isinstance(first, int):
        return [None], [prompt]
    if isinstance(first, str):
        return list(prompt), [None] * len(prompt)
    return [None] * len(prompt), list(prompt)


def _prepare_prompts(
    tokenizer: Any, texts: list[str | None], ids: list[list[int] | None], echo: bool
) -> tuple[list[list[int]], list[str]]:
    """Tokenize text prompts; decode token prompts when they must be echoed (tokenizer thread)."""
    out_ids: list[list[int]] = []
    echo_texts: list[str] = []
    for text, tids in zip(texts, ids):
        if tids is None:
            assert text is not None
            tids = list(tokenizer.encode(text))
        out_ids.append(tids)
        if echo:
            echo_texts.append(text if text is not None else tokenizer.decode(tids))
    return out_ids, echo_texts


def _check_prompt_sizes(ctx: ServingContext, texts: list[str | None], ids: list[list[int] | None]) -> None:
    """Each prompt within the context, and the text of all of them within what one request may have
    tokenized, before anything is tokenized or compiled (400 naming ``prompt``)."""
    one = len(texts) == 1
    chars = [len(t) for t in texts if t is not None]
    for i, text in enumerate(texts):
        if text is not None:
            ctx.check_prompt_chars(len(text), "prompt", "your prompt has" if one else f"prompt {i} has")
    if len(chars) > 1:
        hint = "One request tokenizes at most this much text: send fewer or shorter prompts per request."
        ctx.check_prompt_chars(sum(chars), "prompt", f"your {len(chars)} prompts have", hint)
    for i, tids in enumerate(ids):
        if tids is not None and len(tids) > ctx.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
                f"{'your prompt' if one else f'prompt {i}'} has {len(tids)} tokens. Please shorten the prompt.",
                param="prompt",
            )


def refuse_unsupported(req: CompletionRequest, n: int) -> None:
    """Fields this server cannot honour: 400 naming the field."""
    if req.suffix:
        raise unsupported("suffix", "'suffix' (insertion) is not supported by this server")
    if req.return_hidden_states:
        raise unsupported("return_hidden_states", "'return_hidden_states' is not supported by this server")
    if req.best_of is not None and req.best_of != n and not req.use_beam_search:
        raise unsupported(
            "best_of", f"'best_of' must equal 'n' ({n}) or be omitted: best-of-n selection is not supported"
        )
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens must be at least 1, got 0 (0 is allowed only with 'echo': the prompt alone, "
            "with its logprobs if 'logprobs' is set).",
            param="max_tokens",
        )


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    created = int(time.time())
    request_id = random_id("cmpl")
    ctx.fields.note(raw, req, request_id, "/v1/completions")
    lora = ctx.resolve_model(req.model)
    n = req.n if req.n is not None else 1
    refuse_unsupported(req, n)
    # max_tokens 0 with echo: score the prompt, generate nothing (the engine samples one token, unused).
    prompt_only = req.max_tokens == 0
    if prompt_only and req.min_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens (0).", param="min_tokens")
    max_tokens = 1 if prompt_only else req.max_tokens
    params = common_sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, vocab_size=ctx.vocab_size)
    returned = beam_search_params(req, params, ctx.vocab_size) if req.use_beam_search else None
    if req.echo and req.logprobs is not None:
        # Scored once for both views (the echoed legacy object, vLLM's prompt_logprobs); ranges checked already.
        params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
    texts, given_ids = _split_prompt(req.prompt)
    ctx.check_sequences(len(texts), params.n)
    _check_prompt_sizes(ctx, texts, given_ids)
    check_token_ids([t for t in given_ids if t is not None], ctx.vocab_size)
    await ctx.add_structured_output(req, params)
    prompt_ids, echo_texts = await ctx.async_engine.run_blocking(
        _prepare_prompts, ctx.tokenizer, texts, given_ids, bool(req.echo)
    )
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise bad_request(f"Prompt {i} is empty (0 tokens).", param="prompt")

    sub_ids = [f"{request_id}-{i}" for i in range(len(prompt_ids))]
    requests = [(sid, ids, params) for sid, ids in zip(sub_ids, prompt_ids)]
    group = await add_requests(ctx, requests, arrival, lora_name=lora, cache_salt=req.cache_salt, priority=req.priority)
    job = _Completion(
        ctx, req, params, request_id, created, sub_ids, prompt_ids, echo_texts, group, prompt_only, lora, returned
    )
    if req.stream:
        return event_stream(job.stream, group)
    body = await until_disconnect(raw, job.collect(), group)
    return JSONResponse(body)


class _Completion:
    """One completions request in flight: turns engine outputs into OpenAI choices."""

    def __init__(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        params: SamplingParams,
        request_id: str,
        created: int,
        sub_ids: list[str],
        prompt_ids: list[list[int]],
        echo_texts: list[str],
        group: RequestGroup,
        prompt_only: bool = False,
        model: str | None = None,
        returned: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.model = model or ctx.served_model_name
        self.req = req
        self.params = params
        self.n = params.n
        self.returned = returned  # beam search: the best ``returned`` of each prompt's ``n`` beams are answered
        self.cumulative: dict[int, float] = {}  # beam search: each choice's summed log-probability
        self.id = request_id
        self.created = created
        self.prompt_index = {sid: i for i, sid in enumerate(sub_ids)}
        self.prompt_ids = prompt_ids
        self.echo_texts = echo_texts
        self.group = group
        self.want_logprobs = params.logprobs is not None
        self.prompt_only = prompt_only  # echo the prompt, drop the one token the engine made
        # Per prompt: its tokens' logprobs once the engine has scored them (echo + logprobs, or
        # vLLM's prompt_logprobs), and the echoed legacy object made of them.
        self.echo_logprobs = bool(req.echo) and req.logprobs is not None
        self.prompt_entries: list[list[Any] | None] = [None] * len(prompt_ids)
        self.prompt_logprobs: list[dict[str, Any] | None] = [None] * len(prompt_ids)
        num_choices = len(prompt_ids) * self.n
        self.usage = UsageCounter([len(ids) for ids in prompt_ids], self.n)
        # Where the next token's text starts in the choice's text (logprobs.text_offset).
        self.offsets = [len(echo_texts[i // self.n]) if echo_texts else 0 for i in range(num_choices)]

    def _usage(self) -> dict[str, Any]:
        return self.usage.openai(completion_tokens=0 if self.prompt_only else None)

    def _prompt_of(self, out: RequestOutput) -> int:
        return self.prompt_index[out.request_id]

    async def collect(self) -> dict[str, Any]:
        collected = await collect_choices(
            self.group, self.usage, self._prompt_of, on_output=self._on_output, keep_text=not self.prompt_only
        )
        choices = []
        for i in range(len(self.usage.output)):
            text = collected.text(i)
            if self.echo_texts:
                text = self.echo_texts[i // self.n] + text
            lp = None
            if self.want_logprobs:
                lp, _ = completion_logprobs(self.ctx.token_strings, collected.logprobs[i], self.offsets[i])
                lp = join_logprobs(self.prompt_logprobs[i // self.n], None if self.prompt_only else lp)
            choice = {
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": self._finish_reason(collected.finish[i]),
            }
            if self.req.prompt_logprobs is not None:
                entries = self.prompt_entries[i // self.n]
                choice["prompt_logprobs"] = (
                    None
                    if entries is None
                    else vllm_prompt_logprobs(self.ctx.token_strings, entries, self.req.prompt_logprobs)
                )
            if i in self.cumulative:
                choice["cumulative_logprob"] = self.cumulative[i]
            choices.append(choice)
        if self.returned is not None:  # the best beams, best first; the others neither answered nor counted
            for i in range(len(choices)):
                if i % self.n >= self.returned:
                    self.usage.output[i] = 0
            choices = [c for i, c in enumerate(choices) if i % self.n < self.returned]
            for k, choice in enumerate(choices):
                choice["index"] = k
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            "system_fingerprint": None,
        }

    def _finish_reason(self, reason: str | None) -> str | None:
        # max_tokens 0 ends by length, whatever stopped the token the engine made and we dropped.
        return "length" if self.prompt_only and reason == "stop" else reason

    def _on_output(self, out: RequestOutput) -> None:
        self._take_prompt_logprobs(out)
        base = self._prompt_of(out) * self.n
        for c in out.outputs:
            if c.cumulative_logprob is not None:
                self.cumulative[base + c.index] = c.cumulative_logprob

    def _take_prompt_logprobs(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is None:
            return
        p = self.prompt_index[out.request_id]
        self.prompt_entries[p] = out.prompt_logprobs
        if self.echo_logprobs:
            self.prompt_logprobs[p] = prompt_logprobs_object(
                self.ctx.token_strings, self.prompt_ids[p], out.prompt_logprobs, int(self.req.logprobs or 0)
            )

    async def stream(self) -> AsyncIterator[bytes]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        echo_pending = [bool(self.echo_texts)] * len(self.usage.output)
        async for base, out in counted_outputs(self.group, self.usage, self._prompt_of):
            self._take_prompt_logprobs(out)
            for c in out.outputs:
                i = base + c.index
                text = "" if self.prompt_only else c.new_text
                lp = None
                if self.want_logprobs and c.new_logprobs and not self.prompt_only:
                    lp, self.offsets[i] = completion_logprobs(self.ctx.token_strings, c.new_logprobs, self.offsets[i])
                if echo_pending[i]:
                    # The engine sends a prompt's logprobs no later than its first choice output.
                    text = self.echo_texts[i // self.n] + text
                    lp = join_logprobs(self.prompt_logprobs[i // self.n], lp)
                    echo_pending[i] = False
                if not text and lp is None and c.finish_reason is None:
                    continue  # text held back (a possible stop string): nothing to say yet
                choice = {
                    "index": i,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": self._finish_reason(c.finish_reason),
                }
                yield self._chunk([choice], include_usage)
        if include_usage:
            yield self._chunk([], True, self._usage())

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool, usage: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage
        return sse(dumps(chunk))
