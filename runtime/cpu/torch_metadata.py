"""The CPU attention backend's per-step metadata (``torch_backend``): the indices and masks every layer
of a step reads, built once in ``build_metadata``, and the prefill layout chosen for the step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.runtime.attention.base import AttentionMetadata


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """``AttentionMetadata`` plus the gather indices and masks this backend derives once per step."""

    # K/V store: rows of this step's k/v and their slots (both None when no slot is -1).
    write_rows: torch.Tensor | None = None
    write_slots: torch.Tensor | None = None
    # Decode sequences: their block tables trimmed to the longest decode context (the kernel's input) ...
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int32
    # ... or, for the torch fallback, every slot of those blocks and an additive mask over them.
    decode_slots: torch.Tensor | None = None  # [num_decodes * decode_span] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, decode_span], 0 or -inf
    decode_span: int = 0
    # Prefill sequences (see ``build_prefill``). Both None: one fresh sequence, plain causal attention
    # over this step's own k/v. Flat layout: the slots of all their keys, concatenated, and a
    # [num_prefill_tokens, num_keys] block-diagonal causal mask. Padded layout (``prefill_batch`` set):
    # [n * max_k] slots, a [n, 1, max_q, max_k] mask, and the row indices into and out of the padded queries.
    prefill_slots: torch.Tensor | None = None  # int64
    prefill_mask: torch.Tensor | None = None  # bool, True = may attend
    prefill_batch: tuple[int, int, int] | None = None  # (sequences, max_q, max_k) when padded
    prefill_q_index: torch.Tensor | None = None  # [n * max_q] rows of the prefill queries (padding -> 0)
    prefill_out_index: torch.Tensor | None = None  # [num_prefill_tokens] rows of the padded output to keep
    # Tokens that belong to a sequence; rows past it are padding (slot -1).
    num_real_tokens: int = 0
    # Sliding windows: the prefill queries' and keys' positions, shaped to broadcast to the prefill
    # mask (before its head axis), and the masks narrowed to each window, built on first use.
    prefill_positions: tuple[torch.Tensor, torch.Tensor] | None = None
    window_masks: dict[tuple[str, int], torch.Tensor] | None = None


def build_prefill(m: TorchAttentionMetadata, block_size: int, q_chunk: int) -> None:
    """Choose the cheaper of two layouts for the prefill sequences' attention and index it.

    *flat*: all prefill queries against all their keys in one matrix under a block-diagonal causal
    mask (cost sum(q) x sum(k)); *padded*: one batch row per sequence, padded to the longest query
    and context (cost n x max(q) x max(k)). Many similar prompts favour padded, one long sequence
    next to short ones favours flat. One fresh sequence needs neither: plain causal attention.
    """
    bs = block_size
    nd = m.num_decodes
    dev = m.slot_mapping.device
    q_list = m.query_lens_list[nd:]
    s_list = m.seq_lens_list[nd:]
    n = len(q_list)
    if n == 1 and q_list[0] == s_list[0]:
        # prefill_mask None and no slots: is_causal over this step's own k/v
        pos = torch.arange(q_list[0], device=dev)
        m.prefill_positions = (pos.unsqueeze(1), pos.unsqueeze(0))
        return
    q_max, k_max, q_sum, k_sum = max(q_list), max(s_list), sum(q_list), sum(s_list)
    q_lens = torch.tensor(q_list, device=dev)
    s_lens = torch.tensor(s_list, device=dev)
    ctx = s_lens - q_lens
    span_blocks = -(-k_max // bs)
    offs = torch.arange(bs, device=dev)
    # [n, span]: the slot of every position of every prefill sequence (padded table entries -> block 0,
    # a harmless read of memory that is masked out).
    slots = (m.block_tables[nd:, :span_blocks].long().unsqueeze(-1) * bs + offs).reshape(n, span_blocks * bs)
    # Padded only while every context fits in one band: past that, flat attends in bands (fewer scores).
    if n > 1 and k_max <= q_chunk and n * q_max * k_max < q_sum * k_sum:
        j = torch.arange(q_max, device=dev).unsqueeze(0)  # [1, q_max]
        q_start = torch.cumsum(q_lens, 0) - q_lens
        q_valid = j < q_lens.unsqueeze(1)  # [n, q_max]
        # Padding query rows read row 0 and attend to key 0 only: finite, then dropped.
        m.prefill_q_index = torch.where(q_valid, q_start.unsqueeze(1) + j, 0).reshape(-1)
        m.prefill_out_index = torch.nonzero(q_valid.reshape(-1)).flatten()
        m.prefill_slots = slots[:, :k_max].reshape(-1)
        q_pos = torch.where(q_valid, ctx.unsqueeze(1) + j, 0)  # [n, q_max]
        k_pos = torch.arange(k_max, device=dev)
        m.prefill_mask = (k_pos.view(1, 1, k_max) <= q_pos.unsqueeze(-1)).unsqueeze(1)  # [n, 1, q_max, k_max]
        m.prefill_batch = (n, q_max, k_max)
        m.prefill_positions = (q_pos.unsqueeze(-1), k_pos.view(1, 1, k_max))
        return
    seq_ids = torch.arange(n, device=dev)
    q_seq = torch.repeat_interleave(seq_ids, q_lens)
    q_start = torch.cumsum(q_lens, 0) - q_lens
    q_pos = torch.arange(q_sum, device=dev) - q_start[q_seq] + ctx[q_seq]
    span = slots.shape[1]
    pos = torch.arange(span, device=dev).unsqueeze(0).expand(n, span)
    valid = pos < s_lens.unsqueeze(1)
    m.prefill_slots = slots[valid]  # row-major: sequence by sequence, position order
    k_seq = seq_ids.unsqueeze(1).expand(n, span)[valid]
    k_pos = pos[valid]
    causal = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    m.prefill_mask = causal if n == 1 else causal & (k_seq.unsqueeze(0) == q_seq.unsqueeze(1))
    m.prefill_positions = (q_pos.unsqueeze(1), k_pos.unsqueeze(0))


def window_mask(m: TorchAttentionMetadata, kind: str, window: int) -> torch.Tensor:
    """The step's ``kind`` mask ("prefill": bool, True = may attend; "decode": additive) narrowed to
    the last ``window`` positions of each query; built once per step and window."""
    masks = m.window_masks
    if masks is None:
        masks = m.window_masks = {}
    key = (kind, window)
    mask = masks.get(key)
    if mask is not None:
        return mask
    if kind == "decode":
        assert m.decode_mask is not None and m.decode_seq_lens is not None
        pos = torch.arange(m.decode_span, device=m.decode_mask.device).unsqueeze(0)
        early = pos < (m.decode_seq_lens.unsqueeze(1) - window)  # [nd, span]
        mask = m.decode_mask.masked_fill(early.view(m.decode_mask.shape), float("-inf"))
    else:
        assert m.prefill_positions is not None
        q_pos, k_pos = m.prefill_positions
        inside = k_pos > q_pos - window
        if m.prefill_mask is None:  # one fresh sequence: causal over its own tokens
            mask = (k_pos <= q_pos) & inside
        elif m.prefill_batch is not None:
            mask = m.prefill_mask & inside.unsqueeze(1)
        else:
            mask = m.prefill_mask & inside
    masks[key] = mask
    return mask


# ---- once per layer ------------------------------------------------------------------------
