"""The paged KV cache's bookkeeping: which pool blocks each sequence owns, and the prefix cache.

Pure Python, no tensors: the runner owns the pool, this owns the block ids.

Prefix caching: a FULL block (``block_size`` computed tokens) is registered under the sha256 of
``(parent block's digest, its token ids)``, so a block's key stands for its whole prefix. The first
block's parent is the sequence's ``hash_seed``, a digest of its LoRA adapter and cache salt (None:
the base model without salt), since the same tokens give other K/V under another adapter and a salt
must share only with itself. A cache hit is trusted without comparing tokens: finding two blocks with
one sha256 is infeasible, whereas Python's ``hash`` of ints is 64-bit and invertible. A new or
recomputed sequence adopts the longest chain of registered blocks matching its tokens. Blocks whose
last user left keep their hash and wait in an LRU "evictable" list: they still count as free, and
are handed out again (dropping their hash) only after every never-cached free block is used.

With a sliding ``window`` (on a pool that can hand memory back) it also tracks the blocks every
window has left (``window_blocks``): prefix hits and forks are cut back to where their window is whole.

Copy on write (beam search): ``share`` gives a fork every block, a partly filled one too, copied (``take_copies``)
when a sharer writes into it. ``kv_events``: what enters and leaves the prefix cache (vLLM's BlockStored, ...).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from servelm.scheduler.block_hash import BASE_HASH_SEED, hash_block
from servelm.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, external_hash
from servelm.scheduler.window_blocks import WindowedBlocks


class BlockSequence(Protocol):
    """What the block manager reads and writes of a sequence (``scheduler.Request`` satisfies it)."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]
    hash_seed: bytes | None  # the first block's parent digest (None: the base model without salt)
    num_prompt_tokens: int


@dataclass
class PrefixMatch:
    """Cached blocks found for a sequence (not yet acquired) and how many tokens were looked up."""

    blocks: list[int] = field(default_factory=list)
    num_query_tokens: int = 0
    block_size: int = 0
    num_matched_blocks: int = 0  # before a sliding window's cut-back (``window_blocks``)

    @property
    def num_cached_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class BlockManager:
    """A free list of fixed-size KV blocks with ref counts and a hash-chained prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_events: bool = False,
        window: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        # Never-cached free blocks, popped from the end (low ids first, for readable tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that still hold a registered prefix, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block key -> block id
        self._num_registered: dict[int, int] = {}  # seq_id -> how many of its blocks were looked at
        # Cumulative prefix-cache counters, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # KV-cache events since the last ``take_events`` (None: not recorded, so nothing is paid).
        self._events: list[KVCacheEvent] | None = [] if kv_events else None
        self.windows = WindowedBlocks(num_blocks, block_size, window, enable_prefix_caching) if window else None
        self._copies: list[tuple[int, int]] = []  # (source, destination) block copies the next forward needs first

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------------------
    def _extend_hashes(self, seq: BlockSequence, num_full_blocks: int) -> list[bytes]:
        hashes = seq.block_hashes
        bs = self.block_size
        toks = seq.token_ids
        parent = hashes[-1] if hashes else (seq.hash_seed or BASE_HASH_SEED)
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, toks[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def lookup(self, seq: BlockSequence) -> PrefixMatch:
        """The longest cached prefix of ``seq.token_ids`` in full blocks, leaving the last token to compute.

        Nothing is acquired (``allocate_slots`` does that); counters move only on a successful allocation.
        """
        if not self.enable_prefix_caching:
            return PrefixMatch(block_size=self.block_size)
        # Cap at full blocks covering <= len-1 tokens: the last token's logits must be computed.
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hashes = self._extend_hashes(seq, max_blocks)
        blocks: list[int] = []
        for h in hashes[:max_blocks]:
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
        matched = len(blocks)
        if self.windows is not None:
            del blocks[self.windows.whole_prefix(blocks) :]
        return PrefixMatch(blocks, len(seq.token_ids), self.block_size, matched)

    def cache_full_blocks(self, seq: BlockSequence) -> None:
        """Register the blocks ``seq`` has filled with computed tokens (prompt and generated alike)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._extend_hashes(seq, num_full)
        table = seq.block_table
        new: list[int] | None = [] if self._events is not None else None
        for i in range(start, num_full):
            b, h = table[i], hashes[i]
            # A block already hashed (adopted from the cache or forked) stays as is; a duplicate of a
            # block another sequence registered first stays private and is simply not shared, unless
            # that one's window layers were released: the whole copy takes its place.
            if self._block_hash[b] is not None:
                continue
            old = self._cached.get(h)
            if old is not None and self.windows is not None and self.windows.released[old]:
                self._unregister(old)
            elif old is not None:
                continue
            self._block_hash[b] = h
            self._cached[h] = b
            if new is not None and old is None:  # (a replaced block's hash was announced already)
                new.append(i)
        self._num_registered[seq.seq_id] = num_full
        if new:
            self._record_stored(seq, new)

    def _unregister(self, b: int) -> None:
        """Take block ``b`` out of the prefix cache (a free one joins the never-cached free blocks)."""
        del self._cached[self._block_hash[b]]  # type: ignore[arg-type]
        self._block_hash[b] = None
        if b in self._evictable:
            del self._evictable[b]
            self._free.append(b)

    def _record_stored(self, seq: BlockSequence, new: list[int]) -> None:
        """One BlockStored per contiguous run of newly cached blocks (a private duplicate splits a run)."""
        bs, hashes = self.block_size, seq.block_hashes
        lora_id = getattr(seq, "lora_id", 0) or None
        first = 0
        for k in range(1, len(new) + 1):
            if k < len(new) and new[k] == new[k - 1] + 1:
                continue
            lo, hi = new[first], new[k - 1] + 1
            parent = external_hash(hashes[lo - 1]) if lo else None
            ids = [external_hash(h) for h in hashes[lo:hi]]
            self._events.append(BlockStored(ids, parent, list(seq.token_ids[lo * bs : hi * bs]), bs, lora_id))  # type: ignore[union-attr]
            first = k

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events recorded since the last call (always empty when not recording)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    # -- allocation ----------------------------------------------------------------------------------
    def _pop_free(self) -> int:
        if self._free:
            return self._free.pop()
        # Reuse the least recently freed cached block; its content is about to be overwritten.
        b, _ = self._evictable.popitem(last=False)
        h = self._block_hash[b]
        if h is not None and self._cached.get(h) == b:
            del self._cached[h]
            if self._events is not None:
                self._record_removed(h)
        self._block_hash[b] = None
        return b

    def _record_removed(self, h: bytes) -> None:
        # Evictions in a row (one allocation's worth) share one BlockRemoved.
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(h))
        else:
            self._events.append(BlockRemoved([external_hash(h)]))  # type: ignore[union-attr]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_slots(self, seq: BlockSequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Make room for the K/V of ``num_new_tokens`` tokens after ``seq``'s computed tokens.

        With ``prefix`` (admission of a sequence that owns no blocks yet) the cached blocks are adopted
        first and ``seq.num_computed_tokens`` advances over them. Returns False, changing nothing, when
        the free blocks do not suffice.
        """
        cow = self._shared_tail(seq) if prefix is None else None
        if prefix is None and cow is None:
            # The common case, a running sequence growing: done when its last block has room.
            need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
            if need <= 0:
                return True
        cached = prefix.blocks if prefix is not None else []
        if cached and (seq.block_table or seq.num_computed_tokens):
            raise ValueError("a prefix can only be adopted by a sequence that owns no blocks")
        num_tokens = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached)
        # Adopting an evictable cached block takes it off the free list too.
        reviving = sum(1 for b in cached if self.ref_counts[b] == 0)
        if max(need, 0) + reviving + (cow is not None) > self.num_free_blocks:
            return False
        if cow is not None:  # copy on write: this sequence's copy of the block it shares and writes into
            old, new = seq.block_table[cow], self._pop_free()
            self.ref_counts[old] -= 1
            self.ref_counts[new] = 1
            seq.block_table[cow] = new
            self._copies.append((old, new))
        for b in cached:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1
            if self.windows is not None:
                self.windows.hold(b)
        if cached:
            seq.block_table.extend(cached)
            seq.num_computed_tokens += len(cached) * self.block_size
            # Adopted blocks are registered already.
            self._num_registered[seq.seq_id] = len(cached)
        for _ in range(need):
            b = self._pop_free()
            self.ref_counts[b] = 1
            if self.windows is not None:
                self.windows.fresh(b)
            seq.block_table.append(b)
        if prefix is not None:
            self.prefix_cache_queries += prefix.num_query_tokens
            self.prefix_cache_hits += prefix.num_cached_tokens
            if self.windows is not None:
                self.windows.note_shared(seq, prefix.num_matched_blocks)
        return True

    def fork(self, src_block_table: Sequence[int], num_tokens: int) -> list[int]:
        """Share the full blocks of ``src_block_table`` covering ``num_tokens`` tokens (ref counts + 1)."""
        shared = list(src_block_table[: num_tokens // self.block_size])
        if self.windows is not None:
            del shared[self.windows.whole_prefix(shared) :]
        for b in shared:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"cannot fork block {b}: it is not in use")
        for b in shared:
            self.ref_counts[b] += 1
            if self.windows is not None:
                self.windows.hold(b)
        return shared

    def _shared_tail(self, seq: BlockSequence) -> int | None:
        """The index of the partly filled block ``seq`` writes next when another sequence shares it (a beam's fork)."""
        i, partial = divmod(seq.num_computed_tokens, self.block_size)
        return i if partial and i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1 else None

    def share(self, seq: BlockSequence) -> tuple[list[int], int]:
        """``seq``'s blocks, each with one more reference (a partly filled one is copied on write), for ``adopt``."""
        for b in seq.block_table:
            self.ref_counts[b] += 1
        return list(seq.block_table), self._num_registered.get(seq.seq_id, 0)

    def adopt(self, seq: BlockSequence, shared: tuple[list[int], int]) -> None:
        """Give ``seq``, which owns no blocks, the blocks ``share`` returned (their references are its now)."""
        if seq.block_table:
            raise ValueError("only a sequence that owns no blocks can adopt shared ones")
        seq.block_table, self._num_registered[seq.seq_id] = shared

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies made since the last call: the pool copies them before the forward."""
        copies, self._copies = self._copies, []
        return copies

    def free(self, seq: BlockSequence) -> None:
        """Release every block of ``seq`` (its table is emptied; ``num_computed_tokens`` is left alone)."""
        if self.windows is not None:
            self.windows.drop(seq)
        # Tail blocks first, so that the LRU evicts a chain's most specific blocks before its parents.
        for b in reversed(seq.block_table):
            rc = self.ref_counts[b] - 1
            if rc < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self.ref_counts[b] = rc
            if rc == 0:
                if self._block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        seq.block_table.clear()
        self._num_registered.pop(seq.seq_id, None)

    def release_passed(self, seq: BlockSequence) -> None:
        """Note the blocks ``seq``'s window has left (before its next step); ``take_released`` lists those
        no sequence's window reaches any more."""
        if self.windows is not None:
            self.windows.advance(seq)

    def take_released(self) -> list[int]:
        """Blocks whose windowed layers' K/V may be handed back, since the last call."""
        return self.windows.take() if self.windows is not None else []

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their content, they just stop being shared)."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests and debugging)."""
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and evictable"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has a negative ref count"
            assert (rc == 0) == (b in free or b in evictable), f"block {b}: ref count {rc} vs free lists"
        for b in free:
            assert self._block_hash[b] is None, f"uncached free block {b} has a hash"
        for b in evictable:
            assert self._block_hash[b] is not None, f"evictable block {b} has no hash"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"hash map and block {b} disagree"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        if self.windows is not None:
            self.windows.check(self.ref_counts)
