"""Sliding-window blocks: a block every holder's window has left is released (its windowed layers'
K/V go back to the system), and prefix hits and forks are cut back to where the window before them is
still whole. Window 8 and blocks of 4: a sequence of n computed tokens has left its first
(n - 8) // 4 blocks."""

from __future__ import annotations

from block_seq import Seq, compute
from hypothesis import settings
from hypothesis.stateful import invariant
from test_block_manager import BlockManagerMachine

from servelm.scheduler.block_manager import BlockManager, PrefixMatch

W, BS = 8, 4


def prompt(seq_id: int, tokens: list[int]) -> Seq:
    return Seq(seq_id, list(tokens), num_prompt_tokens=len(tokens))


def decode(bm: BlockManager, s: Seq, n: int, tok: int = 7) -> None:
    """n decode steps, each preceded by what the scheduler does first: release what windows left."""
    for _ in range(n):
        bm.release_passed(s)
        s.token_ids.append(tok)
        assert compute(bm, s, 1)
    bm.release_passed(s)


def released(bm: BlockManager, s: Seq) -> list[int]:
    """The indices of ``s``'s blocks whose windowed K/V were handed back."""
    return [i for i, b in enumerate(s.block_table) if bm.windows.released[b]]


def test_a_sequence_releases_the_blocks_its_window_left_but_its_prompts_last_window() -> None:
    bm = BlockManager(32, BS, window=W)
    s = prompt(0, list(range(1, 22)))  # 21 tokens: a repeat would look up 5 blocks, whose window is blocks 3-4
    assert compute(bm, s, 21)
    bm.release_passed(s)  # 21 computed: blocks 0-2 left
    assert released(bm, s) == [0, 1, 2] and bm.take_released() == s.block_table[:3]
    decode(bm, s, 11)  # 32 computed: blocks 0-5 left; 3 and 4 stay whole for the prompt's repeats
    assert released(bm, s) == [0, 1, 2, 5] and bm.take_released() == [s.block_table[5]]
    assert bm.take_released() == []
    again = bm.lookup(prompt(1, list(range(1, 22))))
    assert again.blocks == s.block_table[:5]  # the whole prompt but its last token: its window is whole
    bm.free(s)
    bm.check_invariants()


def test_without_a_window_nothing_is_released() -> None:
    bm = BlockManager(32, BS)
    s = prompt(0, list(range(1, 22)))
    assert compute(bm, s, 21)
    decode(bm, s, 20)
    assert bm.take_released() == [] and bm.windows is None


def test_a_shared_block_is_released_when_its_last_holder_leaves_it() -> None:
    bm = BlockManager(32, BS, window=W)
    a = prompt(0, [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    decode(bm, a, 15)  # 20 computed: blocks 1-2 released, block 0 kept for a's prompt
    child = Seq(1, list(a.token_ids), num_prompt_tokens=1)  # (a short "prompt": nothing kept for it)
    child.block_table = bm.fork(a.block_table, 20)
    child.num_computed_tokens = 20
    assert child.block_table == a.block_table[:5]  # the window before 20 (blocks 3-4) is whole
    decode(bm, a, 4)  # a at 24 leaves block 3; the child, at 20, still reaches it
    assert released(bm, a) == [1, 2] and bm.take_released() == a.block_table[1:3]
    decode(bm, child, 4)
    assert released(bm, child) == [1, 2, 3] and bm.take_released() == [a.block_table[3]]
    bm.free(a)
    bm.free(child)
    bm.check_invariants()


def test_a_prefix_seen_shared_once_hits_in_full_from_then_on() -> None:
    """A system prompt of 12 tokens: b comes after a went a window past it, so b recomputes it; b keeps
    the window before the boundary its prompt matched, and its whole blocks replace a's released ones
    in the prefix cache, so c hits the whole system prompt."""
    bm = BlockManager(32, BS, window=W)
    system = list(range(100, 112))
    a = prompt(0, system + [1, 2, 3, 4, 5])
    assert compute(bm, a, 17)
    decode(bm, a, 23)  # 40 computed: only a's prompt's last window (blocks 2-3) is whole
    b = prompt(1, system + [6, 7, 8, 9, 10])
    hit = bm.lookup(b)
    assert hit.num_matched_blocks == 3 and hit.blocks == []
    assert compute(bm, b, 17, hit)
    decode(bm, b, 23)
    c = prompt(2, system + [11, 12, 13, 14, 15])
    hit = bm.lookup(c)
    assert hit.num_cached_tokens == 12 and hit.blocks[1] == b.block_table[1]
    assert compute(bm, c, 5, hit)
    for s in (a, b, c):
        bm.free(s)
    bm.check_invariants()


def test_a_prefix_hit_is_cut_back_to_where_its_window_is_whole() -> None:
    bm = BlockManager(32, BS, window=W)
    a = prompt(0, list(range(1, 14)))  # 13 tokens: blocks 1-2 are its prompt's last window
    assert compute(bm, a, 13)
    decode(bm, a, 27)  # 40 computed: blocks 0 and 3-7 released
    assert released(bm, a) == [0, 3, 4, 5, 6, 7]
    b = prompt(1, a.token_ids[:30] + [99])
    hit = bm.lookup(b)
    # 7 full blocks match, but blocks 5-6 (the window before token 28) are gone; so are those before
    # 24, 20 and 16; before 12 the window is blocks 1-2, kept whole.
    assert hit.blocks == a.block_table[:3] and hit.num_cached_tokens == 12
    c = prompt(2, a.token_ids[:40] + [99])  # a's whole sequence: its last window is whole
    assert bm.lookup(c).blocks == a.block_table[:10]
    bm.free(a)
    bm.check_invariants()


def test_a_fork_shares_only_blocks_whose_window_is_whole() -> None:
    bm = BlockManager(32, BS, window=W)
    a = prompt(0, list(range(1, 6)))
    assert compute(bm, a, 5)
    decode(bm, a, 35)  # 40 computed: blocks 1-7 released (block 0 kept for the prompt)
    assert bm.fork(a.block_table, 4) == a.block_table[:1]  # the prompt's blocks: whole
    bm.free(Seq(9, [], block_table=a.block_table[:1]))
    assert bm.fork(a.block_table, 30) == a.block_table[:1]  # window before 28 gone: back to the kept block
    bm.free(Seq(10, [], block_table=a.block_table[:1]))
    bm.free(a)
    bm.check_invariants()


def test_a_released_block_handed_out_again_is_whole() -> None:
    bm = BlockManager(4, BS, window=W, enable_prefix_caching=False)
    a = prompt(0, list(range(1, 13)))
    assert compute(bm, a, 12)
    decode(bm, a, 4)  # 16 computed: blocks 0 and 1 left (nothing is kept without a prefix cache)
    assert released(bm, a) == [0, 1]
    bm.free(a)
    b = prompt(1, list(range(50, 66)))
    assert compute(bm, b, 16)
    assert released(bm, b) == []  # the same pool blocks, written again
    bm.free(b)
    bm.check_invariants()


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The block manager's state machine with a window of 5 over blocks of 3: besides the plain
    invariants, no live sequence's window and no prefix hit's window ever holds a released block."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = bm = BlockManager(num_blocks=12, block_size=3, window=5)
        lookup = bm.lookup

        def lookup_in_a_step(seq: Seq) -> PrefixMatch:
            self._step_begins()
            return lookup(seq)

        bm.lookup = lookup_in_a_step

    def _step_begins(self) -> None:
        """What the scheduler does first in a step, before any lookup or allocation."""
        for live in self.live.values():
            self.bm.release_passed(live)
        self.bm.take_released()

    def _compute(self, s: Seq, n: int, m: PrefixMatch | None = None) -> bool:
        if not s.num_prompt_tokens:
            s.num_prompt_tokens = len(s.token_ids)
        if m is None:  # (with a match, its lookup began the step)
            self._step_begins()
        return super()._compute(s, n, m)

    def _first_read(self, num_tokens: int) -> int:
        """The first block a window of 5 reads for the next query (at position ``num_tokens``): keys after
        position num_tokens - 5, as the attention kernels mask them."""
        return max(0, num_tokens - 5 + 1) // self.bm.block_size

    def _check_match(self, toks: list[int], m: PrefixMatch) -> None:
        super()._check_match(toks, m)
        windows = self.bm.windows
        assert windows is not None
        first = self._first_read(len(m.blocks) * self.bm.block_size)
        assert not any(windows.released[b] for b in m.blocks[first:])

    @invariant()
    def windows_whole(self) -> None:
        windows = self.bm.windows
        for s in self.live.values():
            first = self._first_read(s.num_computed_tokens)
            assert not any(windows.released[b] for b in s.block_table[first:]), (s, windows)


TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
