"""Iteration-level scheduling: which sequences compute how many tokens in the next model step.

One primitive: every request has ``num_computed_tokens`` catching up with ``len(token_ids)``.
A prefill, a prefill chunk, a decode step, a recompute after preemption and a prefix-cache hit are
all "compute the next k tokens of this request" under the step's token budget.
"""

from __future__ import annotations

import time
from collections import deque

from servelm.metrics.observer import StepStats
from servelm.runtime.batch import PENDING_TOKEN, BatchItem
from servelm.scheduler.block_manager import BlockManager, PrefixMatch
from servelm.scheduler.fair_share import DEFAULT_MAX_REQUEST_SHARE, FairShare, GroupUsage
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.speculative import Proposer
from servelm.scheduler.step_plan import POLICIES, SchedulerOutput, insert_by_priority


class Scheduler:
    """Continuous batching (``fcfs``, ``priority``) or run-to-completion batches (``static``) over a
    ``BlockManager``.

    Each step: RUNNING requests first (a decode is 1 token, an unfinished prefill continues with a
    chunk), then WAITING requests in arrival order, chunking prompts to the remaining token budget.
    When a running request cannot get a block, the most recently admitted running request is
    preempted by recompute (its blocks are freed and it goes back to the front of the queue).
    ``priority``: the same with both queues in ``priority_key`` order: waiting requests are admitted
    by priority (a preempted one goes back to its place), running ones are served by priority and the
    last, preempted first, is the one of the lowest priority (then the latest arrival).

    ``max_loras``: most distinct LoRA adapters among running requests (None: no limit). A waiting
    request of another adapter keeps its place in the queue until one finishes; requests behind it
    (the base model's, or a running adapter's) are admitted meanwhile.

    ``max_request_share``: while other requests wait, one client request's sequences (``Request.group``)
    hold at most this share of the slots and KV blocks (``FairShare``; 1 turns it off; not with ``static``).

    ``whole_prompts`` (encoders): a prompt is admitted only when all of it fits the step, never chunked.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        proposer: Proposer | None = None,
        max_loras: int | None = None,
        max_request_share: float = DEFAULT_MAX_REQUEST_SHARE,
        whole_prompts: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r} ({', '.join(POLICIES)})")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.proposer = proposer  # speculative decoding: drafts for eligible decodes
        self.max_loras = max_loras
        self.whole_prompts = whole_prompts
        self.fair = FairShare(max_request_share, max_num_seqs, block_manager.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        # static policy: the admitted batch's members that are not running yet.
        self._batch: deque[Request] = deque()
        self.num_preemptions_total = 0

    # -- queues --------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._batch)

    def lora_ids(self) -> tuple[set[int], set[int]]:
        """The LoRA adapters of running and of waiting requests (0, the base model, left out)."""
        running = {r.lora_id for r in self.running if r.lora_id}
        waiting = {r.lora_id for q in (self.waiting, self._batch) for r in q if r.lora_id}
        return running, waiting

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._batch)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        if self.policy == "priority":
            insert_by_priority(self.waiting, req)
        else:
            self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        """Take ``req`` out of every queue, free its blocks, and mark it finished (idempotent)."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            for q in (self.waiting, self._batch):
                try:
                    q.remove(req)
                    break
                except ValueError:
                    pass
        self.bm.free(req)
        req.drafting = None
        req.drop_pending_token()
        req.grammar = None  # a finished row the engine scheduled ahead samples unconstrained (and is dropped)
        req.status = status
        req.finished_time = time.monotonic() if now is None else now

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 0. Blocks the running requests' sliding windows have left (the engine hands them back).
        if self.bm.windows is not None:
            for req in self.running:
                self.bm.release_passed(req)

        # 0b. A waiting request that does not fit takes the place of sequences over their request's share.
        fair = self.fair.enabled and self.policy != "static"
        if fair and self.waiting:
            self._reclaim(out)

        # 1. Running requests, in admission order (groups over their share last: the first to give way).
        speculate = self.proposer is not None and len(self.running) <= self.proposer.config.max_running
        order = self.fair.order(self.running) if fair else list(self.running)
        short = False  # a running request had to preempt: memory is short
        i = 0
        while i < len(order) and budget > 0:
            req = order[i]
            num_new = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute: its last token is being sampled (engine scheduling ahead)
                i += 1
                continue
            draft: list[int] = []
            if speculate and num_new == 1 and req.token_ids[-1] != PENDING_TOKEN:
                # No more drafts than tokens it may still produce (the step adds one of its own).
                limit = min(budget - 1, req.max_tokens - req.num_output_tokens - 1)
                draft = self.proposer.propose(req, limit)  # type: ignore[union-attr]
                if draft and not self.bm.allocate_slots(req, 1 + len(draft)):
                    draft = []  # no room for the drafts: a plain decode (which may preempt)
            if req.token_ids[-1] == PENDING_TOKEN and not self.bm.allocate_slots(req, num_new):
                # Its input is a token not read yet, and the request may stop on it: such a row never
                # preempts anyone. It waits one step, until the token is known.
                i += 1
                continue
            while not self.bm.allocate_slots(req, num_new):
                victim = order.pop()
                short = True
                if victim is req and i == 0:
                    # Alone (everyone else was preempted or there is no one): it can never fit.
                    self._fail_too_large(req, out)
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._schedule(req, num_new, out, draft)
                budget -= num_new + len(draft)
                i += 1
                continue
            # ``req`` left ``order`` (preempted or failed): the next one slid into index i.

        # 2. Admit waiting requests (not in a step that had to preempt: memory is short).
        if not short:
            if self.policy == "static":
                if not self.running and not self._batch:
                    while self.waiting and len(self._batch) < self.max_num_seqs:
                        self._batch.append(self.waiting.popleft())
                queue = self._batch
            else:
                queue = self.waiting
            budget = self._admit(queue, budget, out)
        return out

    def _admit(self, queue: deque[Request], budget: int, out: SchedulerOutput) -> int:
        # n>1 siblings waiting for choice 0's prompt, and requests of an adapter over max_loras: they keep their places
        held: list[Request] = []
        loras = {r.lora_id for r in self.running if r.lora_id} if self.max_loras is not None else None
        # Fair share: a request at its share waits while another request waits behind it.
        usage: dict[str, GroupUsage] | None = None
        if self.fair.enabled and self.policy != "static" and len(queue) > 1 and len({r.group for r in queue}) > 1:
            usage = self.fair.usage(self.running)
        while queue and budget > 0 and len(self.running) < self.max_num_seqs:
            req = queue.popleft()
            if loras is not None and req.lora_id and req.lora_id not in loras and len(loras) >= self.max_loras:  # type: ignore[operator]
                held.append(req)
                continue
            if usage is not None and self.fair.full(usage.get(req.group)):
                held.append(req)
                continue
            parent = req.parent
            fork_from: Request | None = None
            if parent is not None and not parent.is_finished:
                if parent.status != RequestStatus.RUNNING or parent.num_computed_tokens < parent.num_prompt_tokens - 1:
                    held.append(req)
                    continue
                fork_from = parent

            if self._never_fits(req):
                self._fail_too_large(req, out)
                continue

            prefix: PrefixMatch | None = None
            if req.num_computed_tokens == 0:
                if fork_from is not None:
                    # Share choice 0's full prompt blocks (all but the last prompt token): no copies.
                    req.block_table = self.bm.fork(fork_from.block_table, req.num_prompt_tokens - 1)
                    req.num_computed_tokens = len(req.block_table) * self.bm.block_size
                elif req.num_prompt_scored >= req.num_prompt_tokens - 1:
                    # (A prompt still to score must compute every position: its cached blocks are not adopted.)
                    prefix = self.bm.lookup(req)
            num_cached = prefix.num_cached_tokens if prefix is not None else 0
            num_new = min(len(req.token_ids) - req.num_computed_tokens - num_cached, budget)
            if (self.whole_prompts and num_new < len(req.token_ids) - num_cached) or not self.bm.allocate_slots(
                req, num_new, prefix
            ):
                if fork_from is not None:
                    self.bm.free(req)
                    req.num_computed_tokens = 0
                queue.appendleft(req)
                break
            if prefix is not None:
                out.prefix_cache_queries += prefix.num_query_tokens
                out.prefix_cache_hits += prefix.num_cached_tokens
            req.status = RequestStatus.RUNNING
            if loras is not None and req.lora_id:
                loras.add(req.lora_id)
            if usage is not None:
                usage.setdefault(req.group, GroupUsage()).add(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = num_cached
            if self.policy == "priority":
                insert_by_priority(self.running, req)
            else:
                self.running.append(req)
            self._schedule(req, num_new, out)
            budget -= num_new
        for r in reversed(held):
            queue.appendleft(r)
        return budget

    def _reclaim(self, out: SchedulerOutput) -> None:
        """Preempt sequences of groups over their share until the first waiting request of a group
        under its share fits (a free slot, and free blocks for its next chunk), or none is over."""
        if not self.fair.anyone_shares(self.running):
            return
        usage = self.fair.usage(self.running)
        if not any(self.fair.over(u) for u in usage.values()):
            return
        waiter = next((r for r in self.waiting if not self.fair.full(usage.get(r.group))), None)
        if waiter is None:
            return
        chunk = min(len(waiter.token_ids) - waiter.num_computed_tokens, self.max_num_batched_tokens)
        need = self.bm.blocks_needed(waiter.num_computed_tokens + chunk) - len(waiter.block_table)
        while len(self.running) >= self.max_num_seqs or self.bm.num_free_blocks < need:
            victim = self.fair.victim(usage, spare=waiter.group)
            if victim is None:
                return
            self._preempt(victim, out)
            usage = self.fair.usage(self.running)

    def _schedule(self, req: Request, num_new: int, out: SchedulerOutput, draft: list[int] | None = None) -> None:
        start = req.num_computed_tokens
        sample = start + num_new == len(req.token_ids)
        if draft:
            out.items.append(BatchItem(req, num_new + len(draft), sample, draft=draft))
            out.num_decode_tokens += num_new + len(draft)
            out.num_draft_tokens += len(draft)
            return
        score = None
        if req.prompt_logprobs is not None:
            lo, hi = max(start, req.num_prompt_scored), min(start + num_new, req.num_prompt_tokens - 1)
            if lo < hi:
                score = (lo, hi)
        out.items.append(BatchItem(req, num_new, sample, score))
        if req.is_decoding:
            out.num_decode_tokens += num_new
        else:
            out.num_prompt_tokens += num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the KV, start over later from the front of the queue."""
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED  # waiting again, at the front; RUNNING once re-admitted
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        # Victims go latest-admitted first, so pushing each to the front keeps admission order.
        if self.policy == "priority":
            self._enqueue(req)
        else:
            (self._batch if self.policy == "static" else self.waiting).appendleft(req)
        out.preempted.append(req)

    def step_stats(
        self,
        out: SchedulerOutput,
        duration: float,
        num_sampled: int,
        ttfts: list[float],
        itls: list[float],
        cost: tuple[float, float],
        num_accepted_drafts: int,
        lora_adapters: tuple[list[str], list[str]] | None,
    ) -> StepStats:
        """The metrics of the step that scheduled ``out``, with what the engine measured of it."""
        flops, moved = cost
        num_drafts, per_pos = self.proposer.counts.take() if self.proposer is not None else (0, [])
        return StepStats(
            duration_s=duration,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.bm.usage,
            num_prompt_tokens=out.num_prompt_tokens,
            num_generation_tokens=num_sampled,
            num_preemptions=out.num_preemptions,
            prefix_cache_queries=out.prefix_cache_queries,
            prefix_cache_hits=out.prefix_cache_hits,
            flops=flops,
            bytes_moved=moved,
            time_to_first_tokens=ttfts,
            inter_token_latencies=itls,
            num_draft_tokens=out.num_draft_tokens,
            num_accepted_draft_tokens=num_accepted_drafts,
            num_drafts=num_drafts,
            accepted_per_pos=per_pos,
            lora_adapters=lora_adapters,
        )

    def _never_fits(self, req: Request) -> bool:
        longest = req.num_prompt_tokens + req.max_tokens
        return self.bm.blocks_needed(longest) > self.bm.num_blocks

    def _fail_too_large(self, req: Request, out: SchedulerOutput) -> None:
        longest = req.num_prompt_tokens + req.max_tokens
        req.error = (
            f"request needs up to {longest} tokens of KV cache ({req.num_prompt_tokens} prompt + "
            f"{req.max_tokens} max_tokens) but the whole pool holds {self.bm.num_blocks * self.bm.block_size} "
            f"tokens; lower max_tokens or give the KV cache more memory"
        )
        self.finish(req, RequestStatus.FINISHED_ERROR)
        out.errored.append(req)
