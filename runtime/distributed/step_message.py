"""One step's inputs from rank 0 to the other ranks: one broadcast of int64s for a step whose
tensors fit ``INLINE`` ints (every decode step of a usual batch), two for a larger one.

What is sent is the flat batch the runner built (``runtime.step_builder``): input ids (pending
tokens already resolved), positions, slot mapping, query starts, sequence and context lengths,
block tables and the sampled rows. Each rank derives its attention backend's own indices from it
(``build_metadata``), as rank 0 did; nothing that only the scheduler knows is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.runtime.attention.base import AttentionMetadata
from servelm.runtime.distributed.comm import Communicator
from servelm.runtime.step import StepInputs

FORWARD = 1
RELEASE = 2  # rank 0 is done with this model: the other ranks leave their step loop
HEADER_LEN = (
    10  # command, tokens, sequences, block-table width, sampled rows, decodes, max query, max seq, shared, scored rows
)
# Payload ints carried inside the first broadcast: each collective costs a wake-up of every rank,
# which on a loaded CPU is most of its price, so a small step saves its second one.
INLINE = 512


@dataclass
class ReceivedStep:
    """A step as the non-zero ranks see it: the model's inputs and the rows whose logits are gathered."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata  # the base fields; the rank's backend adds its own
    sample_rows: torch.Tensor
    score_rows: (
        torch.Tensor
    )  # rows whose logits score prompt tokens (prompt logprobs), gathered before the sampled ones


def send_step(comm: Communicator, inputs: StepInputs) -> None:
    """Rank 0: broadcast ``inputs`` (unbuilt CUDA-graph steps are never sent: TP runs eagerly)."""
    m = inputs.meta
    width = m.block_tables.shape[1]
    scored = torch.tensor(inputs.score.rows if inputs.score is not None else [], dtype=torch.int64)
    header = [FORWARD, m.num_tokens, m.num_seqs, width, inputs.sample_rows.numel(), m.num_decodes,
              m.max_query_len, m.max_seq_len, int(m.decode_rows_share_sequences), scored.numel()]  # fmt: skip
    parts = (inputs.input_ids, inputs.positions, m.slot_mapping, m.query_start_loc, m.seq_lens, m.context_lens,
             m.block_tables.reshape(-1), inputs.sample_rows, scored)  # fmt: skip
    payload = torch.cat([p.to(torch.int64) for p in parts])
    first = torch.zeros(HEADER_LEN + INLINE, dtype=torch.int64)
    first[:HEADER_LEN] = torch.tensor(header, dtype=torch.int64)
    n = payload.numel()
    if n <= INLINE:
        first[HEADER_LEN : HEADER_LEN + n] = payload
        comm.broadcast(first, idle=True)
    else:
        comm.broadcast(first, idle=True)
        comm.broadcast(payload)


def send_release(comm: Communicator) -> None:
    first = torch.zeros(HEADER_LEN + INLINE, dtype=torch.int64)
    first[0] = RELEASE
    comm.broadcast(first, idle=True)


def receive_step(comm: Communicator) -> ReceivedStep | None:
    """Ranks 1..N-1: the next step rank 0 sends, or None when it releases the model."""
    first = comm.broadcast(
        torch.empty(HEADER_LEN + INLINE, dtype=torch.int64), idle=True
    )  # waits for rank 0's next step
    command, t, s, width, r, num_decodes, max_query_len, max_seq_len, shared, k = first[:HEADER_LEN].tolist()
    if command == RELEASE:
        return None
    if command != FORWARD:
        raise RuntimeError(f"unknown tensor-parallel command {command}")
    sizes = [t, t, t, s + 1, s, s, s * width, r, k]
    total = sum(sizes)
    if total <= INLINE:
        payload = first[HEADER_LEN : HEADER_LEN + total]
    else:
        payload = comm.broadcast(torch.empty(total, dtype=torch.int64))
    ids, positions, slots, query_start, seq_lens, context_lens, tables, rows, scored = payload.split(sizes)
    query_start_i = query_start.to(torch.int32)
    seq_lens_i = seq_lens.to(torch.int32)
    meta = AttentionMetadata(
        num_tokens=t,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        slot_mapping=slots,
        query_start_loc=query_start_i,
        seq_lens=seq_lens_i,
        context_lens=context_lens.to(torch.int32),
        block_tables=tables.to(torch.int32).view(s, width),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_lens_list=query_start.diff().tolist(),
        seq_lens_list=seq_lens.tolist(),
        decode_rows_share_sequences=bool(shared),
    )
    return ReceivedStep(ids, positions, meta, rows, scored)
