"""The engine of an encoder model (embeddings, rerank, score): prompt-only requests through the same
``Scheduler`` as generation, each computed whole in one step and pooled.

Design: a request is a ``Request`` with ``max_tokens=0``. The scheduler admits it under the token budget
and the sequence cap, in its policy's order and fair share, only whole (``whole_prompts``: bidirectional
attention needs every token of a sequence in one forward). Its blocks in the ``BlockManager`` are an
account of the step's tokens with no pool behind them (the runner allocates no KV): they are freed when
the request finishes, in the step that computed it. ``max_num_batched_tokens`` is raised to the longest
input, so that every admissible request fits a step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from servelm.metrics.observer import NullObserver, Observer
from servelm.runtime.encoder_loader import is_encoder_model
from servelm.runtime.encoder_runner import EncoderRunner
from servelm.runtime.encoder_tokenizer import load_encoder_tokenizer
from servelm.runtime.platform import platform_of, resolve_device
from servelm.runtime.serving_defaults import DTYPE_NAMES, resolve_dtype
from servelm.scheduler.block_manager import BlockManager
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.errors import InvalidParameterError
from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.sampling_params import SamplingParams
from servelm.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

__all__ = ["EncoderEngine", "PoolingParams", "is_encoder_model"]


@dataclass(frozen=True)
class PoolingParams:
    """A prompt-only request: embed the prompt (what the embeddings, rerank and score endpoints send)."""

    n: int = 1  # one sequence per prompt (the bridge counts waiting sequences by ``n``)


@dataclass(frozen=True)
class EncoderCapacity:
    """What start-up settled, in the words the server logs."""

    block_size: int
    num_blocks: int
    max_model_len: int
    weight_bytes: int
    max_num_batched_tokens: int

    def describe(self) -> str:
        return (
            f"weights {self.weight_bytes / 2**20:.1f} MiB; encoder: no KV cache; steps of up to "
            f"{self.max_num_batched_tokens} tokens; inputs up to max_model_len={self.max_model_len} tokens"
        )


class EncoderEngine:
    """Tokenizer, scheduler, block accounting and the encoder runner; ``step`` embeds one batch.

    Implements what the server's bridge needs of an engine (``server.engine_thread.EngineLike``);
    a request's one output carries its ``embedding``.
    """

    is_encoder = True
    enable_lora = False
    eos_token_ids: tuple[int, ...] = ()

    def __init__(
        self, config: EngineConfig, observer: Observer | None = None, *, runner: EncoderRunner | None = None
    ) -> None:
        if not config.model:
            raise ValueError(
                "an encoder engine needs --model (a sentence-transformers folder or a nomic-bert GGUF file)"
            )
        if config.enable_lora or config.lora_modules or config.speculative_config or config.tensor_parallel_size != 1:
            raise ValueError("LoRA adapters, speculative decoding and tensor parallelism are not served for encoders")
        self.observer: Observer = observer if observer is not None else NullObserver()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.runner = runner if runner is not None else EncoderRunner(config.model, self.device, self.dtype)
        self.encoder = self.runner.encoder
        longest = self.encoder.pooling.max_seq_length
        if config.max_model_len is not None and config.max_model_len > self.encoder.config.max_tokens:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's {self.encoder.config.max_tokens} positions"
            )
        max_len = config.max_model_len or longest
        defaults = platform_of(self.device).defaults(self.dtype, self.encoder.config.head_dim)
        budget = max(config.max_num_batched_tokens or defaults.max_num_batched_tokens, max_len)
        bs = self.runner.block_size
        # Every sequence of a step may leave a partly used block.
        num_blocks = -(-budget // bs) + config.max_num_seqs
        self.config = dataclasses.replace(
            config, device=str(self.device), dtype=DTYPE_NAMES.get(self.dtype, str(self.dtype)), block_size=bs,
            max_model_len=max_len, max_num_batched_tokens=budget, enable_prefix_caching=False, kv_cache_memory=0, quantization=None,
        )  # fmt: skip
        self.capacity = EncoderCapacity(bs, num_blocks, max_len, self.runner.weight_bytes, budget)
        self.served_model_name = config.served_model_name or self.encoder.name
        self.tokenizer = load_encoder_tokenizer(config.model, self.encoder.gguf_fields)
        self.block_manager = BlockManager(num_blocks, bs, False)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget,
            policy=config.scheduling_policy, max_request_share=config.max_request_share, whole_prompts=True,
        )  # fmt: skip
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs made outside ``step`` (aborts)
        self._seq_ids = itertools.count()
        self._flops_per_token = 2.0 * self.runner.num_parameters

    # -- state ---------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def max_model_len(self) -> int:
        return self.capacity.max_model_len

    @property
    def dimensions(self) -> int:
        return self.encoder.dimensions

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams | SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_adapter: Any | None = None,
        group: str | None = None,
    ) -> None:
        """Queue a prompt to embed; ``InvalidParameterError`` for a generation request, an adapter, an empty
        or too long prompt, or a token id outside the vocabulary."""
        if not isinstance(params, PoolingParams):
            raise InvalidParameterError(
                "model", f"{self.served_model_name} is an embedding model: it serves /v1/embeddings, /v1/rerank "
                "and /v1/score, not text generation",
            )  # fmt: skip
        if lora_name is not None or lora_adapter is not None:
            raise InvalidParameterError("model", "LoRA adapters are not served for encoders")
        if request_id in self._requests:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        if priority and self.scheduler.policy != "priority":
            raise InvalidParameterError(
                "priority",
                f"'priority' is only taken with --scheduling-policy priority (this server: {self.scheduler.policy})",
            )
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidParameterError("input", "the input is empty: nothing to embed")
        if n > self.max_model_len:
            raise InvalidParameterError(
                "input", f"the input has {n} tokens, more than this model's limit of {self.max_model_len} "
                "(shorten it, or send truncate_prompt_tokens)",
            )  # fmt: skip
        vocab = self.encoder.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParameterError("input", f"token ids must lie in [0, {vocab})")
        req = Request(
            next(self._seq_ids), request_id, prompt_token_ids, SamplingParams(max_tokens=1), max_tokens=0,
            arrival_time=arrival_time, priority=priority, group=group,
        )  # fmt: skip
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None or req.is_finished:
            return
        self._finish(req, RequestStatus.FINISHED_ABORTED, time.monotonic())
        self._pending.append(RequestOutput(request_id, req.prompt_token_ids, finished=True))

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule whole prompts under the budget, embed them in one forward, finish them."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        for req in sched.errored:  # (none while every admissible prompt fits a step; kept for the contract)
            self.observer.on_request_finished(req.stats())
            outputs.append(self._output(req, None))
        ttfts: list[float] = []
        if sched.items:
            reqs: list[Request] = [item.seq for item in sched.items]  # type: ignore[misc]
            try:
                vectors: torch.Tensor | None = self.runner.embed([r.prompt_token_ids for r in reqs])
            except Exception as e:  # the batch fails, not the engine: its blocks are freed below
                log.error("an encoder step of %d sequences failed", len(reqs), exc_info=e)
                vectors = None
                for r in reqs:
                    r.error = f"internal error while embedding: {type(e).__name__}: {e}"
            now = time.monotonic()
            for i, req in enumerate(reqs):
                req.num_computed_tokens = req.num_prompt_tokens
                req.first_token_time = req.last_token_time = now
                ttfts.append(now - req.arrival_time)
                status = RequestStatus.FINISHED_STOPPED if vectors is not None else RequestStatus.FINISHED_ERROR
                self._finish(req, status, now)
                outputs.append(self._output(req, None if vectors is None else vectors[i].tolist()))
        if sched.items or outputs:
            tokens = sched.num_prompt_tokens
            cost = (self._flops_per_token * tokens, float(self.runner.weight_bytes if tokens else 0))
            stats = self.scheduler.step_stats(sched, time.perf_counter() - t0, 0, ttfts, [], cost, 0, None)
            self.observer.on_step(stats)
        return outputs

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        self.scheduler.finish(req, status, now)
        self.observer.on_request_finished(req.stats())

    def _output(self, req: Request, vector: list[float] | None) -> RequestOutput:
        self._requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt_token_ids, finished=True, error=req.error, embedding=vector)

    # -- offline -------------------------------------------------------------------------------------
    def embed(self, prompts: list[str] | list[list[int]]) -> torch.Tensor:
        """Embed texts or token id lists to completion through the scheduler; ``[len(prompts), dimensions]``."""
        ids = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
        names = [f"embed-{next(self._seq_ids)}" for _ in ids]
        for name, seq in zip(names, ids):
            self.add_request(name, seq, PoolingParams())
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                done[out.request_id] = out
        failed = [done[n].error for n in names if done[n].embedding is None]
        if failed:
            raise RuntimeError(f"embedding failed: {failed[0]}")
        return torch.tensor([done[n].embedding for n in names], dtype=torch.float32)
