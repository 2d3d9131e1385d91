"""The fixed input buffers the decode graphs read (``GraphInputs``), filled before each replay, and the
ladder of batch sizes captured (``capture_sizes``) with the padding a step gets (``padded_size``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from servelm.runtime.attention.base import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs, plus max_num_seqs itself when it is not a power of two."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size holding ``n`` rows (None when none does)."""
    for b in sizes:
        if b >= n:
            return b
    return None


# ``GraphInputs.stage`` copies whole block-table rows (one copy, no device-side scatter) while
# the rows it sends stay under this many bytes; above it (long contexts x many rows) it sends only
# the used columns, which the device then scatters into the table.
FULL_TABLE_ROWS_MAX_BYTES = 64 << 10


@dataclass
class GraphInputs:
    """The static buffers every captured graph reads (rows [0, B) for a graph of size B).

    The int64 inputs are rows of one buffer and the int32 lengths rows of another, so a step is
    staged with one host-to-device copy each (``stage``), plus one for the block tables."""

    i64: torch.Tensor  # [5, max_bs]: input ids, positions, slot mapping; pending rows and their sources
    i32: torch.Tensor  # [2, max_bs]: seq lens, context lens
    query_start_loc: torch.Tensor  # [max_bs + 1] int32, fixed 0..max_bs (one token per sequence)
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_seq] int32
    rows: torch.Tensor  # [max_bs] int64, fixed 0..max_bs - 1 (a decode step's sampled rows)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.i64[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.i64[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.i64[2]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.i32[0]

    @property
    def context_lens(self) -> torch.Tensor:
        return self.i32[1]

    @classmethod
    def allocate(cls, max_bs: int, max_blocks_per_seq: int, device: torch.device) -> GraphInputs:
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        g = cls(
            i64=torch.zeros(5, max_bs, dtype=torch.long, device=device),
            i32=torch.zeros(2, max_bs, **i32),
            query_start_loc=torch.arange(max_bs + 1, **i32),
            block_tables=torch.zeros(max_bs, max_blocks_per_seq, **i32),
            rows=torch.arange(max_bs, dtype=torch.long, device=device),
        )
        g.slot_mapping.fill_(-1)
        g.seq_lens.fill_(1)
        return g

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        padded_to: int,
    ) -> None:
        """Copy ``n`` real decode rows in from device tensors and reset rows [n, padded_to) to harmless
        padding. (The runner stages its steps from the host instead: ``stage``.)"""
        n = input_ids.shape[0]
        width = block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block table of {width} blocks exceeds the captured {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        # A decode's context before this step is everything but the new token.
        torch.sub(self.seq_lens[:n], 1, out=self.context_lens[:n])
        # Columns past `width` keep stale ids: kernels never read entries beyond ceil(seq_len / block).
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if padded_to > n:
            self.input_ids[n:padded_to].zero_()
            self.positions[n:padded_to].zero_()
            self.slot_mapping[n:padded_to].fill_(-1)
            self.seq_lens[n:padded_to].fill_(1)
            self.context_lens[n:padded_to].zero_()
            self.block_tables[n:padded_to, 0].zero_()

    def metadata(self, n: int, width: int, seq_lens: list[int]) -> AttentionMetadata:
        """Unbuilt metadata of ``n`` decode rows over these buffers (block-table columns [0, width));
        ``seq_lens``: their lengths on the host."""
        return AttentionMetadata(
            num_tokens=n,
            num_decodes=n,
            num_decode_tokens=n,
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            context_lens=self.context_lens[:n],
            block_tables=self.block_tables[:n, :width],
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_list=[1] * n,
            seq_lens_list=seq_lens,
        )

    def stage(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        seq_lens: Sequence[int],
        flat_tables: Sequence[int],
        width: int,
        padded_to: int,
        pending_at: Sequence[int] = (),
        pending_from: Sequence[int] = (),
        last_tokens: torch.Tensor | None = None,
    ) -> None:
        """A decode step of ``n = len(input_ids)`` rows straight from host lists: rows [n, padded_to)
        become padding, and the rows ``pending_at`` take ``last_tokens[pending_from]`` (the tokens the
        previous step drew, still on the device). ``flat_tables``: ``[n, width]`` row by row.

        Three host-to-device copies without blocking (from freshly pinned memory, so an earlier step's
        copies still in the queue keep their data), and the pending tokens' gather: in stream order
        after the graphs already issued, so a graph replayed before still reads its own step."""
        n, p = len(input_ids), len(pending_at)
        max_bs, max_width = self.block_tables.shape
        if not 0 < n <= padded_to <= max_bs:
            raise ValueError(f"{n} rows padded to {padded_to} do not fit the captured {max_bs}")
        if width > max_width:
            raise ValueError(f"block table of {width} blocks exceeds the captured {max_width}")
        a = np.zeros((5, max_bs), dtype=np.int64)
        a[0, :n] = input_ids
        a[1, :n] = positions
        a[2, :n] = slots
        a[2, n:] = -1  # padding writes nothing
        a[3, :p] = pending_at
        a[4, :p] = pending_from
        b = np.empty((2, max_bs), dtype=np.int32)
        b[0, :n] = seq_lens
        b[1, :n] = b[0, :n] - 1  # a decode's context before this step: all but the new token
        b[0, n:] = 1  # padding reads one slot of block 0
        b[1, n:] = 0
        self.i64.copy_(_host(a, self.i64.device), non_blocking=True)
        self.i32.copy_(_host(b, self.i32.device), non_blocking=True)
        full_rows = padded_to * max_width * 4 <= FULL_TABLE_ROWS_MAX_BYTES
        t = np.zeros((padded_to, max_width if full_rows else width), dtype=np.int32)
        t[:n, :width] = np.asarray(flat_tables, dtype=np.int32).reshape(n, width)
        # Unsent columns keep stale ids: kernels never read entries beyond ceil(seq_len / block).
        dst = self.block_tables[:padded_to] if full_rows else self.block_tables[:padded_to, :width]
        dst.copy_(_host(t, dst.device), non_blocking=True)
        if p:
            if last_tokens is None:
                raise ValueError(f"{p} pending tokens without the last step's tokens")
            self.input_ids.index_copy_(0, self.i64[3, :p], last_tokens.index_select(0, self.i64[4, :p]))


def _host(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor to copy to ``device``: pinned when that is a GPU (the copy then does not block)."""
    t = torch.from_numpy(a)
    return t.pin_memory() if device.type == "cuda" else t
