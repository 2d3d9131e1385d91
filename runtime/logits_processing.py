"""Logit processing before sampling: the edits OpenAI/vLLM users expect, in their order.

structured-output mask -> logit_bias -> min_tokens -> repetition penalty -> presence/frequency
penalties. The mask reads one bit per token of each constrained row; every other step touches only
the (row, token) positions concerned (gathered/scattered through flat indices built in one go), so
its cost follows the number of tokens involved, not the vocabulary. A batch that uses none of them
pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from servelm.runtime.batch import LogitBias, SequenceView
from servelm.runtime.platform import platform_of


def process_logits(logits: torch.Tensor, seqs: Sequence[SequenceView]) -> None:
    """Apply the structured-output mask, logit_bias, min_tokens, repetition and presence/frequency
    penalties in place.

    ``logits`` must be contiguous [R, V]; row i belongs to ``seqs[i]``. Rows that use none of
    these are untouched, and a batch where none does costs only a scan of the parameters.
    """
    _n_rows, vocab = logits.shape
    flat = logits.view(-1)
    device = logits.device
    platform = platform_of(device)
    params = [s.params for s in seqs]

    biases: list[tuple[int, LogitBias]] = []
    suppress: list[tuple[int, list[int]]] = []
    rep_rows: list[int] = []
    pf_rows: list[int] = []
    masked: list[int] = []
    for i, (s, p) in enumerate(zip(seqs, params)):
        if s.grammar is not None:
            masked.append(i)
        if p.logit_bias:
            bias = p.logit_bias_tensors
            if bias is not None:
                biases.append((i, bias))
        if p.min_tokens > 0 and len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
            stops = [t for t in s.stop_token_ids_for_min_tokens if 0 <= t < vocab]
            if stops:
                suppress.append((i, stops))
        if p.repetition_penalty != 1.0:
            rep_rows.append(i)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            pf_rows.append(i)

    if masked:
        bitmask = torch.empty(len(masked), (vocab + 31) // 32, dtype=torch.int32)
        for j, i in enumerate(masked):
            seqs[i].grammar.fill_bitmask(bitmask, j)  # type: ignore[union-attr]
        apply_token_bitmask(logits, platform.host_to_device(masked, device), platform.host_to_device(bitmask, device))
    if biases:
        pos, val = _bias_positions(biases, vocab)
        flat.index_add_(0, platform.host_to_device(pos, device), platform.host_to_device(val, device).to(logits.dtype))
    if suppress:
        # min_tokens yields where it would forbid every token left (a structured output that must
        # end now): a row of -inf has no distribution to draw from.
        mask_row = {i: j for j, i in enumerate(masked)}
        at = [
            i * vocab + t
            for i, stops in suppress
            if _leaves_a_token(stops, vocab, bitmask[mask_row[i]] if i in mask_row else None)
            for t in stops
        ]
        if at:
            flat.index_fill_(0, platform.host_to_device(at, device), float("-inf"))
    if rep_rows:
        # CTRL / HF definition over prompt + output: shrink towards zero by r (grow if r < 1).
        pos, row_of = _flat_token_positions(seqs, rep_rows, vocab, output_only=False)
        if pos.numel():
            pos, row_of = platform.host_to_device(pos, device), platform.host_to_device(row_of, device)
            info = torch.finfo(logits.dtype)
            # An r below the dtype's range (the range is (0, 10]: 5e-324 is 0 in float32) counts as
            # its smallest normal number: r = 0 would turn a masked -inf into NaN, which argmax picks.
            r = platform.host_to_device([p.repetition_penalty for p in params], device, logits.dtype)[row_of].clamp_(
                min=info.tiny
            )
            vals = flat[pos]
            # Duplicate positions all write the same value. A tiny r would push a positive logit to
            # inf, and the softmax to NaN: stay at the largest finite value. A token a structured
            # output or min_tokens forbade (-inf) stays forbidden.
            new = torch.where(vals < 0, vals * r, vals / r).clamp_(-info.max, info.max)
            flat[pos] = torch.where(vals == float("-inf"), vals, new)
    if pf_rows:
        # OpenAI definition over output tokens: logit -= count * frequency + (count > 0) * presence.
        pos, _ = _flat_token_positions(seqs, pf_rows, vocab, output_only=True)
        if pos.numel():
            # Count each position's occurrences without ``unique``, whose output size the host
            # would have to wait for: sort, number the runs, count per run (at most n runs).
            pos = torch.sort(platform.host_to_device(pos, device)).values
            first = torch.ones_like(pos, dtype=torch.bool)
            first[1:] = pos[1:] != pos[:-1]
            run = torch.cumsum(first, 0) - 1
            counts = torch.zeros(pos.numel(), dtype=logits.dtype, device=device).index_add_(
                0, run, torch.ones(pos.numel(), dtype=logits.dtype, device=device)
            )
            row_of = pos // vocab
            freq = platform.host_to_device([p.frequency_penalty for p in params], device, logits.dtype)
            pres = platform.host_to_device([p.presence_penalty for p in params], device, logits.dtype)
            # Each position once (at the first of its run); the rest of a run adds exactly 0.
            delta = torch.where(first, counts[run] * freq[row_of] + pres[row_of], 0.0)
            flat.index_add_(0, pos, -delta)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[j], t]`` to -inf wherever bit t % 32 of ``bitmask[j, t // 32]`` is clear.

    ``bitmask`` [len(rows), ceil(V / 32)] int32, on the logits' device (one bit per token: 6 KB a row
    for 49,152 tokens, where a boolean mask would be 48 KB to copy to a GPU).
    """
    kernel = platform_of(logits.device).token_bitmask_kernel() if logits.dtype == torch.float32 else None
    if kernel is not None:
        kernel(logits, rows, bitmask)
        return
    n, v = len(rows), logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: no host copy to wait for
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(n, -1)[:, :v].bool()
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


def _bias_positions(biases: list[tuple[int, LogitBias]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions ``row * V + token`` and values of the rows' logit_bias, each in one CPU tensor."""
    ids, values = [], []
    for _, b in biases:
        t, v = b.token_ids, b.values
        if b.lowest < 0 or b.highest >= vocab:  # ids outside the vocabulary (only unvalidated options) are ignored
            keep = (t >= 0) & (t < vocab)
            t, v = t[keep], v[keep]
        ids.append(t)
        values.append(v)
    if len(biases) == 1:
        return ids[0] + biases[0][0] * vocab, values[0]
    offsets = torch.tensor([i * vocab for i, _ in biases], dtype=torch.int64)
    return torch.cat(ids) + offsets.repeat_interleave(torch.tensor([len(t) for t in ids])), torch.cat(values)


def _leaves_a_token(stops: list[int], vocab: int, bitmask_row: torch.Tensor | None) -> bool:
    """Whether a row may still take a token once ``stops`` are forbidden (the structured output's
    ``bitmask_row`` allowing, or every token without one)."""
    if bitmask_row is None:
        return len(set(stops)) < vocab
    allowed = ((bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab].bool()
    allowed[stops] = False
    return bool(allowed.any())


def _flat_token_positions(
    seqs: Sequence[SequenceView], rows: list[int], vocab_size: int, output_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices ``row * V + token`` of every token (or output token) of ``seqs[rows]``, and each one's row."""
    lists = [seqs[i].token_ids[seqs[i].num_prompt_tokens :] if output_only else seqs[i].token_ids for i in rows]
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor([len(t) for t in lists]))
    return row_of * vocab_size + ids, row_of
