"""The minimal sequence the block manager works on, and one scheduled step over it (shared by the
block-manager, prefix-hash and KV-event tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.scheduler.block_manager import BlockManager, PrefixMatch


@dataclass
class Seq:
    """What ``BlockManager`` reads and writes of a request."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    hash_seed: bytes | None = None
    num_prompt_tokens: int = 0


def compute(bm: BlockManager, seq: Seq, n: int, prefix: PrefixMatch | None = None) -> bool:
    """Allocate and "compute" n tokens (what one scheduled step does), then register full blocks."""
    if not bm.allocate_slots(seq, n, prefix):
        return False
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return True
