"""Copy on write in the block manager: a beam's fork shares every block, its partly filled last one too,
and that one is copied only when a sharer writes into it (``allocate_slots``); ref counts return to zero."""

from __future__ import annotations

from block_seq import Seq, compute

from servelm.scheduler.block_manager import BlockManager


def test_fork_shares_every_block_and_counts_references() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(0, list(range(10)))  # 2 full blocks and one holding 2 tokens
    assert compute(bm, a, 10)
    b = Seq(1, list(a.token_ids), num_computed_tokens=10)
    bm.adopt(b, bm.share(a))
    assert b.block_table == a.block_table and bm.num_used_blocks == 3
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 2]
    assert bm.take_copies() == []  # sharing copies nothing
    bm.check_invariants()


def test_write_into_a_shared_partial_block_copies_it_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(0, list(range(10)))
    assert compute(bm, a, 10)
    b = Seq(1, list(a.token_ids), num_computed_tokens=10)
    bm.adopt(b, bm.share(a))
    tail = a.block_table[2]
    b.token_ids.append(77)
    assert compute(bm, b, 1)
    # b writes position 10, inside the shared third block: it gets its own copy, the full blocks stay shared.
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != tail
    assert bm.take_copies() == [(tail, b.block_table[2])]
    assert bm.ref_counts[tail] == 1 and bm.ref_counts[b.block_table[2]] == 1
    # a, the last sharer of its tail, writes in place: no copy.
    a.token_ids.append(55)
    assert compute(bm, a, 1) and a.block_table[2] == tail and bm.take_copies() == []
    assert bm.num_used_blocks == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0 and all(rc == 0 for rc in bm.ref_counts)
    bm.check_invariants()


def test_a_fork_at_a_block_boundary_copies_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(0, list(range(8)))
    assert compute(bm, a, 8)
    b = Seq(1, list(a.token_ids), num_computed_tokens=8)
    bm.adopt(b, bm.share(a))
    b.token_ids.append(1)
    assert compute(bm, b, 1) and bm.take_copies() == []
    assert b.block_table[:2] == a.block_table and len(b.block_table) == 3
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_copy_needs_a_free_block_or_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = Seq(0, list(range(10)))
    assert compute(bm, a, 10)  # all 3 blocks
    b = Seq(1, list(a.token_ids), num_computed_tokens=10)
    bm.adopt(b, bm.share(a))
    b.token_ids.append(5)
    assert not bm.allocate_slots(b, 1)  # the copy has no block: the scheduler preempts, nothing moved
    assert b.block_table == a.block_table and bm.take_copies() == []
    bm.free(a)  # now the tail has one user, b writes in place
    assert compute(bm, b, 1) and bm.take_copies() == []
    bm.free(b)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_reassigning_beams_frees_what_no_beam_keeps() -> None:
    """Two beams both continue from beam 0 (beam 1 dies): beam 1's own blocks return to the pool."""
    bm = BlockManager(num_blocks=16, block_size=4)
    root = Seq(0, list(range(6)))
    assert compute(bm, root, 6)
    other = Seq(1, list(root.token_ids), num_computed_tokens=6)
    bm.adopt(other, bm.share(root))
    for s, t in ((root, 1), (other, 2)):
        s.token_ids += [t] * 3
        assert compute(bm, s, 3)  # both write their tails: other copies, root crosses into a new block
    bm.take_copies()
    shared = [bm.share(root), bm.share(root)]  # the next step's beams: both children of root
    for s in (root, other):
        bm.free(s)
    for s, sh in zip((root, other), shared):
        bm.adopt(s, sh)
    assert root.block_table == other.block_table and bm.num_used_blocks == 3
    for s in (root, other):
        bm.free(s)
    assert bm.num_used_blocks == 0
    bm.check_invariants()
