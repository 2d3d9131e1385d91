"""Prefix-cache block keys: sha256 over a canonical encoding, checked against hashlib directly.

A non-cryptographic key (Python's ``hash``) would let a client who builds a colliding block read
another client's KV (vLLM's CVE-2025-25183); these tests pin the keys to a reference digest.
"""

from __future__ import annotations

import hashlib
import sys

import pytest
from block_seq import Seq

from servelm.scheduler.block_hash import block_hash_seed, hash_block
from servelm.scheduler.block_manager import BlockManager
from servelm.scheduler.request import Request
from servelm.scheduler.sampling_params import SamplingParams


def ref_seed(lora_id: int, salt: str | None) -> bytes:
    """The seed's encoding written out independently: tag, adapter id as int64 LE, salt flag, salt."""
    tail = b"\x00" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"servelm-prefix-seed\x00" + lora_id.to_bytes(8, "little", signed=True) + tail).digest()


def ref_block(parent: bytes, tokens: list[int]) -> bytes:
    """A block's key: sha256 of the parent digest then each token id as int64 little-endian."""
    return hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)).digest()


def run(bm: BlockManager, seq: Seq) -> None:
    """Compute all of ``seq``'s tokens and register its full blocks."""
    assert bm.allocate_slots(seq, len(seq.token_ids))
    seq.num_computed_tokens = len(seq.token_ids)
    bm.cache_full_blocks(seq)


def test_hash_block_is_sha256_of_the_canonical_encoding() -> None:
    parent = ref_seed(0, None)
    for tokens in ([0] * 16, list(range(16)), [151_643, 7, -1, 2**31, 2**63 - 1] + [3] * 11):
        assert hash_block(parent, tokens) == ref_block(parent, tokens)
    assert len(hash_block(parent, [1, 2])) == 32


def test_seeds_are_digests_of_the_adapter_and_salt() -> None:
    for lora_id, salt in ((0, None), (1, None), (0, "1"), (7, "alice"), (3, "\ud800 lone surrogate")):
        assert block_hash_seed(lora_id, salt) == ref_seed(lora_id, salt)


def test_seeds_are_distinct_for_every_adapter_and_salt() -> None:
    """A salt can never stand for an adapter id or another salt (fixed-width id, a salt flag, salt last)."""
    keys = [
        (0, None),
        (1, None),
        (2, None),
        (0, "1"),
        (1, "1"),
        (0, "\x01"),
        (0, "\x00"),
        (0, "1\x00"),
        (0, "\x01\x00\x00\x00\x00\x00\x00\x00\x00"),
        (256, None),
        (0, "a"),
        (1, "a"),
        (0, ""),
    ]
    seeds = [block_hash_seed(lora, salt) for lora, salt in keys]
    assert len(set(seeds)) == len(seeds)


def test_requests_seed_their_chain_from_the_adapter_and_salt() -> None:
    def seed(**kw: object) -> bytes | None:
        return Request(0, "r", [1, 2, 3], SamplingParams(), **kw).hash_seed

    assert seed() is None  # the base model without salt: the manager's default root
    assert seed(lora_id=1) == block_hash_seed(1, None)
    assert seed(cache_salt="1") == block_hash_seed(0, "1")
    assert seed(lora_id=1, cache_salt="1") == block_hash_seed(1, "1")
    assert len({seed(lora_id=1), seed(cache_salt="1"), seed(lora_id=1, cache_salt="1")}) == 3


def test_the_chain_equals_the_reference_from_the_seed() -> None:
    """Each full block's key chains from the previous one (the seed for the first; the base model's
    root is the seed of adapter 0 without salt)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    toks = list(range(100, 114))  # 3 full blocks + 2 tokens
    for seq_id, (seed, root) in enumerate(((None, ref_seed(0, None)), (block_hash_seed(2, "s"), ref_seed(2, "s")))):
        s = Seq(seq_id, toks, hash_seed=seed)
        run(bm, s)
        parent, want = root, []
        for i in range(3):
            parent = ref_block(parent, toks[i * 4 : (i + 1) * 4])
            want.append(parent)
        assert s.block_hashes == want
        bm.free(s)
    bm.check_invariants()


@pytest.mark.skipif(sys.hash_info.modulus != 2**61 - 1, reason="the collision below is 64-bit CPython's")
def test_blocks_whose_python_hashes_collide_are_not_shared() -> None:
    """hash(2**61 - 1) == hash(0) on 64-bit CPython, so the tuple keys of these blocks are equal: a
    Python-hash key served the first sequence's KV to the second."""
    evil = 2**61 - 1
    assert hash((None, (0, 7))) == hash((None, (evil, 7)))
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Seq(0, [0, 7, 5])
    run(bm, a)
    b = Seq(1, [evil, 7, 5])
    assert bm.lookup(b).blocks == []
    run(bm, b)
    assert b.block_table[0] != a.block_table[0]
    assert bm.num_cached_blocks == 2
    # The honest prefix still hits.
    assert bm.lookup(Seq(2, [0, 7, 9])).blocks == a.block_table[:1]
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
