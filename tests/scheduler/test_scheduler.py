"""Scheduler behaviour with a fake model: budgets, order, chunking, preemption, static batches, n>1."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from servelm.runtime.batch import PENDING_TOKEN
from servelm.scheduler.block_manager import BlockManager
from servelm.scheduler.request import Request, RequestStatus
from servelm.scheduler.sampling_params import SamplingParams
from servelm.scheduler.scheduler import Scheduler
from servelm.scheduler.step_plan import SchedulerOutput


def fake_token(req: Request) -> int:
    """Deterministic "model": the next token depends on the sequence only (so recompute is exact)."""
    return (sum(req.token_ids) * 31 + len(req.token_ids)) % 1000


class Harness:
    """A scheduler plus the engine's bookkeeping, with a fake model producing ``fake_token``."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        policy: str = "fcfs",
        prefix_caching: bool = True,
        **scheduler_options: Any,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(
            self.bm,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
            **scheduler_options,
        )
        self.ids = itertools.count()
        self.outputs: list[SchedulerOutput] = []
        self.finished: list[Request] = []

    def add(
        self, prompt: list[int], max_tokens: int, request_id: str | None = None, n: int = 1, priority: int = 0
    ) -> list[Request]:
        rid = request_id or f"r{len(self.outputs)}-{next(self.ids)}"
        reqs: list[Request] = []
        for i in range(n):
            r = Request(
                next(self.ids),
                rid,
                prompt,
                SamplingParams(max_tokens=max_tokens, n=n),
                index=i,
                parent=reqs[0] if reqs else None,
                priority=priority,
            )
            reqs.append(r)
            self.sched.add(r)
        return reqs

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.outputs.append(out)
        assert out.num_scheduled_tokens <= self.sched.max_num_batched_tokens
        assert len(out.items) <= self.sched.max_num_seqs
        assert len({it.seq.seq_id for it in out.items}) == len(out.items)
        for it in out.items:
            req = it.seq
            assert isinstance(req, Request) and req.status == RequestStatus.RUNNING
            # Every computed position has a slot.
            assert len(req.block_table) * self.bm.block_size >= req.num_computed_tokens + it.num_new_tokens
            assert it.sample == (req.num_computed_tokens + it.num_new_tokens == len(req.token_ids))
            req.num_computed_tokens += it.num_new_tokens
            self.bm.cache_full_blocks(req)
            if it.sample:
                req.append_token(fake_token(req))
                if req.num_output_tokens >= req.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.finished.append(req)
        self.finished.extend(out.errored)
        self.bm.check_invariants()
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                assert self.bm.num_used_blocks == 0
                return
            self.step()
        raise AssertionError("did not finish (livelock?)")


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    r = Request(0, "ref", prompt, SamplingParams(max_tokens=max_tokens))
    for _ in range(max_tokens):
        r.append_token(fake_token(r))
    return r.output_token_ids


def test_decode_gets_one_token_and_prefill_is_chunked_to_the_budget() -> None:
    h = Harness(max_num_batched_tokens=10)
    (a,) = h.add(list(range(1, 26)), max_tokens=3)  # 25-token prompt
    sizes = []
    while a.num_output_tokens == 0:
        out = h.step()
        sizes.append(out.items[0].num_new_tokens)
        assert out.items[0].sample == (a.num_output_tokens == 1)
    assert sizes == [10, 10, 5]
    out = h.step()
    assert [it.num_new_tokens for it in out.items] == [1] and out.num_decode_tokens == 1
    h.run()
    assert a.output_token_ids == reference_output(list(range(1, 26)), 3)


def test_running_requests_are_served_before_waiting_ones_and_budget_holds() -> None:
    h = Harness(max_num_batched_tokens=12, num_blocks=128)
    first = [h.add([i] * 7, max_tokens=6)[0] for i in range(1, 3)]  # 14 prompt tokens > 12
    out = h.step()
    assert [(it.seq, it.num_new_tokens) for it in out.items] == [(first[0], 7), (first[1], 5)]
    late = h.add([9] * 20, max_tokens=2)[0]
    out = h.step()
    # first[0] decodes (1), first[1] finishes its prompt (2), the newcomer gets the remaining 9.
    assert [(it.seq, it.num_new_tokens) for it in out.items] == [(first[0], 1), (first[1], 2), (late, 9)]
    assert out.num_prompt_tokens == 11 and out.num_decode_tokens == 1
    h.run()
    for r in first:
        assert r.output_token_ids == reference_output([r.token_ids[0]] * 7, 6)


def test_max_num_seqs_caps_the_batch() -> None:
    h = Harness(max_num_seqs=3, max_num_batched_tokens=100)
    reqs = [h.add([i + 1, 2, 3], max_tokens=4)[0] for i in range(5)]
    out = h.step()
    assert [it.seq for it in out.items] == reqs[:3]
    assert h.sched.num_running == 3 and h.sched.num_waiting == 2
    h.run()
    assert all(r.finish_reason == "length" for r in reqs)


def test_waiting_is_fcfs_head_of_line() -> None:
    # The first waiting request does not fit in memory yet: later (smaller) ones must not jump it.
    h = Harness(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    (big_runner,) = h.add([1] * 20, max_tokens=4)  # 5 blocks (+1 while decoding)
    h.step()
    (big,) = h.add([2] * 20, max_tokens=2)  # needs 5 more blocks: only 4 left once big_runner grows
    (small,) = h.add([3] * 2, max_tokens=2)
    out = h.step()
    assert [it.seq for it in out.items] == [big_runner]
    assert big.status == small.status == RequestStatus.WAITING
    h.run()
    assert big.first_scheduled_time is not None and small.first_scheduled_time is not None
    assert big.first_scheduled_time <= small.first_scheduled_time


def test_preemption_evicts_the_latest_admitted_and_it_resumes_exactly() -> None:
    # 6 blocks of 4 = 24 slots; three 6-token prompts growing to 14 tokens cannot all stay resident.
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    reqs = [h.add([i + 1] * 6, max_tokens=8)[0] for i in range(3)]
    out = h.step()
    assert [it.seq for it in out.items] == reqs
    preempted: list[Request] = []
    while not preempted:
        out = h.step()
        preempted = out.preempted
    assert preempted[0] is reqs[2]  # latest admitted goes first
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert reqs[2].block_table == [] and h.sched.waiting[0] is reqs[2]
    assert out.num_preemptions >= 1 and h.sched.num_preemptions_total >= 1
    h.run()
    for i, r in enumerate(reqs):
        assert r.output_token_ids == reference_output([i + 1] * 6, 8)
    assert reqs[2].num_preemptions >= 1
    assert h.bm.num_used_blocks == 0


def test_preempted_requests_keep_their_order_at_the_front() -> None:
    h = Harness(num_blocks=5, block_size=2, max_num_batched_tokens=64, prefix_caching=False)
    reqs = [h.add([i + 1, 9], max_tokens=5)[0] for i in range(4)]  # 4 x 1 block, then each grows
    h.step()
    h.add([7, 7], max_tokens=1)
    while len(h.sched.waiting) < 3:
        h.step()
    queued = list(h.sched.waiting)
    # Victims are re-queued in admission order, ahead of the request that was already waiting.
    victims = [r for r in queued if r in reqs]
    assert victims == sorted(victims, key=lambda r: r.seq_id)
    assert queued.index(victims[-1]) < len(queued) - 1
    h.run()
    for i, r in enumerate(reqs):
        assert r.output_token_ids == reference_output([i + 1, 9], 5)


def test_request_larger_than_the_pool_errors_instead_of_waiting_forever() -> None:
    h = Harness(num_blocks=4, block_size=4)
    (ok,) = h.add([1, 2, 3], max_tokens=3)
    (huge,) = h.add([5] * 10, max_tokens=10)  # 20 tokens > 16 slots
    h.run()
    assert huge.status == RequestStatus.FINISHED_ERROR and "16 tokens" in (huge.error or "")
    assert ok.finish_reason == "length" and ok.output_token_ids == reference_output([1, 2, 3], 3)


def test_request_that_outgrows_the_pool_while_alone_errors() -> None:
    h = Harness(num_blocks=3, block_size=4)
    (r,) = h.add([1, 2, 3], max_tokens=8)  # 11 tokens fit 12 slots...
    r.max_tokens = 20  # ...but it keeps generating past what the pool holds (admission check bypassed)
    h.sched._never_fits = lambda req: False
    h.run(max_steps=100)
    assert r.status == RequestStatus.FINISHED_ERROR
    assert r.num_tokens == 13  # 12 computed + the token that needed a 4th block


def test_prefix_hits_are_counted_and_skip_computation() -> None:
    h = Harness(block_size=4, max_num_batched_tokens=64)
    system = list(range(100, 117))  # 17 tokens: 4 full blocks
    (_a,) = h.add(system + [1, 2], max_tokens=2)
    h.run()
    (b,) = h.add(system + [3], max_tokens=2)
    out = h.step()
    assert out.prefix_cache_hits == 16 and out.prefix_cache_queries == 18
    assert out.items[0].num_new_tokens == 2  # only the uncached tail
    h.run()
    assert b.output_token_ids == reference_output(system + [3], 2)
    assert h.bm.prefix_cache_hits == 16


def test_recompute_after_preemption_reuses_cached_blocks() -> None:
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=64, prefix_caching=True)
    reqs = [h.add([i + 1] * 9, max_tokens=10)[0] for i in range(2)]
    hits_before = 0
    h.run()
    assert sum(o.num_preemptions for o in h.outputs) >= 1
    assert sum(o.prefix_cache_hits for o in h.outputs) > hits_before
    for i, r in enumerate(reqs):
        assert r.output_token_ids == reference_output([i + 1] * 9, 10)


def test_static_policy_runs_a_batch_to_completion() -> None:
    h = Harness(max_num_seqs=2, max_num_batched_tokens=6, policy="static")
    a, b, c = (h.add([i + 1] * 4, max_tokens=m)[0] for i, m in enumerate((2, 6, 1)))
    out = h.step()  # budget 6: a's 4 tokens + 2 of b's; c is not part of this batch
    assert [(it.seq, it.num_new_tokens) for it in out.items] == [(a, 4), (b, 2)]
    while not a.is_finished:
        h.step()
    # a's slot is free but c may not join until b is done too.
    while not b.is_finished:
        out = h.step()
        assert c.status == RequestStatus.WAITING and [it.seq for it in out.items] == [b]
    h.run()
    assert c.first_scheduled_time is not None and c.first_scheduled_time >= b.finished_time
    assert c.output_token_ids == reference_output([3] * 4, 1)


def test_continuous_batching_admits_into_freed_slots() -> None:
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = (h.add([i + 1] * 4, max_tokens=m)[0] for i, m in enumerate((2, 6, 1)))
    while not a.is_finished:
        h.step()
    out = h.step()
    assert c in [it.seq for it in out.items] and not b.is_finished


def test_n_choices_fork_the_prompt_once() -> None:
    h = Harness(block_size=4, max_num_batched_tokens=8)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks cover <= 17
    reqs = h.add(prompt, max_tokens=3, n=3, request_id="nreq")
    computed_prompt_tokens = 0
    while reqs[0].num_output_tokens == 0:
        out = h.step()
        # Siblings wait while choice 0 is still prefilling.
        assert [it.seq for it in out.items] == [reqs[0]]
        computed_prompt_tokens += out.num_prompt_tokens
    out = h.step()
    for r in reqs[1:]:
        assert r.block_table[:4] == reqs[0].block_table[:4]
        assert all(h.bm.ref_counts[b] == 3 for b in reqs[0].block_table[:4])
    # Each sibling computes only the 2 tokens after the shared blocks.
    assert sorted(it.num_new_tokens for it in out.items) == [1, 2, 2]
    h.run()
    ref = reference_output(prompt, 3)
    assert all(r.output_token_ids == ref for r in reqs)  # the fake model is deterministic
    assert h.bm.num_used_blocks == 0


def test_n_choices_without_prefix_caching_still_fork() -> None:
    h = Harness(block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    reqs = h.add(list(range(1, 10)), max_tokens=5, n=2)
    h.step()
    out = h.step()
    assert reqs[1].block_table[:2] == reqs[0].block_table[:2]
    assert [it.num_new_tokens for it in out.items if it.seq is reqs[1]] == [1]
    h.run()


def test_finish_frees_blocks_from_any_queue() -> None:
    h = Harness(max_num_seqs=1)
    (a,) = h.add([1, 2, 3, 4, 5], max_tokens=5)
    (b,) = h.add([6, 7], max_tokens=5)
    h.step()
    assert h.bm.num_used_blocks > 0
    h.sched.finish(a, RequestStatus.FINISHED_ABORTED)
    h.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    h.sched.finish(b, RequestStatus.FINISHED_ABORTED)  # idempotent
    assert not h.sched.has_unfinished() and h.bm.num_used_blocks == 0
    assert a.finish_reason == b.finish_reason == "abort"


@pytest.mark.parametrize("policy", ["fcfs", "priority", "static"])
def test_random_workload_under_memory_pressure_completes_exactly(policy: str) -> None:
    import random

    rng = random.Random(7)
    h = Harness(num_blocks=24, block_size=4, max_num_seqs=5, max_num_batched_tokens=16, policy=policy)
    specs = []
    for _i in range(25):
        prompt = [rng.randrange(5) for _ in range(rng.randint(1, 30))]
        mt = rng.randint(1, 40)
        prio = rng.randint(-2, 2) if policy == "priority" else 0
        specs.append((h.add(prompt, max_tokens=mt, n=rng.choice([1, 1, 2]), priority=prio)[0:], prompt, mt))
    h.run()
    for reqs, prompt, mt in specs:
        for r in reqs:
            if len(prompt) + mt > 96:
                assert r.status == RequestStatus.FINISHED_ERROR
            else:
                assert r.output_token_ids == reference_output(prompt, mt)
    assert h.bm.num_used_blocks == 0


def test_a_row_with_a_pending_input_token_waits_instead_of_preempting() -> None:
    """Scheduling ahead, a decode whose input token is not read yet may be a wasted row: when it needs a
    block and none is free it waits a step; once the token is known it may preempt as usual.
    (The scheduler alone: the test plays the engine's part by hand.)"""
    h = Harness(num_blocks=3, block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    (a,) = h.add([1, 2, 3], max_tokens=5)
    (b,) = h.add([4, 5, 6], max_tokens=5)
    (c,) = h.add([7, 8, 9], max_tokens=5)
    out = h.sched.schedule()
    assert [it.seq for it in out.items] == [a, b, c] and h.bm.num_free_blocks == 0
    for r in (a, b, c):
        r.num_computed_tokens = 3  # prompts computed; a's and b's 4th tokens are being sampled
    for r in (a, b):
        r.token_ids.append(PENDING_TOKEN)
    out = h.sched.schedule()  # position 3 fits their first blocks
    assert [it.seq for it in out.items] == [a, b] and not out.preempted
    for r in (a, b):
        r.num_computed_tokens = 4
        r.token_ids[-1] = 10  # the pending token read
        r.token_ids.append(PENDING_TOKEN)  # and the next one pending: position 4 needs a new block
    out = h.sched.schedule()
    assert out.items == [] and out.preempted == []
    assert a.status == b.status == c.status == RequestStatus.RUNNING
    a.token_ids[-1] = 11  # a's token is known now: a preempts the latest admitted, as before
    out = h.sched.schedule()
    assert [it.seq for it in out.items] == [a] and out.preempted == [c]
    assert b.token_ids[-1] == PENDING_TOKEN and b.status == RequestStatus.RUNNING


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    h = Harness(max_num_seqs=1, policy="priority")
    order = [("low", 5), ("high", -1), ("mid-a", 0), ("mid-b", 0), ("top", -7)]
    reqs = {name: h.add([1, 2, 3], max_tokens=2, request_id=name, priority=p)[0] for name, p in order}
    assert [r.request_id for r in h.sched.waiting] == ["top", "high", "mid-a", "mid-b", "low"]
    h.run()
    admitted = sorted(reqs.values(), key=lambda r: r.first_scheduled_time)
    assert [r.request_id for r in admitted] == ["top", "high", "mid-a", "mid-b", "low"]
    with pytest.raises(ValueError, match="priority"):
        Scheduler(h.bm, max_num_seqs=1, max_num_batched_tokens=8, policy="lottery")


def test_priority_policy_preempts_the_lowest_priority_and_requeues_it_in_order() -> None:
    # As in the FCFS preemption test (6 blocks of 4; three requests growing to 14 tokens), but the
    # first request admitted has the lowest priority: it is the one preempted, not the latest.
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=64, prefix_caching=False, policy="priority")
    (low,) = h.add([1] * 6, max_tokens=8, priority=3)
    h.step()
    high = [h.add([i + 2] * 6, max_tokens=8, priority=p)[0] for i, p in enumerate([0, 1])]
    h.step()
    assert h.sched.running == [high[0], high[1], low]  # served by priority
    later = h.add([9] * 2, max_tokens=1, priority=2)[0]
    preempted: list[Request] = []
    while not preempted:
        preempted = h.step().preempted
    assert preempted[0] is low
    # Back in the queue by priority: behind the priority-2 request that arrived after it.
    assert list(h.sched.waiting) == [later, low]
    h.run()
    for r, first in zip([low, *high], [1, 2, 3]):
        assert r.output_token_ids == reference_output([first] * 6, 8)
    assert h.bm.num_used_blocks == 0
