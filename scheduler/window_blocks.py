"""Which KV blocks have left every sliding window that holds them.

A layer that attends over the last ``window`` positions (Gemma 3's local layers, Mistral's, Qwen's
windowed ones) never again reads, for a sequence of ``n`` computed tokens, its first
``(n - window) // block_size`` blocks. Once every sequence holding a block has left it, the pool can
hand that block's windowed layers back to the system (``KVPool.release``), as llama.cpp keeps only a
window's cells for such layers; the full-attention layers keep it, and so does the prefix cache.

A released block is not whole, so a prefix hit or a fork that would start a sequence where its window
reaches a released block is cut back to where the window before it is whole (vLLM's hybrid KV
manager applies the same rule to its sliding-window groups). Some windows are kept, never released:
the one before a prompt's last full block, so that the prompt sent again still hits in full (as
llama-server's context checkpoints keep the state at each prompt's end); and the one before where a
sequence's prompt matched the prefix cache, so that a prefix seen shared once (a system prompt) hits
in full from then on, after the one recomputation its cut-back may have cost.

Every holder of a block has it at the same index of its table (the hash chain or a fork puts it
there), so "left" is a comparison of index and length. Pure bookkeeping: the engine hands the ids
``take`` returns to the pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol


class WindowedSequence(Protocol):
    seq_id: int
    num_computed_tokens: int
    num_prompt_tokens: int
    block_table: list[int]


class WindowedBlocks:
    """Per-block counts of the holders whose window still reaches each block, and the released flags."""

    def __init__(self, num_blocks: int, block_size: int, window: int, keep_prompt_windows: bool = True) -> None:
        self.block_size = block_size
        self.window = window
        self.keep_prompt_windows = keep_prompt_windows  # off without a prefix cache: nothing would hit them
        self.released = [False] * num_blocks
        self._reached = [0] * num_blocks  # holders whose window still reaches the block (0 once released)
        self._kept = [False] * num_blocks
        self._left: dict[int, int] = {}  # seq_id -> how many leading blocks of its table it has left
        self._shared: dict[int, int] = {}  # seq_id -> blocks of its prompt the prefix cache matched
        self._pending: list[int] = []

    def first_needed(self, num_tokens: int) -> int:
        """The first block a windowed layer reads for a sequence of ``num_tokens`` computed tokens: its
        next query, at position ``num_tokens``, attends to the ``window`` positions ending there."""
        return max(0, (num_tokens - self.window) // self.block_size)

    def whole_prefix(self, blocks: Sequence[int]) -> int:
        """The most of ``blocks`` a sequence may start from: the largest k whose window before k * block_size
        holds no released block."""
        if not any(self.released[b] for b in blocks):
            return len(blocks)
        gone = list(itertools.accumulate((self.released[b] for b in blocks), initial=0))
        for k in range(len(blocks), 0, -1):
            if gone[k] == gone[self.first_needed(k * self.block_size)]:
                return k
        return 0

    # -- the block manager's hooks -------------------------------------------------------------------
    def fresh(self, block: int) -> None:
        """``block`` was handed out for new K/V: whole again, one holder."""
        self.released[block] = self._kept[block] = False
        self._reached[block] = 1

    def hold(self, block: int) -> None:
        """Another sequence adopted ``block`` (a prefix hit or a fork)."""
        if not self.released[block]:
            self._reached[block] += 1

    def note_shared(self, seq: WindowedSequence, num_matched_blocks: int) -> None:
        """``seq``'s prompt matched ``num_matched_blocks`` cached blocks (before any cut-back): keep the
        window before that boundary once ``seq`` leaves it."""
        if num_matched_blocks:
            self._shared[seq.seq_id] = num_matched_blocks

    def drop(self, seq: WindowedSequence) -> None:
        """``seq`` frees its blocks: it stops reaching those it had not left (nothing is released: a
        finished sequence's last window stays whole for the prefix cache)."""
        self._shared.pop(seq.seq_id, None)
        for b in seq.block_table[self._left.pop(seq.seq_id, 0) :]:
            if not self.released[b]:
                self._reached[b] -= 1

    def advance(self, seq: WindowedSequence) -> None:
        """Count the blocks ``seq``'s window has left since the last call; release those no holder reaches."""
        table = seq.block_table
        start = self._left.get(seq.seq_id, 0)
        end = min(len(table), self.first_needed(seq.num_computed_tokens))
        if end <= start:
            return
        kept: list[range] = []
        if self.keep_prompt_windows:  # the windows a repeat of the prompt, or of its shared prefix, starts from
            for boundary in (max(0, seq.num_prompt_tokens - 1) // self.block_size, self._shared.get(seq.seq_id, 0)):
                kept.append(range(self.first_needed(boundary * self.block_size), boundary))
        for i in range(start, end):
            b = table[i]
            if self.released[b]:
                continue
            if any(i in r for r in kept):
                self._kept[b] = True
            self._reached[b] -= 1
            if self._reached[b] == 0 and not self._kept[b]:
                self.released[b] = True
                self._pending.append(b)
        self._left[seq.seq_id] = end

    def take(self) -> list[int]:
        """The blocks released since the last call, for the pool to hand back."""
        pending, self._pending = self._pending, []
        return pending

    def check(self, ref_counts: Sequence[int]) -> None:
        """Raise AssertionError where the counts disagree with the blocks' ref counts (tests)."""
        for b, (n, gone) in enumerate(zip(self._reached, self.released)):
            assert 0 <= n <= max(ref_counts[b], 0), f"block {b}: reached by {n} of {ref_counts[b]} holders"
            assert not (gone and n), f"released block {b} is still reached"
