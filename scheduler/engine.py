"""The engine loop: schedule -> execute -> update requests -> emit outputs -> observe metrics.

Single-threaded: the server's ``AsyncEngine`` owns one in a thread, offline users call ``generate``.
Every latency metric comes from the requests' ``time.monotonic()`` timestamps.

With ``async_scheduling`` the engine schedules one step ahead: it issues step k's forward, then reads
and processes step k-1's tokens (detokenize, stop checks, outputs) while the device computes, then
issues step k's sampling. A sequence sampled in step k gets a ``PENDING_TOKEN`` so that step k+1 can
be scheduled before its value reaches the host (the runner takes it from step k's device output).
A sequence that turns out to stop at step k's token has run one wasted row in step k+1; one that
step k finishes by length gets no pending token, so it is not scheduled again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from servelm.metrics.observer import NullObserver, Observer, RequestStats, StepStats
from servelm.runtime.batch import PENDING_TOKEN, BatchItem, RunnerOutput, TokenLogprobs
from servelm.runtime.capacity import Capacity, StepCostModel, plan_capacity
from servelm.runtime.config import ModelConfig
from servelm.runtime.lora import LoRAAdapter
from servelm.runtime.model_files import resolve_model_path
from servelm.runtime.platform import device_defaults, resolve_device
from servelm.runtime.runner import ModelRunner
from servelm.runtime.tokenizer import load_tokenizer
from servelm.scheduler.block_manager import BlockManager
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.detokenizer import IncrementalDetokenizer, TextDecoder
from servelm.scheduler.outputs import ChoiceGroup, GeneratedChoice, GenerationResult, RequestOutput
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.lora_registry import LoRARegistry
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams, check_request
from servelm.scheduler.scheduler import Scheduler, SchedulerOutput
from servelm.scheduler.speculative import NgramProposer, SpeculativeConfig
from servelm.scheduler.startup import DTYPE_NAMES, eos_ids, new_runner, resolve_dtype, resolve_max_model_len
from servelm.scheduler.stop import StopChecker, accept_token
from servelm.scheduler.structured_output import GrammarCompiler

log = logging.getLogger(__name__)

class RunnerLike(Protocol):
    """What the engine needs of ``runtime.runner.ModelRunner`` (tests pass fakes).

    A runner may also split ``execute`` into ``launch(items)`` and ``sample(launched)``, whose
    ``result()`` gives the ``RunnerOutput`` and whose ``errors`` are the items whose sampling raised
    (``ModelRunner`` does); ``_Executed`` adapts one that does not.
    """

    def execute(self, items: list[BatchItem]) -> RunnerOutput: ...


class _Done:
    def __init__(self, output: RunnerOutput) -> None:
        self._output = output
        self.errors = output.errors or {}

    def result(self) -> RunnerOutput:
        return self._output


class _Executed:
    """``launch`` / ``sample`` over a runner that only has ``execute`` (all the work is in ``sample``)."""

    def __init__(self, runner: RunnerLike) -> None:
        self._runner = runner

    def launch(self, items: list[BatchItem]) -> list[BatchItem]:
        return items

    def sample(self, items: list[BatchItem]) -> _Done:
        return _Done(self._runner.execute(items))


@dataclass
class _Sampled:
    """A step whose sampling was issued: its items and its ``StepOutput`` (tokens not read yet)."""

    items: list[BatchItem]
    output: Any  # has result() -> RunnerOutput


class Engine:
    """Owns the tokenizer, the scheduler, the block manager and the model runner; ``step`` runs one iteration.

    ``Engine(EngineConfig(model=str(folder), kv_cache_memory=..., max_model_len=...))`` is all a test
    needs. ``runner`` (keyword) replaces the real ``ModelRunner`` with anything that has ``execute``.
    """

    def __init__(
        self,
        config: EngineConfig,
        observer: Observer | None = None,
        *,
        runner: RunnerLike | None = None,
    ) -> None:
        self.observer: Observer = observer if observer is not None else NullObserver()
        model_dir = resolve_model_path(config.model)
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        mc = self.model_config

        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        self.device, self.dtype = device, dtype
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

        defaults = device_defaults(device, dtype, mc.head_dim)
        max_model_len = resolve_max_model_len(mc, config.max_model_len, sliding_window_supported=defaults.sliding_window)
        max_batched = config.max_num_batched_tokens or defaults.max_num_batched_tokens
        block_size = config.block_size if config.block_size is not None else defaults.block_size

        kv_memory = config.kv_cache_memory
        unpooled: ModelRunner | None = None  # weights loaded first, the pool sized from what is left
        if defaults.sizes_kv_from_memory and runner is None:
            # Weights first, then the largest step the scheduler can build, once, on a scratch pool:
            # it measures the activation peak when the pool is sized from GPU memory, and it compiles
            # the step's Triton kernels at start-up rather than in the first request.
            unpooled = new_runner(model_dir, mc, device, dtype, block_size, None, max_batched, max_model_len, config)
            if kv_memory is None:
                kv_memory = unpooled.measure_kv_budget(
                    config.gpu_memory_utilization, 0 if config.enforce_eager else defaults.graph_reserve_bytes
                )
            else:
                unpooled.warm_up()
                torch.cuda.empty_cache()
        if kv_memory is None:
            kv_memory = defaults.kv_cache_memory
        if kv_memory is None:  # an injected runner, where the pool is sized from memory
            kv_memory = getattr(getattr(runner, "kv_pool", None), "nbytes", None)
            if kv_memory is None:
                raise ValueError(f"an injected runner on {device} needs kv_cache_memory or a kv_pool")
        self.capacity: Capacity = plan_capacity(mc, dtype, kv_memory, block_size, max_model_len)
        log.info("KV capacity: %s", self.capacity.describe())

        self.config = dataclasses.replace(
            config,
            device=str(device),
            dtype=DTYPE_NAMES.get(dtype, str(dtype)),
            block_size=block_size,
            kv_cache_memory=kv_memory,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_batched,
        )
        gguf = Path(config.model).suffix == ".gguf" if config.model else False
        self.served_model_name = config.served_model_name or (
            Path(config.model).stem if gguf else model_dir.name  # type: ignore[arg-type]
        )

        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.eos_token_ids = eos_ids(model_dir, mc, self.tokenizer)
        # Shared by every request's detokenizer (by skip_special_tokens): they memoise single tokens.
        self._text_decoders = {skip: TextDecoder(self.tokenizer, skip) for skip in (True, False)}
        # Structured outputs the edge did not compile (offline use); reads the vocabulary on first use.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)

        num_blocks = self.capacity.num_blocks
        if runner is not None:
            # A runner built elsewhere (tests, device checks) must match the blocks handed out here.
            pool = getattr(runner, "kv_pool", None)
            runner_bs = getattr(runner, "block_size", block_size)
            if runner_bs != block_size:
                raise ValueError(f"the runner's KV pool uses block_size {runner_bs}, the engine {block_size}")
            if pool is not None and pool.num_blocks < num_blocks:
                raise ValueError(
                    f"the runner's KV pool has {pool.num_blocks} blocks, the KV budget asks for {num_blocks}"
                )
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.proposer: NgramProposer | None = None
        if config.speculative_config:
            self.proposer = NgramProposer(SpeculativeConfig.parse(config.speculative_config))
            log.info("speculative decoding: %s", self.proposer.config)
        self.enable_lora = config.enable_lora or bool(config.lora_modules)
        if self.enable_lora and (config.max_loras < 1 or config.max_lora_rank < 1):
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_batched,
            policy=config.scheduling_policy,
            proposer=self.proposer,
            max_loras=config.max_loras if self.enable_lora else None,
        )
        if unpooled is not None:
            unpooled.allocate_kv_pool(num_blocks)
            runner = unpooled
        elif runner is None:
            runner = new_runner(
                model_dir, mc, device, dtype, block_size, num_blocks, max_batched, max_model_len, config
            )
        self.runner = runner
        self._steps = runner if hasattr(runner, "launch") else _Executed(runner)
        # Default: on where the forward runs in the background (CUDA), off elsewhere.
        ahead = config.async_scheduling
        self.async_scheduling = defaults.async_scheduling if ahead is None else ahead
        if self.async_scheduling and self.proposer is not None:
            log.warning("speculative decoding needs each step's tokens before the next is scheduled: off while scheduling ahead")
        if self.async_scheduling and not defaults.async_scheduling:
            log.warning(
                "--async-scheduling on %s: the forward does not run in the background here, so every token "
                "reaches its client one step later and nothing is overlapped",
                device,
            )
        self._in_flight: _Sampled | None = None  # async: the step whose tokens the next step reads

        # The bytes a step reads of the weights: the runner's count (quantized weights count their own
        # bytes), else parameters x dtype.
        self._step_cost = StepCostModel(mc, dtype, getattr(runner, "weight_bytes", None))

        self._groups: dict[str, ChoiceGroup] = {}
        self._seq_ids = itertools.count()
        self._generate_ids = itertools.count()
        self._pending_groups: dict[str, ChoiceGroup] = {}  # groups with outputs made outside step()
        self.drafts_verified = 0  # speculative decoding, cumulative: drafts computed ...
        self.num_accepted_drafts = 0  # ... and kept

        self.loras = LoRARegistry(runner, enabled=self.enable_lora, max_rank=config.max_lora_rank, base_name=self.served_model_name)
        for name, path in config.lora_modules:
            self.loras.add(name, path)

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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_groups) or self._in_flight is not None

    # -- LoRA adapters (scheduler.lora_registry) --------------------------------------------------------
    @property
    def lora_adapters(self) -> dict[str, str]:
        """Served adapters: name -> path."""
        return self.loras.adapters

    def read_lora_adapter(self, path: str) -> LoRAAdapter:
        """Read and check an adapter folder (``LoRAError`` if it cannot be served); may run outside the
        engine thread."""
        return self.loras.read(path)

    def add_lora(self, name: str, adapter: str | LoRAAdapter) -> int:
        """Serve an adapter (a folder, or one ``read_lora_adapter`` returned) to requests naming it."""
        return self.loras.add(name, adapter)

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter; requests already queued with it finish with it."""
        self.loras.remove(name)

    def lora_request_names(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests (metrics)."""
        running, waiting = self.scheduler.lora_ids()
        return self.loras.names(running), self.loras.names(waiting)

    # -- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request (its ``params.n`` choices), computed with the LoRA adapter ``lora_name`` if
        given, sharing prefix-cache blocks only with requests of the same ``cache_salt`` if given, at
        ``priority`` (lower first; the ``priority`` scheduling policy only); raises
        ``InvalidParameterError`` when it cannot be served (``LoRANotFoundError`` for an adapter that
        is not served)."""
        if request_id in self._groups:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        if priority and self.scheduler.policy != "priority":
            raise InvalidParameterError(
                "priority", f"'priority' is only taken with --scheduling-policy priority (this server: {self.scheduler.policy})"
            )
        lora_id = self.loras.id_of(lora_name) if lora_name is not None else 0
        max_tokens = check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        so = params.structured_output
        if so is not None and so.compiled is None:
            self.grammar_compiler.compile(so)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        choices: list[Request] = []
        for i in range(params.n):
            req = Request(
                next(self._seq_ids),
                request_id,
                prompt_token_ids,
                params,
                index=i,
                max_tokens=max_tokens,
                arrival_time=arrival,
                eos_token_ids=self.eos_token_ids,
                device=self.device,
                parent=choices[0] if choices else None,
                lora_id=lora_id,
                cache_salt=cache_salt,
                priority=priority,
            )
            skip = params.skip_special_tokens
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip, decoder=self._text_decoders[skip])
            req.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
            choices.append(req)
        self._groups[request_id] = ChoiceGroup(request_id, list(prompt_token_ids), choices)
        if lora_name is not None:
            self.loras.acquire(lora_name, len(choices))
        for req in choices:
            self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Finish every unfinished choice of ``request_id`` with "abort" and free its blocks now."""
        group = self._groups.get(request_id)
        if group is None:
            return
        now = time.monotonic()
        for req in group.choices:
            if not req.is_finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED, now)
                group.report(req, "")
        self._pending_groups[request_id] = group

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns the news of every request that changed (grouped by request id).

        Synchronous: this step's tokens. Scheduling ahead: the previous step's, read while this
        step's forward runs.
        """
        t0 = time.perf_counter()
        # Drafts follow the tokens sampled last step: not while they are still in flight.
        self.scheduler.proposer = None if self.async_scheduling else self.proposer
        accepted_before = self.num_accepted_drafts
        sched = self.scheduler.schedule()
        self.drafts_verified += sched.num_draft_tokens
        cost = self._step_cost(sched.items)  # before the counts below move on
        launched = self._steps.launch(sched.items) if sched.items else None

        changed: dict[str, ChoiceGroup] = self._pending_groups
        self._pending_groups = {}
        for req in sched.errored:
            self._on_finished(req)
            group = self._groups[req.request_id]
            group.num_finished += 1
            group.report(req, "")
            changed[req.request_id] = group
        ttfts: list[float] = []
        itls: list[float] = []
        num_sampled = 0
        # The step issued ahead last time, read while this one computes; then this step's sampling,
        # read now or next time. (Either order is right after a switch of ``async_scheduling``.)
        done, self._in_flight = self._in_flight, None
        if done is not None:
            num_sampled += self._process(done, changed, ttfts, itls)
        if launched is not None:
            sampled = self._sample(sched.items, launched, changed)
            if self.async_scheduling:
                self._in_flight = sampled
            else:
                num_sampled += self._process(sampled, changed, ttfts, itls)

        outputs = [self._request_output(g) for g in changed.values()]
        if sched.items or changed:
            accepted = self.num_accepted_drafts - accepted_before
            self._observe_step(sched, time.perf_counter() - t0, num_sampled, ttfts, itls, cost, accepted)
        return outputs

    def _sample(self, items: list[BatchItem], launched: Any, changed: dict[str, ChoiceGroup]) -> _Sampled:
        """Issue a launched step's sampling and move its sequences on: their new tokens are computed
        (and full blocks cached); scheduling ahead, each sampled one that goes on gets a pending token."""
        output = self._steps.sample(launched)
        for i, e in output.errors.items():  # its row raised in the sampler: that request fails, not the step
            if not items[i].seq.is_finished:  # type: ignore[attr-defined]
                self._fail(items[i].seq, e, changed)  # type: ignore[arg-type]
        ahead = self.async_scheduling
        for item in items:
            req: Request = item.seq  # type: ignore[assignment]
            if req.is_finished:  # stopped by its previous token, or aborted, while this step ran
                continue
            try:
                # A draft's K/V counts only once the draft is kept (``_accept_drafts``).
                req.num_computed_tokens += item.num_new_tokens - len(item.draft or ())
                self.block_manager.cache_full_blocks(req)
            except Exception as e:  # one bad request must not take the batch down
                self._fail(req, e, changed)
                continue
            if ahead and item.sample and not self._ends_by_length(req):
                req.token_ids.append(PENDING_TOKEN)
        return _Sampled(items, output)

    def _ends_by_length(self, req: Request) -> bool:
        """Whether the token being sampled for ``req`` is its last (max_tokens or the context length)."""
        return req.num_output_tokens + 1 >= req.max_tokens or len(req.token_ids) + 1 >= self.max_model_len

    def _process(self, done: _Sampled, changed: dict[str, ChoiceGroup], ttfts: list[float], itls: list[float]) -> int:
        """Read a step's tokens and hand each to its request; returns how many were read."""
        result = done.output.result()
        now = time.monotonic()
        num_sampled = 0
        scored = result.prompt_logprobs or itertools.repeat(None)
        drafts = result.draft_samples or itertools.repeat(None)
        for item, token, lps, prompt_lps, draft_samples in zip(
            done.items, result.sampled_token_ids, result.logprobs, scored, drafts
        ):
            req: Request = item.seq  # type: ignore[assignment]
            if prompt_lps is not None and not req.is_finished:
                try:
                    req.add_prompt_logprobs(prompt_lps)
                except Exception as e:  # one bad request must not take the batch down
                    self._fail(req, e, changed)
                    continue
            if token is None:
                continue
            if req.is_finished:  # a wasted row (see the module docstring), or aborted meanwhile
                continue
            try:
                num_sampled += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                    ttfts.append(now - req.arrival_time)
                else:
                    itls.append(now - req.last_token_time)  # type: ignore[operator]
                req.last_token_time = now
                text = self._process_token(req, token, lps, now)
                if item.draft and draft_samples:
                    kept, more = self._accept_drafts(req, item.draft, draft_samples, now)
                    num_sampled += kept
                    text += more
            except Exception as e:  # one bad request must not take the batch down
                self._fail(req, e, changed)
                continue
            group = self._groups[req.request_id]
            group.report(req, text)
            changed[req.request_id] = group
        return num_sampled

    def _accept_drafts(
        self, req: Request, draft: list[int], samples: list[tuple[int, TokenLogprobs | None]], now: float
    ) -> tuple[int, str]:
        """Keep the drafts that equal the token sampled before them, each followed by the token sampled
        at its position; returns how many tokens that added and their text."""
        kept, texts = 0, []
        for d, (token, lps) in zip(draft, samples):
            if req.is_finished or req.token_ids[-1] != d:
                break
            req.num_computed_tokens += 1  # d's K/V, written this step, is the real token's
            self.num_accepted_drafts += 1
            texts.append(self._process_token(req, token, lps, now))
            kept += 1
        if not req.is_finished:
            self.block_manager.cache_full_blocks(req)
            if self.proposer is not None:
                self.proposer.observe(req, kept, len(draft))
        return kept, "".join(texts)

    def _fail(self, req: Request, e: Exception, changed: dict[str, ChoiceGroup]) -> None:
        """Finish ``req`` with an error raised while the engine handled its step; report it."""
        log.error("request %s choice %d failed while processing its output", req.request_id, req.index, exc_info=e)
        req.error = f"internal error while processing the output: {type(e).__name__}: {e}"
        if not req.is_finished:
            self._finish(req, RequestStatus.FINISHED_ERROR, time.monotonic())
        group = self._groups[req.request_id]
        group.report(req, "")
        changed[req.request_id] = group

    def _process_token(self, req: Request, token: int, lps: TokenLogprobs | None, now: float) -> str:
        """Append a sampled token, detokenize it, check every stop condition; return the text to emit."""
        text, status = accept_token(req, token, lps, self.max_model_len)
        if status is not None:
            self._finish(req, status, now)
        return text

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        self.scheduler.finish(req, status, now)
        self._on_finished(req)
        group = self._groups.get(req.request_id)
        if group is not None:
            group.num_finished += 1

    def _on_finished(self, req: Request) -> None:
        if req.lora_id:
            self.loras.release(req.lora_id)
        self.observer.on_request_finished(
            RequestStats(
                finish_reason=req.finish_reason or "error",
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                last_token_time=req.last_token_time,
                finished_time=req.finished_time if req.finished_time is not None else time.monotonic(),
                num_prompt_tokens=req.num_prompt_tokens,
                num_generation_tokens=req.num_output_tokens,
            )
        )

    # -- outputs -------------------------------------------------------------------------------------
    def _request_output(self, group: ChoiceGroup) -> RequestOutput:
        out = group.take_output()
        if out.finished:
            self._groups.pop(group.request_id, None)
        return out

    # -- metrics -------------------------------------------------------------------------------------
    def _observe_step(
        self,
        sched: SchedulerOutput,
        duration: float,
        num_sampled: int,
        ttfts: list[float],
        itls: list[float],
        cost: tuple[float, float],
        num_accepted_drafts: int = 0,
    ) -> None:
        flops, moved = cost
        self.observer.on_step(
            StepStats(
                duration_s=duration,
                num_running=self.scheduler.num_running,
                num_waiting=self.scheduler.num_waiting,
                kv_cache_usage=self.block_manager.usage,
                num_prompt_tokens=sched.num_prompt_tokens,
                num_generation_tokens=num_sampled,
                num_preemptions=sched.num_preemptions,
                prefix_cache_queries=sched.prefix_cache_queries,
                prefix_cache_hits=sched.prefix_cache_hits,
                flops=flops,
                bytes_moved=moved,
                time_to_first_tokens=ttfts,
                inter_token_latencies=itls,
                num_draft_tokens=sched.num_draft_tokens,
                num_accepted_draft_tokens=num_accepted_drafts,
                lora_adapters=self.lora_request_names() if self.enable_lora else None,
            )
        )

    # -- offline -------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        lora_names: str | Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts (texts or token ids) to completion, each with its LoRA adapter (one name for
        all, or one per prompt; None: the base model); results in prompt order."""
        if isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        if lora_names is None or isinstance(lora_names, str):
            loras: list[str | None] = [lora_names] * len(prompts)
        else:
            loras = list(lora_names)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA names")
        groups: list[ChoiceGroup] = []
        try:
            for prompt, p, lora_name in zip(prompts, plist, loras):
                # Text is tokenized as the tokenizer does by default (BOS where the model expects one).
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"generate-{next(self._generate_ids)}"
                self.add_request(rid, ids, p, lora_name=lora_name)
                groups.append(self._groups[rid])
        except Exception:
            for g in groups:
                self.abort(g.request_id)
            raise
        while any(not g.finished for g in groups):
            self.step()
        for g in groups:  # drop their pending abort/error news: the caller gets the results below
            self._pending_groups.pop(g.request_id, None)
            self._groups.pop(g.request_id, None)
        return [
            GenerationResult(
                g.request_id,
                g.prompt_token_ids,
                [
                    GeneratedChoice(
                        index=r.index,
                        text="".join(r.text_parts),
                        token_ids=r.output_token_ids,
                        finish_reason=r.finish_reason,
                        stop_reason=r.stop_reason,
                        logprobs=r.output_logprobs,
                        error=r.error,
                    )
                    for r in g.choices
                ],
                g.complete_prompt_logprobs(),
            )
            for g in groups
        ]
