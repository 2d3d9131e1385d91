"""The engine loop: schedule -> execute -> update requests -> emit outputs -> observe metrics.

Single-threaded: the server's ``AsyncEngine`` owns one in a thread, offline users call ``generate``.
Every latency metric comes from the requests' ``time.monotonic()`` timestamps.

With ``async_scheduling`` the engine schedules one step ahead: it issues step k's forward, then reads and processes
step k-1's tokens (detokenize, stop checks, outputs) while the device computes, then issues step k's sampling. A
sequence sampled in step k gets a ``PENDING_TOKEN`` so that step k+1 can be scheduled before its value reaches the
host (the runner takes it from step k's device output). A sequence that turns out to stop at step k's token has run
one wasted row in step k+1; one that step k finishes by length gets no pending token, so it is not scheduled again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from servelm.metrics.observer import NullObserver, Observer
from servelm.runtime.batch import PENDING_TOKEN, BatchItem, TokenLogprobs
from servelm.runtime.capacity import Capacity, StepCostModel
from servelm.runtime.lora import LoRAAdapter
from servelm.scheduler import offline
from servelm.scheduler.beam_search import BeamSearch
from servelm.scheduler.choice_text import ChoiceText
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.detokenizer import TextDecoder
from servelm.scheduler.lora_registry import LoRARegistry
from servelm.scheduler.outputs import ChoiceGroup, GenerationResult, RequestOutput
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams, check_request
from servelm.scheduler.startup import RunnerLike, start_up
from servelm.scheduler.step_plan import SampledStep
from servelm.scheduler.stop import accept_token
from servelm.scheduler.structured_output import GrammarCompiler

log = logging.getLogger(__name__)


class Engine:
    """Owns the tokenizer, the scheduler, the block manager and the model runner; ``step`` runs one iteration.

    ``Engine(EngineConfig(model=str(folder), kv_cache_memory=..., max_model_len=...))`` is all a test needs.
    ``runner`` (keyword) replaces the real ``ModelRunner`` with anything that implements ``RunnerLike``.
    """

    def __init__(
        self,
        config: EngineConfig,
        observer: Observer | None = None,
        *,
        runner: RunnerLike | None = None,
        detokenize: bool = True,
    ) -> None:
        """``detokenize`` False: token ids only, no stop strings (the server's API process makes the text)."""
        self.detokenize = detokenize
        self.observer: Observer = observer if observer is not None else NullObserver()
        settled = start_up(config, runner)
        self.config = settled.config
        self.model_dir, self.model_config = settled.model_dir, settled.model_config
        self.device, self.dtype = settled.device, settled.dtype
        self.capacity: Capacity = settled.capacity
        self.served_model_name = settled.served_model_name
        self.tokenizer, self.eos_token_ids = settled.tokenizer, settled.eos_token_ids
        self.runner: RunnerLike = settled.runner
        self.async_scheduling = settled.async_scheduling
        self.enable_lora = settled.enable_lora

        # Shared by every request's detokenizer (by skip_special_tokens): they memoise single tokens.
        self._text_decoders = {skip: TextDecoder(self.tokenizer, skip) for skip in (True, False)}
        # Structured outputs the edge did not compile (offline use); reads the vocabulary on first use.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.block_manager, self.proposer, self.scheduler = settled.block_manager, settled.proposer, settled.scheduler
        self.kv_events = settled.kv_events  # publishes the block manager's events, one batch per step
        self._in_flight: SampledStep | None = None  # async: the step whose tokens the next step reads
        # The bytes a step reads of the weights: the runner's count (quantized weights count their own), else parameters x dtype.
        self._step_cost = StepCostModel(self.model_config, self.dtype, self.runner.weight_bytes)

        self._groups: dict[str, ChoiceGroup] = {}
        self._seq_ids = itertools.count()
        self._generate_ids = itertools.count()
        self._pending_groups: dict[str, ChoiceGroup] = {}  # groups with outputs made outside step()
        # speculative decoding, cumulative: drafts computed, and kept
        self.drafts_verified = self.num_accepted_drafts = 0
        self.beams = BeamSearch(self)

        self.loras = LoRARegistry(self.runner, config, enabled=self.enable_lora, base_name=self.served_model_name)
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
        lora_adapter: LoRAAdapter | None = None,
        group: str | None = None,
    ) -> None:
        """Queue a request (its ``params.n`` choices) with the LoRA adapter ``lora_name`` (``lora_adapter``: its
        weights, read by the caller after a ``LoRANotLoadedError``), sharing prefix-cache blocks only within its
        ``cache_salt``, at ``priority`` (the ``priority`` policy only), in the fair share of ``group`` (default:
        its own); raises ``InvalidParameterError`` when it cannot be served (``LoRANotFoundError``: no such
        adapter; ``LoRALimitError``: no room)."""
        if request_id in self._groups:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        if priority and self.scheduler.policy != "priority":
            msg = f"'priority' is only taken with --scheduling-policy priority (this server: {self.scheduler.policy})"
            raise InvalidParameterError("priority", msg)
        max_tokens = check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        if params.use_beam_search:  # its beams are made as the search goes (scheduler.beam_search)
            return self.beams.add(
                request_id, prompt_token_ids, params, max_tokens, lora_name, arrival_time, cache_salt, priority, group
            )
        so = params.structured_output
        if so is not None and so.compiled is None:
            self.grammar_compiler.compile(so)
        # last: it may load the adapter
        lora_id = self.loras.acquire(lora_name, params.n, lora_adapter) if lora_name is not None else 0
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
                group=group,
            )
            if self.detokenize:
                req.text = ChoiceText(self._text_decoders[params.skip_special_tokens], params)
            choices.append(req)
        self._groups[request_id] = ChoiceGroup(request_id, list(prompt_token_ids), choices)
        for req in choices:
            self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Finish every unfinished choice of ``request_id`` with "abort" and free its blocks now."""
        group = self._groups.get(request_id)
        if group is not None:
            self._end(group, group.choices, RequestStatus.FINISHED_ABORTED)

    def stop_choice(self, request_id: str, index: int, stop: str) -> None:
        """Finish choice ``index`` of ``request_id`` as stopped by the stop string ``stop`` (the server
        found it in the text it makes from this engine's token ids) and free its blocks now."""
        group = self._groups.get(request_id)
        if group is not None and 0 <= index < len(group.choices):
            self._end(group, group.choices[index : index + 1], RequestStatus.FINISHED_STOPPED, stop)

    def _end(self, group: ChoiceGroup, choices: list[Request], status: RequestStatus, stop: str | None = None) -> None:
        now = time.monotonic()
        for req in choices:
            if not req.is_finished:
                if stop is not None:
                    req.stop_reason = stop
                self._finish(req, status, now)
                group.report(req, "")
        self._pending_groups[group.request_id] = group

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns the news of every request that changed (grouped by request id).

        Synchronous: this step's tokens. Scheduling ahead: the previous step's, read while this
        step's forward runs."""
        t0 = time.perf_counter()
        # Drafts follow the tokens sampled last step: not while they are still in flight.
        self.scheduler.proposer = None if self.async_scheduling else self.proposer
        accepted_before = self.num_accepted_drafts
        sched = self.scheduler.schedule()
        if sched.num_draft_tokens:  # a draft model computes its drafts now that the step is planned
            sched.num_draft_tokens -= self.scheduler.proposer.fill(sched.items)  # type: ignore[union-attr]
        self.drafts_verified += sched.num_draft_tokens
        cost = self._step_cost(sched.items)  # before the counts below move on
        if copies := self.block_manager.take_copies():  # beams' shared blocks, copied before the forward writes them
            self.runner.kv_pool.copy_blocks(copies)  # type: ignore[union-attr]
        if released := self.block_manager.take_released():  # before the forward, which may write them again
            self.runner.kv_pool.release(released, self.model_config.window_layers)  # type: ignore[union-attr]
        launched = self.runner.launch(sched.items) if sched.items else None

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
        if self.kv_events is not None:
            self.kv_events.publish(self.block_manager.take_events())
        if sched.items or changed:
            accepted = self.num_accepted_drafts - accepted_before
            loras = self.loras.request_names(*self.scheduler.lora_ids()) if self.enable_lora else None
            stats = self.scheduler.step_stats(
                sched, time.perf_counter() - t0, num_sampled, ttfts, itls, cost, accepted, loras
            )
            self.observer.on_step(stats)
        return outputs

    def _sample(self, items: list[BatchItem], launched: Any, changed: dict[str, ChoiceGroup]) -> SampledStep:
        """Issue a launched step's sampling and move its sequences on: their new tokens are computed
        (and full blocks cached); scheduling ahead, each sampled one that goes on gets a pending token."""
        output = self.runner.sample(launched)
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
            if ahead and item.sample and req.beam is None and not self._ends_by_length(req):
                req.token_ids.append(PENDING_TOKEN)
        return SampledStep(items, output)

    def _ends_by_length(self, req: Request) -> bool:
        """Whether the token being sampled for ``req`` is its last (max_tokens or the context length)."""
        return req.num_output_tokens + 1 >= req.max_tokens or len(req.token_ids) + 1 >= self.max_model_len

    def _process(
        self, done: SampledStep, changed: dict[str, ChoiceGroup], ttfts: list[float], itls: list[float]
    ) -> int:
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
                if req.beam is not None:  # a beam's candidates: its group extends every beam at once
                    self.beams.collect(req, lps, changed)
                    continue
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
        if req.beam is not None and self.beams.on_finished(req):  # a search is one finished request: its first beam
            return
        if req.lora_id:
            self.loras.release(req.lora_id)
        self.observer.on_request_finished(req.stats())

    # -- outputs -------------------------------------------------------------------------------------
    def _request_output(self, group: ChoiceGroup) -> RequestOutput:
        out = group.take_output()
        if out.finished:
            self._groups.pop(group.request_id, None)
        return out

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        lora_names: str | Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts (texts or token ids) to completion, each with its LoRA adapter (one name for all,
        or one per prompt; None: the base model); results in prompt order (``scheduler.offline``)."""
        return offline.generate(self, prompts, params, lora_names)

    def new_offline_id(self) -> str:
        """A request id of this engine's own, for a ``generate`` prompt."""
        return f"generate-{next(self._generate_ids)}"

    def choice_group(self, request_id: str) -> ChoiceGroup:
        """The choices of a request not yet reported finished."""
        return self._groups[request_id]

    def forget(self, request_id: str) -> None:
        """Drop a finished request and any news of it not yet reported (its caller reads the choices)."""
        self._pending_groups.pop(request_id, None)
        self._groups.pop(request_id, None)
