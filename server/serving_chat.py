"""``POST /v1/chat/completions``: messages -> chat template -> one engine request with n choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.chat import chat_text_chars, normalize_messages, render_chat_prompt, template_kwargs
from servelm.server.chat_template import pick_chat_template
from servelm.server.errors import bad_request, unsupported
from servelm.server.logprobs import chat_logprobs_content, vllm_prompt_logprobs
from servelm.server.protocol import sse
from servelm.server.protocol_chat import ChatCompletionRequest
from servelm.server.reasoning import ReasoningMode, ReasoningStream, after_thinking, split_reasoning
from servelm.server.request_group import RequestGroup
from servelm.server.serving_common import (
    ServingContext,
    add_requests,
    common_sampling_params,
    random_id,
    until_disconnect,
)
from servelm.server.serving_outputs import UsageCounter, collect_choices, counted_outputs, dumps, event_stream
from servelm.server.structured_outputs import structured_output_spec
from servelm.server.tools import ToolMode, render_kwargs, tool_mode


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    """Fields that would change the answer and that we cannot honour: 400 naming the field."""
    if req.functions:
        raise unsupported("functions", "'functions' (function calling) is not supported by this server")
    if req.function_call not in (None, "none"):
        raise unsupported("function_call", "'function_call' is not supported by this server")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise unsupported("modalities", "only the 'text' modality is supported")
    for name in ("audio", "prediction", "reasoning_effort", "verbosity", "web_search_options"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    if req.return_hidden_states:
        raise unsupported("return_hidden_states", "'return_hidden_states' is not supported by this server")
    if req.continue_final_message:
        raise unsupported("continue_final_message", "'continue_final_message' is not supported by this server")
    if (req.model_extra or {}).get("use_beam_search"):
        raise unsupported("use_beam_search", "'use_beam_search' is served on /v1/completions only")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")


@dataclass
class ChatStart:
    """A chat request validated, rendered and queued: what its response is built from."""

    params: SamplingParams
    prompt_ids: list[int]
    tools: ToolMode | None
    group: RequestGroup
    model: str  # the id its response names: the served model's or the LoRA adapter's
    reasoning: ReasoningMode | None = None  # how its output splits into thinking and answer (None: it does not)

    def splitter(self) -> ReasoningStream | None:
        """A fresh splitter for one of its outputs, None when the text is all answer."""
        r = self.reasoning
        return ReasoningStream(r.parser, r.phase) if r is not None else None


async def start_chat(ctx: ServingContext, req: ChatCompletionRequest, arrival: float, request_id: str) -> ChatStart:
    """Validate ``req``, render its messages through the chat template and queue it (400 naming the
    field for what cannot be served). Shared by /v1/chat/completions and /v1/responses."""
    lora = ctx.resolve_model(req.model)
    refuse_unsupported(req)
    tools = tool_mode(req, ctx.tool_parser, ctx.auto_tool_choice)
    messages = normalize_messages(req.messages)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        params = common_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, vocab_size=ctx.vocab_size)
    except Exception as e:
        # SamplingParams knows "max_tokens" and "logprobs"; name what this client actually sent.
        p = getattr(e, "param", None)
        if p == "max_tokens":
            e.param = max_param  # type: ignore[attr-defined]
        elif p == "logprobs":
            e.param = "top_logprobs"  # type: ignore[attr-defined]
        raise
    ctx.check_sequences(1, params.n)
    if tools is not None and tools.family is not None and tools.family.keeps_special_tokens(ctx.tokenizer):
        params.skip_special_tokens = False  # the family's markers are special tokens its parser must see
    kwargs = template_kwargs(req.chat_template_kwargs)
    template = pick_chat_template(ctx, req.chat_template)
    # The template adds to the messages' text, never removes from it.
    text = chat_text_chars(req.messages, req.tools, kwargs, req.chat_template)
    ctx.check_prompt_chars(text, "messages", "the messages and tools have", "Please shorten the messages.")
    spec = tools.structured_output(ctx.tokenizer) if tools is not None else structured_output_spec(req)
    parser = ctx.reasoning_parser

    def render() -> tuple[list[int], ReasoningMode | None]:
        ids = render_chat_prompt(
            ctx.tokenizer, messages, **render_kwargs(tools), template_kwargs=kwargs,
            special_token_guard=ctx.special_token_guard, chat_template=template,
        )  # fmt: skip
        if parser is None:
            return ids, None
        return ids, ReasoningMode(parser, parser.phase(ids, ctx.tokenizer), include=req.include_reasoning is not False)

    prompt_ids, reasoning = await ctx.async_engine.run_blocking(render)
    if spec is not None and reasoning is not None:
        # The grammar constrains the answer after the thinking, not the thinking.
        spec = await ctx.async_engine.run_blocking(after_thinking, spec, reasoning, ctx.tokenizer)
    await ctx.add_structured_output(req, params, spec)
    group = await add_requests(
        ctx,
        [(request_id, prompt_ids, params)],
        arrival,
        param_map={"max_tokens": max_param, "prompt": "messages"},
        lora_name=lora,
        cache_salt=req.cache_salt,
        priority=req.priority,
    )
    if req.separate_reasoning is False:
        reasoning = None  # the thinking stays in the content (SGLang's separate_reasoning)
    return ChatStart(params, prompt_ids, tools, group, lora or ctx.served_model_name, reasoning)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    created = int(time.time())
    request_id = random_id("chatcmpl")
    ctx.fields.note(raw, req, request_id, "/v1/chat/completions")
    start = await start_chat(ctx, req, arrival, request_id)
    job = _ChatCompletion(ctx, req, start, request_id, created)
    if req.stream:
        return event_stream(job.stream, start.group)
    body = await until_disconnect(raw, job.collect(), start.group)
    return JSONResponse(body)


class _ChatCompletion:
    """One chat request in flight: turns engine outputs into OpenAI chat choices / chunks."""

    def __init__(
        self, ctx: ServingContext, req: ChatCompletionRequest, start: ChatStart, request_id: str, created: int
    ) -> None:
        self.ctx = ctx
        self.model = start.model
        self.req = req
        self.tools = start.tools
        self.n = start.params.n
        self.want_logprobs = start.params.logprobs is not None
        self.id = request_id
        self.created = created
        self.group = start.group
        self.usage = UsageCounter([len(start.prompt_ids)], self.n)
        self.start = start

    async def collect(self) -> dict[str, Any]:
        prompt_entries: list[Any] | None = None

        def take_prompt_logprobs(out: RequestOutput) -> None:
            nonlocal prompt_entries
            if out.prompt_logprobs is not None:
                prompt_entries = out.prompt_logprobs

        collected = await collect_choices(self.group, self.usage, on_output=take_prompt_logprobs)
        choices = []
        for i in range(self.n):
            lp = None
            if self.want_logprobs:
                lp = {"content": chat_logprobs_content(self.ctx.token_strings, collected.logprobs[i]), "refusal": None}
            message: dict[str, Any] = {"role": "assistant", "content": collected.text(i), "refusal": None}
            mode = self.start.reasoning
            if mode is not None:
                thinking, answer = split_reasoning(mode.parser, mode.phase, message["content"])
                # As vLLM: no content when the output was all thinking.
                message["content"] = answer if answer or thinking is None else None
                if thinking is not None and mode.include:
                    message["reasoning_content"] = thinking
            reason = collected.finish[i]
            if self.tools is not None:
                content, calls = self.tools.answer(message["content"] or "")
                if calls is not None:
                    message["content"], message["tool_calls"] = content, calls
                    reason = self._call_finish_reason(reason)
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage.openai(),
            "system_fingerprint": None,
        }
        k = self.req.prompt_logprobs
        if k is not None:  # vLLM's extension, over the rendered prompt's tokens
            body["prompt_logprobs"] = (
                None if prompt_entries is None else vllm_prompt_logprobs(self.ctx.token_strings, prompt_entries, k)
            )
        return body

    def _call_finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call, "stop" for a named (forced) function."""
        assert self.tools is not None
        return reason if reason != "stop" or self.tools.name is not None else "tool_calls"

    def _chunk(self, choice: dict[str, Any] | None, include_usage: bool, usage: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice is not None else [],
        }
        if include_usage:
            chunk["usage"] = usage
        return sse(dumps(chunk))

    async def stream(self) -> AsyncIterator[bytes]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        # The role chunk first, for every choice, as OpenAI does.
        for i in range(self.n):
            role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield self._chunk(role, include_usage)
        calls = _StreamedCalls(self.tools, self.n) if self.tools is not None else None
        splits = [self.start.splitter() for _ in range(self.n)]
        show_thinking = self.start.reasoning is not None and self.start.reasoning.include
        async for _, out in counted_outputs(self.group, self.usage):
            for c in out.outputs:
                i = c.index
                lp = None
                if self.want_logprobs and c.new_logprobs:
                    lp = {"content": chat_logprobs_content(self.ctx.token_strings, c.new_logprobs), "refusal": None}
                reason = c.finish_reason
                text, thinking = c.new_text, ""
                split = splits[i]
                if split is not None:
                    thinking, text = split.feed(c.new_text, final=reason is not None)
                if thinking and show_thinking:
                    # The thinking's own chunk; the tokens' logprobs ride with it when no answer text follows.
                    yield self._chunk(
                        {
                            "index": i,
                            "delta": {"reasoning_content": thinking},
                            "logprobs": None if text else lp,
                            "finish_reason": None,
                        },
                        include_usage,
                    )
                    if not text:
                        lp = None
                if split is not None and not text and reason is None and lp is None:
                    continue  # nothing of the answer yet (a named call's first delta waits for its text)
                delta: dict[str, Any] | None = {"content": text} if text or lp is not None else None
                if calls is not None:
                    delta, called = calls.delta(i, text, finished=reason is not None)
                    if reason is not None and called:
                        reason = self._call_finish_reason(reason)
                    if delta is None and lp is not None:
                        delta = {}
                if delta is not None:
                    yield self._chunk(
                        {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}, include_usage
                    )
                if reason is not None:
                    done = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
                    yield self._chunk(done, include_usage)
        if include_usage:
            yield self._chunk(None, True, self.usage.openai())


class _StreamedCalls:
    """Tool calls as stream deltas. A named function's arguments stream as they come (its first delta
    carries the call's id and name); an array of calls is sent whole when the choice finishes: its
    whole calls (an array cut by ``max_tokens`` before any is sent as content then). Under
    "auto", a choice whose first text does not start the array is a text answer, streamed as usual.
    With a family's parser (--tool-call-parser), content and calls stream as the parser reads them."""

    def __init__(self, tools: ToolMode, n: int) -> None:
        self.tools = tools
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in range(n)]
        self.started = [False] * n
        self.calling: list[bool | None] = [None] * n  # undecided until a choice's first text
        # With a family's parser, each choice's text is read as it comes: calls stream as they form.
        streams = [tools.answer_stream() for _ in range(n)]
        self.answers = [s for s in streams if s is not None] or None

    def delta(self, i: int, text: str, finished: bool) -> tuple[dict[str, Any] | None, bool]:
        """(the delta to send for choice i, or None; whether its output was a call)."""
        tools = self.tools
        if self.answers is not None:
            answer = self.answers[i]
            return answer.chat_delta(text, finished), answer.called
        if self.calling[i] is None and text:
            self.calling[i] = tools.is_call(text)
        if self.calling[i] is False:
            return ({"content": text} if text else None), False
        if tools.name is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self.started[i]:
                self.started[i] = True
                call.update(id=self.ids[i], type="function")
                call["function"] = {"name": tools.name, "arguments": text}
            elif not text:
                return None, True
            return {"tool_calls": [call]}, True
        self.texts[i].append(text)
        if not finished:
            return None, False
        whole = "".join(self.texts[i])
        calls = tools.parse(whole)
        if calls is None:
            return ({"content": whole} if whole else None), False
        return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, True
