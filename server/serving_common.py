"""What every OpenAI surface shares on the way in: the serving context, request -> SamplingParams,
engine errors -> HTTP errors, and running a request until it finishes or its client goes away
(``server.serving_outputs`` holds what they share on the way out)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from servelm.scheduler.lora_registry import LoRALimitError, LoRANotLoadedError
from servelm.scheduler.sampling_params import InvalidParameterError, LoRANotFoundError, SamplingParams
from servelm.scheduler.structured_output import GrammarCompiler, StructuredOutput
from servelm.server.async_engine import AsyncEngine, EngineDeadError, EngineStoppedError, QueueFullError
from servelm.server.chat_special_tokens import SpecialTokenGuard
from servelm.server.errors import (
    APIError,
    bad_request,
    internal_error,
    lora_limit_reached,
    model_not_found,
    queue_full,
    unavailable,
)
from servelm.server.logprobs import TokenStrings
from servelm.server.protocol import GenerationRequest
from servelm.server.reasoning import ReasoningParser
from servelm.server.request_group import RequestGroup
from servelm.server.serving_fields import FieldNotices
from servelm.server.structured_outputs import structured_output_spec
from servelm.server.tool_parsers import ToolParser

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ServingContext:
    """Everything a handler needs about the served model, built once at start-up."""

    async_engine: AsyncEngine
    served_model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the engine's, shared (see from_engine)
    created: int = field(default_factory=lambda: int(time.time()))
    model_path: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    # LoRA adapters served by name (name -> path); kept in step with the engine's by the handlers
    # that load and unload them
    loras: dict[str, str] = field(default_factory=dict)
    # One adapter folder read at a time (loads, and adapters unloaded by --max-cpu-loras read again):
    # each read holds a whole adapter's weights until the engine takes them.
    lora_reads: asyncio.Lock = field(default_factory=asyncio.Lock)
    fields: FieldNotices = field(default_factory=FieldNotices)  # the ignored field names logged so far
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser: thinking split from the answer
    tool_parser: type[ToolParser] | None = None  # --tool-call-parser: calls in the model's own format
    auto_tool_choice: bool = False  # --enable-auto-tool-choice: "auto" lets the model choose them
    # --split-special-tokens-in-content: special tokens the client's chat text spells are encoded as text
    split_special_tokens_in_content: bool = True
    chat_template: str | None = None  # --chat-template: rendered instead of the model's own
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request may send its own
    aliases: tuple[str, ...] = ()  # other names of the model (a models file's aliases)

    def __post_init__(self) -> None:
        self.token_strings = TokenStrings(self.tokenizer)
        self.max_prompt_chars = prompt_char_limit(self.tokenizer, self.max_model_len)
        # Structured outputs are compiled here, in the tokenizer thread (it owns ``tokenizer``).
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._special_token_guard = SpecialTokenGuard(self.tokenizer)

    @property
    def special_token_guard(self) -> SpecialTokenGuard | None:
        """What chat rendering keeps the client's text from spelling special tokens with (None: it may)."""
        return self._special_token_guard if self.split_special_tokens_in_content else None

    async def add_structured_output(
        self, req: GenerationRequest, params: SamplingParams, spec: StructuredOutput | None = None
    ) -> None:
        """Set ``params.structured_output`` (``spec``, else what the request asks) and compile it (400 if
        it does not compile)."""
        if spec is None:
            spec = structured_output_spec(req)
        if spec is None:
            return
        try:
            compiled = await self.async_engine.run_blocking(self.grammars.compile, spec)
        except InvalidParameterError as e:
            raise bad_request(str(e), param=e.param) from None
        # Until min_tokens the sampler forbids EOS and the stop token ids: the structure must allow some
        # other first token, or no token at all could be taken (once a structure has begun, it ends the
        # output itself when only its end may follow).
        ends = () if params.ignore_eos else (*self.eos_token_ids, *compiled.eos_token_ids)
        forbidden = [*params.stop_token_ids, *ends]
        if params.min_tokens > 0 and not compiled.can_start_without(forbidden):
            also = " or a stop token id" if params.stop_token_ids else ""
            raise bad_request(
                f"This structured output allows no first token but its end{also}, while min_tokens "
                f"({params.min_tokens}) forbids ending before {params.min_tokens} tokens: no output satisfies both.",
                param=spec.param,
            )
        params.structured_output = spec

    def check_sequences(self, prompts: int, n: int) -> None:
        """Refuse, before tokenizing, a request of more sequences than the queue can ever hold: a 503
        would tell its client to retry a request that can never be admitted."""
        limit = self.async_engine.max_waiting_requests
        if prompts * n > limit:
            raise bad_request(
                f"This request asks for {prompts * n} sequences ({prompts} prompt(s) x n={n}), more than "
                f"this server queues at once ({limit}; --max-waiting-requests).",
                param="n" if prompts == 1 else "prompt",
            )

    def check_prompt_chars(
        self, chars: int, param: str, what: str = "your prompt has", hint: str = "Please shorten the prompt."
    ) -> None:
        """Refuse, before tokenizing it, a prompt text too long to be ``max_model_len`` tokens; the same
        bound holds for all the text one request tokenizes (its prompts together, its messages and tools).

        Tokenizing costs ~6 µs and ~400 bytes per token, in the one tokenizer thread all requests share:
        a 100 MB prompt held it for 97 s and grew the process by 7 GB, only to be refused afterwards, and
        a request of many prompts, each under the bound, held it as long.
        """
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, {what} "
                f"{chars} characters, more than any text of {self.max_model_len} tokens can have with this "
                f"tokenizer ({limit}). {hint}",
                param=param,
            )

    @classmethod
    def from_engine(cls, async_engine: AsyncEngine) -> ServingContext:
        info = async_engine.info
        # The engine's tokenizer (in process, the engine's own object: a Gemma 3 copy is ~80 MiB):
        # encoding and decoding only read the Rust object, which shares reads across threads; nothing
        # sets its truncation or padding (``load_tokenizer`` clears them), the one change that would
        # need it exclusively.
        return cls(
            async_engine=async_engine,
            served_model_name=info.served_model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            tokenizer=async_engine.tokenizer,
            model_path=info.model_path,
            eos_token_ids=info.eos_token_ids,
            loras=dict(info.lora_adapters),  # an encoder has none
        )

    def resolve_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, None for the base model; 404 for anything else."""
        if model is None or model.removesuffix(":latest") in (self.served_model_name, *self.aliases):
            return None  # (Ollama's clients may add its default tag)
        if model in self.loras:
            return model
        raise model_not_found(model)


def prompt_char_limit(tokenizer: Any, max_tokens: int) -> int | None:
    """An upper bound on the characters of a text that encodes to at most ``max_tokens`` tokens.

    A token stands for at most as many characters as its vocabulary string has (byte-level BPE
    writes one character per byte, SentencePiece one per character, byte fallbacks ``<0x41>`` more),
    so the longest vocabulary entry bounds characters per token. A normalizer may merge characters
    (Unicode composition: at most 3 into 1), hence the factor 4 when there is one. None when the
    vocabulary cannot be read (no limit).
    """
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without get_vocab: no limit rather than no server
        return None
    if longest <= 0:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrink = 1 if backend is not None and backend.normalizer is None else 4
    return max_tokens * longest * shrink


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _opt(value: Any, default: Any) -> Any:
    return default if value is None else value


def common_sampling_params(
    req: GenerationRequest, *, max_tokens: int | None, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    """The SamplingParams both endpoints build from their shared fields (400 naming the param if bad)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("'prompt_logprobs' is not supported with 'stream'.", param="prompt_logprobs")
    bias: dict[int, float] | None = None
    if req.logit_bias:
        bias = {}
        for k, v in req.logit_bias.items():
            try:
                bias[int(k)] = float(v)
            except ValueError:
                raise bad_request(
                    f"Invalid key in 'logit_bias': {k!r} is not a token id.", param="logit_bias"
                ) from None
    stop = req.stop if req.stop is not None else []
    try:
        params = SamplingParams(
            n=_opt(req.n, 1),
            max_tokens=max_tokens,
            temperature=_opt(req.temperature, 1.0),
            top_p=_opt(req.top_p, 1.0),
            top_k=_opt(req.top_k, 0),
            min_p=_opt(req.min_p, 0.0),
            seed=req.seed,
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(req.stop_token_ids or []),
            presence_penalty=_opt(req.presence_penalty, 0.0),
            frequency_penalty=_opt(req.frequency_penalty, 0.0),
            repetition_penalty=_opt(req.repetition_penalty, 1.0),
            logit_bias=bias,
            min_tokens=_opt(req.min_tokens, 0),
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            ignore_eos=bool(req.ignore_eos),
            skip_special_tokens=_opt(req.skip_special_tokens, True),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
        )
        params.validate(vocab_size=vocab_size)
    except InvalidParameterError as e:
        raise bad_request(str(e), param=e.param) from None
    return params


def check_token_ids(prompts: list[list[int]], vocab_size: int, param: str = "prompt") -> None:
    for ids in prompts:
        if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # C speed; the loop below names the id
            continue
        for t in ids:
            if not 0 <= t < vocab_size:
                raise bad_request(
                    f"Token id {t} in '{param}' is outside the vocabulary (size {vocab_size}).", param=param
                )


def engine_error(exc: BaseException, param_map: dict[str, str] | None = None) -> APIError:
    """The HTTP error for an exception from ``AsyncEngine.add`` or a running request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LoRANotFoundError):  # unloaded between the check and the engine
        return model_not_found(exc.name)
    if isinstance(exc, LoRALimitError):
        return lora_limit_reached(f"Cannot serve this LoRA adapter now: {exc}.", param="model")
    if isinstance(exc, LoRANotLoadedError):  # its name kept being loaded again from other folders
        return unavailable(
            f"The LoRA adapter '{exc.name}' changed while it was read again; retry.", code="lora_adapter_changed"
        )
    if isinstance(exc, InvalidParameterError):
        param = (param_map or {}).get(exc.param, exc.param)
        return bad_request(str(exc), param=param)
    if isinstance(exc, QueueFullError):
        return queue_full(exc.limit)
    if isinstance(exc, EngineStoppedError):
        return unavailable(f"The server is not accepting requests: {exc}", code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return unavailable(f"The engine is not running: {exc}", code="engine_dead")
    log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return internal_error()


class RequestFailed(Exception):
    """The engine finished a request with ``finish_reason == "error"``."""


def check_output_error(out: Any) -> None:
    if out.error is not None:
        raise RequestFailed(out.error)
    for c in out.outputs:
        if c.finish_reason == "error":
            raise RequestFailed("the request failed inside the engine")
        if c.finish_reason == "abort":
            # Only the server aborts requests (client gone, shutdown): reaching a reader means shutdown.
            raise EngineStoppedError("the request was aborted")


def output_error(exc: BaseException) -> APIError:
    if isinstance(exc, RequestFailed):
        return internal_error(f"The request failed inside the engine: {exc}")
    return engine_error(exc)


async def add_requests(
    ctx: ServingContext,
    requests: list[tuple[str, list[int], SamplingParams]],
    arrival_time: float,
    param_map: dict[str, str] | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    priority: int | None = None,
) -> RequestGroup:
    if cache_salt is not None and not cache_salt:
        raise bad_request("'cache_salt' must be a non-empty string if given.", param="cache_salt")
    add = functools.partial(
        ctx.async_engine.add, requests, arrival_time, lora_name=lora_name, cache_salt=cache_salt, priority=priority
    )
    try:
        try:
            return await add()
        except LoRANotLoadedError:  # unloaded to make room (--max-cpu-loras): read it again
            return await _add_reading_adapter(ctx, add)
    except Exception as exc:  # mapped to the right HTTP error
        raise engine_error(exc, param_map) from None


async def _add_reading_adapter(ctx: ServingContext, add: Callable[..., Awaitable[RequestGroup]]) -> RequestGroup:
    """``add`` with the request's adapter read again from its folder, off the engine thread; a request
    that waited for another's read of the same adapter finds it loaded. Tried again if the name was
    loaded meanwhile from another folder (the engine takes only its current folder's weights)."""
    async with ctx.lora_reads:
        adapter = None
        for _ in range(2):
            try:
                return await add(lora_adapter=adapter)
            except LoRANotLoadedError as e:
                adapter = await _read_again(ctx, e)
        return await add(lora_adapter=adapter)


async def _read_again(ctx: ServingContext, e: LoRANotLoadedError) -> Any:
    try:
        return await ctx.async_engine.read_lora(e.path)
    except ValueError as err:  # runtime.lora.LoRAError: the folder is gone or no longer an adapter
        raise bad_request(
            f"The LoRA adapter '{e.name}' was unloaded from memory to make room (--max-cpu-loras) and cannot be "
            f"read again: {err}",
            param="model",
            code="invalid_lora_adapter",
        ) from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T], group: RequestGroup) -> T:
    """Await ``work`` (a non-streaming request); if the client disconnects first, abort the group."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Not done: the client left first (or this coroutine was cancelled). cancel() only asks; the
        # task is not "cancelled" until it runs again, so decide on done(), not on cancelled().
        abandoned = not task.done()
        if abandoned:
            task.cancel()
            group.close()
        watcher.cancel()
    if abandoned or task.cancelled():
        # The client is gone: nobody reads this (nginx's "client closed request" status).
        raise APIError(499, "The client closed the connection before the response was ready.", code="client_closed")
    try:
        return task.result()
    except APIError:
        raise
    except Exception as exc:  # engine death, a failed request...: the right status
        raise output_error(exc) from None


__all__ = [
    "ServingContext",
    "add_requests",
    "check_output_error",
    "check_token_ids",
    "common_sampling_params",
    "engine_error",
    "output_error",
    "random_id",
    "until_disconnect",
]
