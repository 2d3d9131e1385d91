"""What a model step takes in and gives out: the flat step inputs the runner builds, the launched
step, and its output on the way to the host; plus the helpers that lay integer lists out on a device.

``runtime.runner.ModelRunner`` builds and consumes these; they are plain data, kept apart so the
runner module holds the runner itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from servelm.runtime.attention.base import AttentionMetadata
from servelm.runtime.batch import BatchItem, PromptLogprobs, RunnerOutput, TokenLogprobs
from servelm.runtime.platform import platform_of
from servelm.runtime.sampled_rows import LogprobTensors, SampledRows


@dataclass
class StepInputs:
    """The flat tensors of one step, in computed order (decodes first)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # as returned by the backend's build_metadata
    order: list[int]  # order[i] = index in the caller's item list of the i-th computed sequence
    sample_rows: torch.Tensor  # [R] int64: the hidden rows to sample (last token of each sampling item)
    sample_items: list[int]  # caller's item index of each sampled row
    # replay a captured CUDA graph: the tensors are views of its staged inputs, ``meta`` is unbuilt
    graph: bool = False
    score: PromptScoring | None = None  # prompt rows to score (items with ``score``)
    lora: LoRAStep | None = None  # when rows use LoRA adapters: what the forward's LoRAContext holds


@dataclass
class LoRAStep:
    """A step's adapter rows (``runtime.lora.LoRAContext.set``)."""

    plan: list[
        tuple[int, torch.Tensor | None]
    ]  # (adapter id, its rows; None: every row, or the kernel's row_adapter says)
    row_adapter: torch.Tensor | None  # int32 [T]: index into plan, -1 none (the compiled kernel's form)


@dataclass
class PromptScoring:
    """The rows of a step whose logits score prompt tokens: row ``rows[j]`` scores token ``targets[j]``."""

    rows: list[int]
    targets: list[int]
    ks: list[int]  # alternatives asked, per row
    items: list[tuple[int, int, int]]  # (caller's item index, first scored token's index, rows)


@dataclass
class LaunchedStep:
    """A step whose forward has been issued (on a GPU it may still be running)."""

    items: list[BatchItem]
    inputs: StepInputs
    # [T, hidden], or [T, vocab] when ``logits`` (a CUDA graph with the head inside); a graph's output
    # is its static buffer: sample before the next launch
    hidden: torch.Tensor
    logits: bool = False


class StepOutput:
    """A step's sampled tokens on their way to the host; ``result`` waits for them.

    ``errors`` (known at once, on the host): the items whose sampling raised, by item index.
    """

    def __init__(
        self,
        num_items: int,
        sample_items: list[int],
        rows: SampledRows | None,
        ready: torch.cuda.Event | None = None,
        scored: tuple[PromptScoring, list[LogprobTensors]] | None = None,
    ) -> None:
        self._num_items = num_items
        self._sample_items = sample_items
        self._rows = rows
        self._ready = ready  # recorded after the device-to-host copies (GPU only)
        self._scored = scored  # prompt logprobs, still where they were computed
        self.errors: dict[int, Exception] = {}
        if rows is not None and rows.errors:
            for r, e in rows.errors.items():  # a draft's rows belong to its item: one failed row fails it
                self.errors.setdefault(sample_items[r], e)

    def result(self) -> RunnerOutput:
        """One entry per item, in item order (see ``RunnerOutput``)."""
        n = self._num_items
        tokens: list[int | None] = [None] * n
        logprobs: list[TokenLogprobs | None] = [None] * n
        if self._ready is not None:
            self._ready.synchronize()  # this step's copies only, not the work issued after them
        drafts: list[list[tuple[int, TokenLogprobs | None]] | None] | None = None
        if self._rows is not None:
            ids, lps = self._rows.resolve()
            items = self._sample_items
            if self.errors:
                keep = [r for r, i in enumerate(items) if i not in self.errors]
                items, ids, lps = [items[r] for r in keep], [ids[r] for r in keep], [lps[r] for r in keep]
            last = -1
            for i, tok, lp in zip(items, ids, lps):
                if i != last:
                    tokens[i] = tok
                    logprobs[i] = lp
                    last = i
                else:  # a draft's row: what the model samples after that draft
                    if drafts is None:
                        drafts = [None] * n
                    entry = drafts[i]
                    if entry is None:
                        entry = drafts[i] = []
                    entry.append((tok, lp))
        return RunnerOutput(tokens, logprobs, self._prompt_logprobs(), drafts, self.errors or None)

    def _prompt_logprobs(self) -> list[PromptLogprobs | None] | None:
        if self._scored is None:
            return None
        score, parts = self._scored
        entries: list[TokenLogprobs | None] = []
        for part in parts:
            entries += part.resolve(len(part.rows))
        out: list[PromptLogprobs | None] = [None] * self._num_items
        at = 0
        for i, first, n in score.items:
            out[i] = PromptLogprobs(first, entries[at : at + n])  # type: ignore[arg-type]  # every row resolves
            at += n
        return out


def is_decode(item: BatchItem) -> bool:
    """One new token on top of a cached context: served by the decode attention path."""
    return item.num_new_tokens == 1 and item.seq.num_computed_tokens > 0


# Where each segment starts inside a packed buffer, in bytes: as aligned as a tensor of its own would
# be for what reads it (vectorised loads; Triton specialises kernels on 16-byte pointer alignment).
_SEGMENT_ALIGN_BYTES = 64
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the pool slots of positions ``start..end-1``: one range per block, not a division per token."""
    p = start
    while p < end:
        block, offset = divmod(p, block_size)
        k = min(block_size - offset, end - p)
        first = table[block] * block_size + offset
        slots.extend(range(first, first + k))
        p += k


def to_device(segments: Sequence[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The integer lists as 1-D tensors on ``device``: views of one buffer filled by one copy.

    Per-list ``torch.tensor(..., device=cuda)`` calls would each be a synchronous copy from pageable
    memory; here one host array is built (through NumPy: several times faster than ``torch.tensor`` on
    a list), pinned on CUDA, and copied without blocking the host. The caching host allocator keeps
    the pinned block from being reused until that copy has run.
    """
    align = _SEGMENT_ALIGN_BYTES // dtype.itemsize
    flat: list[int] = []
    bounds: list[tuple[int, int]] = []
    for seg in segments:
        flat += [0] * (-len(flat) % align)
        bounds.append((len(flat), len(flat) + len(seg)))
        flat += seg
    buf = torch.from_numpy(np.array(flat, dtype=_NUMPY_DTYPES[dtype]))
    buf = platform_of(device).host_to_device(buf, device)
    return [buf[a:b] for a, b in bounds]
