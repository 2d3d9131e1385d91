"""``whole_prompts``: an encoder's prompts are scheduled whole (bidirectional attention needs every token of
a sequence in one forward), never chunked, in arrival order under the token budget."""

from __future__ import annotations

from servelm.scheduler.block_manager import BlockManager
from servelm.scheduler.request import Request
from servelm.scheduler.sampling_params import SamplingParams
from servelm.scheduler.scheduler import Scheduler


def _scheduler(whole: bool) -> Scheduler:
    return Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=10, whole_prompts=whole)


def _add(s: Scheduler, seq_id: int, n: int) -> Request:
    r = Request(seq_id, f"r{seq_id}", list(range(1, n + 1)), SamplingParams(), max_tokens=0)
    s.add(r)
    return r


def test_chunking_scheduler_splits_the_prompt_that_overflows_the_budget() -> None:
    s = _scheduler(False)
    _add(s, 0, 6), _add(s, 1, 6)
    assert [i.num_new_tokens for i in s.schedule().items] == [6, 4]


def test_whole_prompts_waits_for_the_next_step_instead() -> None:
    s = _scheduler(True)
    a, b, c = _add(s, 0, 6), _add(s, 1, 6), _add(s, 2, 3)
    out = s.schedule()
    # b does not fit whole: it and everything behind it (c too, FCFS) wait; nothing is chunked.
    assert [(i.seq, i.num_new_tokens, i.sample) for i in out.items] == [(a, 6, True)]
    assert list(s.waiting) == [b, c]
    s.finish(a, a.status.__class__.FINISHED_STOPPED)
    assert [(i.seq, i.num_new_tokens) for i in s.schedule().items] == [(b, 6), (c, 3)]
    assert s.bm.num_used_blocks == 3  # b's two blocks and c's one, held while they compute
