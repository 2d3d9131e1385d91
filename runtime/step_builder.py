"""Building one step's inputs: the flat token batch (decodes first, then prefill chunks), every tensor
the step needs (ids, positions, slot mapping, lengths, block tables, the backend's own indices), which
rows are sampled or scored, and which LoRA adapter owns which rows; or, for a decode-only step that a
captured graph replays, the same staged into the graph's input buffers."""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Any, Protocol

import torch

from servelm.runtime.attention.base import AttentionMetadata
from servelm.runtime.batch import PENDING_TOKEN, BatchItem, SequenceView
from servelm.runtime.lora_updates import KERNEL_MAX_ROWS
from servelm.runtime.step import LoRAStep, PromptScoring, StepInputs, extend_slots, is_decode, to_device

if TYPE_CHECKING:
    from servelm.runtime.attention.base import AttentionBackend
    from servelm.runtime.config import ModelConfig
    from servelm.runtime.lora_updates import LoRAContext


class CapturedSteps(Protocol):
    """The decode graphs as a step is staged into them (``cuda.graphs.CudaGraphRunner``)."""

    inputs: Any  # cuda.graph_inputs.GraphInputs: the buffers a step is staged into

    def can_run(self, num_decodes: int, num_tokens: int, block_table_width: int) -> bool: ...

    def padded(self, num_decodes: int) -> int: ...

    def returns_logits(self, num_decodes: int) -> bool: ...

    def replay(self, num_decodes: int) -> torch.Tensor: ...


class ModelRunner(Protocol):
    """What a step is built from (``runtime.runner.ModelRunner``): its limits, its device and kernels,
    and what its previous step left (the tokens a pending row takes, the LoRA context)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    model_config: ModelConfig
    block_size: int
    device: torch.device
    dtype: torch.dtype
    backend: AttentionBackend
    lora_context: LoRAContext | None
    lora_ids: set[int]
    last_tokens: torch.Tensor | None
    last_seqs: list[SequenceView]
    last_rows: dict[int, int] | None

    @property
    def graph_runner(self) -> CapturedSteps | None: ...


def build_step(runner: ModelRunner, items: list[BatchItem]) -> StepInputs:
    """Lay the step out (decodes first) and build its tensors and attention metadata, once."""
    bs = runner.block_size
    decodes: list[int] = []
    prefills: list[int] = []
    for i, it in enumerate(items):
        # Drafts are verified as decodes: one row per position (see below); so are decode_rows chunks.
        (decodes if is_decode(it) or it.draft or it.decode_rows else prefills).append(i)
    order = decodes + prefills
    if len(order) > runner.max_num_seqs:
        raise ValueError(f"step has {len(order)} sequences, max_num_seqs is {runner.max_num_seqs}")

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []  # whole block tables; each is cut to its used_blocks entry
    used_blocks: list[int] = []
    sample_rows: list[int] = []
    sample_items: list[int] = []
    score: PromptScoring | None = None
    pending_at: list[int] = []  # input rows whose token the last step sampled on the device
    pending_from: list[int] = []  # ... and the row of that step's tokens it is in
    num_decode_rows = 0
    for idx in order:
        item = items[idx]
        seq = item.seq
        start = seq.num_computed_tokens
        n = item.num_new_tokens
        end = start + n
        token_ids = seq.token_ids
        table = seq.block_table
        draft = item.draft
        if draft and (not item.sample or end - len(draft) != len(token_ids) or token_ids[-1] == PENDING_TOKEN):
            raise ValueError(f"seq {seq.seq_id}: {len(draft)} drafts must follow all of its {len(token_ids)} tokens")
        if n < 1 or end > len(token_ids) + len(draft or ()):
            raise ValueError(f"seq {seq.seq_id}: cannot compute tokens {start}..{end - 1} of {len(token_ids)}")
        used = -(-end // bs)
        if len(table) < used:
            raise ValueError(f"seq {seq.seq_id}: {len(table)} blocks cannot hold {end} tokens")
        if draft or item.decode_rows:
            # Its uncomputed tokens, then the drafts: one decode row per position, each attending up
            # to itself, so the decode kernels serve them (the prefill path would gather the whole
            # context every layer).
            rows = [*token_ids[start:end], *draft] if draft else token_ids[start:end]
            if item.decode_rows and PENDING_TOKEN in rows:  # drafts were checked above
                raise ValueError(f"seq {seq.seq_id}: a pending token among its decode rows")
            for pos, token in enumerate(rows, start):
                input_ids.append(token)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                query_lens.append(1)
                seq_lens.append(pos + 1)
                context_lens.append(pos)
                tables.append(table)
                used_blocks.append(-(-(pos + 1) // bs))
            num_decode_rows += n
            sampled = n if draft else int(item.sample)  # a decode_rows chunk samples its last row only
            sample_rows.extend(range(len(input_ids) - sampled, len(input_ids)))
            sample_items.extend([idx] * sampled)
            continue
        if n == 1:  # a decode (or a one-token chunk): no ranges to build
            token = token_ids[start]
            if token == PENDING_TOKEN:
                pending_at.append(len(input_ids))
                pending_from.append(_pending_row(runner, seq))
                token = 0
            input_ids.append(token)
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            if token_ids[end - 1] == PENDING_TOKEN:  # only ever a sequence's last token
                raise ValueError(f"seq {seq.seq_id}: a pending token inside a {n}-token chunk")
            input_ids.extend(token_ids[start:end])
            positions.extend(range(start, end))
            extend_slots(slots, table, start, end, bs)
        query_lens.append(n)
        seq_lens.append(end)
        context_lens.append(start)
        tables.append(table)
        used_blocks.append(used)
        if is_decode(item):
            num_decode_rows += 1
        if item.sample:
            sample_rows.append(len(input_ids) - 1)
            sample_items.append(idx)
        if item.score is not None:
            lo, hi = item.score
            if not start <= lo < hi <= min(end, seq.num_prompt_tokens - 1):
                raise ValueError(
                    f"seq {seq.seq_id}: cannot score positions {lo}..{hi - 1} in tokens {start}..{end - 1}"
                )
            if score is None:
                score = PromptScoring([], [], [], [])
            row0 = len(input_ids) - n - start
            score.rows.extend(range(row0 + lo, row0 + hi))
            score.targets.extend(token_ids[lo + 1 : hi + 1])
            score.ks.extend([int(seq.params.prompt_logprobs or 0)] * (hi - lo))
            score.items.append((idx, lo + 1, hi - lo))

    num_tokens = len(input_ids)
    if num_tokens > runner.max_num_batched_tokens:
        raise ValueError(f"step has {num_tokens} tokens, max_num_batched_tokens is {runner.max_num_batched_tokens}")
    max_seq_len = max(seq_lens)
    if max_seq_len > runner.model_config.max_position_embeddings:
        raise ValueError(
            f"sequence of {max_seq_len} tokens exceeds the model's "
            f"{runner.model_config.max_position_embeddings} positions"
        )
    width = max(used_blocks)
    flat_tables: list[int] = []  # [num_seqs, width] row by row, padded with block 0
    for table, used in zip(tables, used_blocks):
        flat_tables += table[:used]
        if used < width:
            flat_tables += [0] * (width - used)

    lora_plan = _lora_step(runner, items, order, num_tokens) if runner.lora_context is not None else None
    # A decode-only step that fits the captured shapes replays a graph: staged straight into its
    # input buffers (its metadata was built at capture, so the backend's per-step derivation is
    # skipped). The graphs hold no LoRA updates.
    shared = num_decode_rows != len(decodes)  # drafts' rows
    if (
        runner.graph_runner is not None
        and not shared
        and lora_plan is None
        and runner.graph_runner.can_run(len(decodes), num_tokens, width)
    ):
        staged = _stage_graph_step(
            runner, input_ids, positions, slots, seq_lens, flat_tables, width, pending_at, pending_from,
            order, sample_rows, sample_items,
        )  # fmt: skip
        staged.score = score
        return staged

    dev = runner.device
    ids_t, positions_t, slots_t, sample_rows_t, pending_at_t, pending_from_t = to_device(
        (input_ids, positions, slots, sample_rows, pending_at, pending_from), torch.int64, dev
    )
    if pending_at:
        assert runner.last_tokens is not None
        ids_t.index_copy_(0, pending_at_t, runner.last_tokens.index_select(0, pending_from_t))
    query_start_t, seq_lens_t, context_lens_t, tables_t = to_device(
        (list(accumulate(query_lens, initial=0)), seq_lens, context_lens, flat_tables), torch.int32, dev
    )
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_decodes=num_decode_rows,
        num_decode_tokens=num_decode_rows,
        slot_mapping=slots_t,
        query_start_loc=query_start_t,
        seq_lens=seq_lens_t,
        context_lens=context_lens_t,
        block_tables=tables_t.view(len(tables), width),
        max_query_len=max(query_lens),
        max_seq_len=max_seq_len,
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        decode_rows_share_sequences=shared,
    )
    return StepInputs(
        input_ids=ids_t,
        positions=positions_t,
        meta=runner.backend.build_metadata(meta),
        order=order,
        sample_rows=sample_rows_t,
        sample_items=sample_items,
        score=score,
        lora=lora_plan,
    )


def _lora_step(runner: ModelRunner, items: list[BatchItem], order: list[int], num_rows: int) -> LoRAStep | None:
    """Which adapter owns which rows of the step (each item's rows are consecutive, in ``order``)."""
    rows: dict[int, list[int]] = {}
    at = 0
    for idx in order:
        item = items[idx]
        n = item.num_new_tokens
        adapter_id = item.seq.lora_id
        if adapter_id:
            if adapter_id not in runner.lora_ids:
                raise ValueError(f"seq {item.seq.seq_id}: LoRA adapter {adapter_id} is not loaded")
            rows.setdefault(adapter_id, []).extend(range(at, at + n))
        at += n
    if not rows:
        return None
    ids = list(rows)
    assert runner.lora_context is not None
    if runner.lora_context.kernel is not None and runner.dtype == torch.float32 and num_rows <= KERNEL_MAX_ROWS:
        index = [-1] * num_rows
        for k, adapter_id in enumerate(ids):
            for r in rows[adapter_id]:
                index[r] = k
        return LoRAStep([(i, None) for i in ids], torch.tensor(index, dtype=torch.int32))
    if len(ids) == 1 and len(rows[ids[0]]) == num_rows:
        return LoRAStep([(ids[0], None)], None)
    return LoRAStep(list(zip(ids, to_device([rows[i] for i in ids], torch.int64, runner.device))), None)


def _pending_row(runner: ModelRunner, seq: SequenceView) -> int:
    """The row of the last sampling step that drew ``seq``'s pending token."""
    if runner.last_rows is None:
        runner.last_rows = {s.seq_id: r for r, s in enumerate(runner.last_seqs)}
    row = runner.last_rows.get(seq.seq_id)
    if row is None:
        raise ValueError(f"seq {seq.seq_id}: a pending token that the last step did not sample")
    return row


def _stage_graph_step(
    runner: ModelRunner,
    input_ids: list[int],
    positions: list[int],
    slots: list[int],
    seq_lens: list[int],
    flat_tables: list[int],
    width: int,
    pending_at: list[int],
    pending_from: list[int],
    order: list[int],
    sample_rows: list[int],
    sample_items: list[int],
) -> StepInputs:
    """A decode-only step staged into the graphs' input buffers (``GraphInputs.stage``); its
    tensors are views of them, valid until the next step is prepared."""
    g = runner.graph_runner
    assert g is not None
    n = len(input_ids)
    buf = g.inputs
    buf.stage(
        input_ids, positions, slots, seq_lens, flat_tables, width, g.padded(n),
        pending_at, pending_from, runner.last_tokens if pending_at else None,
    )  # fmt: skip
    if len(sample_rows) == n:  # every decode samples: rows 0..n-1
        sample_rows_t = buf.rows[:n]
    else:
        sample_rows_t = to_device((sample_rows,), torch.int64, runner.device)[0]
    meta = buf.metadata(n, width, seq_lens)
    return StepInputs(
        input_ids=buf.input_ids[:n],
        positions=buf.positions[:n],
        meta=meta,
        graph=True,
        order=order,
        sample_rows=sample_rows_t,
        sample_items=sample_items,
    )
