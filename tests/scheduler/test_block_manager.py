"""BlockManager: allocation, ref counts, prefix caching, LRU eviction, and a hypothesis state machine."""

from __future__ import annotations

import pytest
from block_seq import Seq, compute
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from servelm.scheduler.block_hash import block_hash_seed
from servelm.scheduler.block_manager import BlockManager, PrefixMatch


def test_allocate_and_free_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Seq(0, list(range(10)))
    assert compute(bm, s, 10)
    assert len(s.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    # Growing within the last block needs nothing new; crossing into a 4th block needs one.
    s.token_ids += [10, 11]
    assert compute(bm, s, 2) and len(s.block_table) == 3
    s.token_ids.append(12)
    assert compute(bm, s, 1) and len(s.block_table) == 4
    bm.free(s)
    assert s.block_table == [] and bm.num_used_blocks == 0
    bm.check_invariants()


def test_allocation_fails_without_partial_allocation() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Seq(0, list(range(12)))
    assert compute(bm, a, 12)  # 3 blocks
    b = Seq(1, list(range(100, 109)))  # needs 3 blocks, 1 free
    assert not bm.allocate_slots(b, 9)
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate_slots(b, 4)  # one block fits
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    a = Seq(0, prompt + [99])
    assert compute(bm, a, len(a.token_ids))
    b = Seq(1, prompt + [50, 51])
    m = bm.lookup(b)
    assert m.blocks == a.block_table[:3] and m.num_cached_tokens == 12 and m.num_query_tokens == 15
    assert compute(bm, b, 15 - 12, m)
    assert b.num_computed_tokens == 15 and b.block_table[:3] == a.block_table[:3]
    assert all(bm.ref_counts[x] == 2 for x in a.block_table[:3])
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (15, 12)
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_lookup_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(0, list(range(8)))
    assert compute(bm, a, 8)  # exactly 2 full blocks, both registered
    b = Seq(1, list(range(8)))  # the same 8 tokens: the last one must still be computed
    m = bm.lookup(b)
    assert m.num_cached_tokens == 4
    c = Seq(2, list(range(9)))
    assert bm.lookup(c).num_cached_tokens == 8
    bm.free(a)


def test_hash_depends_on_the_whole_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Seq(0, [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    # Same second block, different first block: no hit at all.
    b = Seq(1, [9, 9, 3, 4, 5])
    assert bm.lookup(b).blocks == []
    bm.free(a)


def test_hash_seed_separates_identical_prompts() -> None:
    """Sequences of another seed (a LoRA adapter's) never share blocks with the same tokens of the
    base model or of another seed; the same seed shares as usual."""
    bm = BlockManager(num_blocks=16, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = Seq(0, prompt)
    assert compute(bm, a, 5)
    assert bm.lookup(Seq(1, prompt, hash_seed=block_hash_seed(1))).blocks == []
    b = Seq(2, prompt, hash_seed=block_hash_seed(1))
    assert compute(bm, b, 5)
    assert bm.lookup(Seq(3, prompt, hash_seed=block_hash_seed(2))).blocks == []
    assert bm.lookup(Seq(4, prompt, hash_seed=block_hash_seed(1))).blocks == b.block_table[:2]
    assert bm.lookup(Seq(5, prompt)).blocks == a.block_table[:2]
    bm.free(a)
    bm.free(b)
    bm.check_invariants()


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(0, [1, 2, 3, 4, 5, 6])
    assert compute(bm, a, 6)
    for t in (7, 8, 9, 10):  # decode: each sampled token is computed in the next step
        a.token_ids.append(t)
        assert compute(bm, a, 1)
    bm.free(a)  # 10 computed tokens: blocks [1..4] and [5..8] are registered
    turn2 = Seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert bm.lookup(turn2).num_cached_tokens == 8


def test_freed_cached_blocks_are_reused_lru_and_drop_their_hash() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Seq(0, [1, 2, 3])
    assert compute(bm, a, 3)  # blocks: [1,2] cached, [3] partial
    b = Seq(1, [7, 8, 9])
    assert compute(bm, b, 3)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Uncached free blocks go first: the two cached prefixes survive a 2-block allocation.
    c = Seq(2, [20, 21, 22])
    assert compute(bm, c, 3)
    assert bm.lookup(Seq(3, [1, 2, 0])).num_cached_tokens == 2
    # The next allocation must evict: a's block was freed first, so it goes first (LRU).
    d = Seq(4, [30])
    assert compute(bm, d, 1)
    assert bm.lookup(Seq(5, [1, 2, 0])).num_cached_tokens == 0
    assert bm.lookup(Seq(6, [7, 8, 0])).num_cached_tokens == 2
    bm.check_invariants()
    bm.free(c)
    bm.free(d)
    assert bm.num_used_blocks == 0


def test_adopting_an_evictable_block_takes_it_off_the_free_list() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Seq(0, [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    bm.free(a)
    b = Seq(1, [1, 2, 3, 4, 5, 6])
    m = bm.lookup(b)
    assert m.num_cached_tokens == 4
    # 2 cached blocks revived + 1 new block = all 3; a 7-token ask (2 new blocks) must fail cleanly.
    b7 = Seq(2, [1, 2, 3, 4, 5, 6, 7])
    m7 = bm.lookup(b7)
    assert m7.num_cached_tokens == 4
    # 7 tokens = 4 blocks: 2 revived + 2 new > 3 free.
    assert not bm.allocate_slots(b7, 3, m7)
    bm.check_invariants()
    assert bm.num_cached_blocks == 2 and bm.prefix_cache_queries == 0
    assert bm.num_used_blocks == 0 and b7.block_table == []
    assert compute(bm, b, 2, m)
    assert bm.num_free_blocks == 0 and b.num_computed_tokens == 6
    bm.free(b)
    bm.check_invariants()


def test_fork_shares_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Seq(0, list(range(11)))
    assert compute(bm, parent, 11)
    shared = bm.fork(parent.block_table, 10)  # 2 full blocks cover <= 10 tokens
    assert shared == parent.block_table[:2]
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    child = Seq(1, list(range(11)), num_computed_tokens=8, block_table=shared)
    assert compute(bm, child, 3)
    assert child.block_table[2] != parent.block_table[2]
    bm.free(parent)
    assert bm.num_used_blocks == 3
    bm.free(child)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_prefix_caching_off_finds_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = Seq(0, [1, 2, 3, 4, 5])
    assert compute(bm, a, 5)
    m = bm.lookup(Seq(1, [1, 2, 3, 4, 5]))
    assert m.blocks == [] and m.num_query_tokens == 0
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.num_used_blocks == 0


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / lookup sequences keep the bookkeeping consistent."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=3)
        self.live: dict[int, Seq] = {}
        self.next_id = 0
        self.content: dict[int, tuple[int, ...]] = {}  # what each pool block holds, as "computed"

    def _compute(self, s: Seq, n: int, m: PrefixMatch | None = None) -> bool:
        if m is not None:
            self._check_match(s.token_ids, m)
        start = s.num_computed_tokens + (m.num_cached_tokens if m else 0)
        if not compute(self.bm, s, n, m):
            return False
        bs = self.bm.block_size
        for i in range(start // bs, -(-s.num_computed_tokens // bs)):
            self.content[s.block_table[i]] = tuple(s.token_ids[i * bs : min((i + 1) * bs, s.num_computed_tokens)])
        return True

    def _check_match(self, toks: list[int], m: PrefixMatch) -> None:
        bs = self.bm.block_size
        assert m.num_cached_tokens <= len(toks) - 1
        for i, b in enumerate(m.blocks):
            # A cache hit must hand out a block that really holds these tokens.
            assert self.content.get(b) == tuple(toks[i * bs : (i + 1) * bs])

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(target=seqs, toks=st.lists(st.integers(0, 3), min_size=1, max_size=20), use_cache=st.booleans())
    def admit(self, toks: list[int], use_cache: bool) -> Seq | None:
        s = Seq(self._new_id(), toks)
        m = self.bm.lookup(s) if use_cache else None
        cached = m.num_cached_tokens if m else 0
        if not self._compute(s, len(toks) - cached, m):
            assert s.block_table == [] and s.num_computed_tokens == 0
            return None
        self.live[s.seq_id] = s
        return s

    @rule(s=seqs, tok=st.integers(0, 3))
    def append(self, s: Seq | None, tok: int) -> None:
        if s is None or s.seq_id not in self.live:
            return
        s.token_ids.append(tok)
        before = list(s.block_table)
        if not self._compute(s, 1):
            s.token_ids.pop()
            assert s.block_table == before

    @rule(target=seqs, s=seqs)
    def fork(self, s: Seq | None) -> Seq | None:
        if s is None or s.seq_id not in self.live:
            return None
        n = max(len(s.token_ids) - 1, 0)
        shared = self.bm.fork(s.block_table, n)
        child = Seq(self._new_id(), list(s.token_ids), len(shared) * self.bm.block_size, shared)
        self.live[child.seq_id] = child
        if not self._compute(child, len(child.token_ids) - child.num_computed_tokens):
            self.bm.free(child)
            del self.live[child.seq_id]
            return None
        return child

    @rule(s=consumes(seqs))
    def free(self, s: Seq | None) -> None:
        if s is None or s.seq_id not in self.live:
            return
        self.bm.free(s)
        del self.live[s.seq_id]

    @rule(toks=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def lookup_only(self, toks: list[int]) -> None:
        self._check_match(toks, self.bm.lookup(Seq(self._new_id(), toks)))

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        refs = [0] * bm.num_blocks
        for s in self.live.values():
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
            for b in s.block_table:
                refs[b] += 1
        assert refs == bm.ref_counts  # ref counts are exactly the live tables' references
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        in_use = {b for b, r in enumerate(refs) if r}
        assert len(in_use) == bm.num_used_blocks

    def teardown(self) -> None:
        for s in list(self.live.values()):
            self.bm.free(s)
        self.live.clear()
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
