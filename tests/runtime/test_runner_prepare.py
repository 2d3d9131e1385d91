"""ModelRunner.prepare: the step's tensors (packed into one buffer per dtype) against per-token formulas."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.runtime.attention.base import AttentionMetadata
from servelm.runtime.batch import BatchItem
from servelm.runtime.runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner]) -> ModelRunner:
    return build_runner(tiny_llama_dir, num_blocks=512, max_num_batched_tokens=1024, max_num_seqs=64)


def reference(items: list[BatchItem], bs: int) -> dict[str, Any]:
    """What prepare must produce, token by token, in computed order (decodes first)."""
    decode = [i for i, it in enumerate(items) if it.num_new_tokens == 1 and it.seq.num_computed_tokens > 0]
    order = decode + [i for i in range(len(items)) if i not in decode]
    ids, pos, slots, qlens, slens, rows, sampled, tables = [], [], [], [], [], [], [], []
    for i in order:
        it = items[i]
        s = it.seq
        start, end = s.num_computed_tokens, s.num_computed_tokens + it.num_new_tokens
        for p in range(start, end):
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        qlens.append(it.num_new_tokens)
        slens.append(end)
        tables.append(s.block_table[: -(-end // bs)])
        if it.sample:
            rows.append(len(ids) - 1)
            sampled.append(i)
    width = max(len(t) for t in tables)
    return dict(
        order=order,
        num_decodes=len(decode),
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        query_lens=qlens,
        seq_lens=slens,
        query_start_loc=[sum(qlens[:k]) for k in range(len(qlens) + 1)],
        context_lens=[s - q for s, q in zip(slens, qlens)],
        block_tables=[t + [0] * (width - len(t)) for t in tables],
        sample_rows=rows,
        sample_items=sampled,
    )


def random_step(rng: random.Random, bs: int, free: list[int], rt: Any) -> list[BatchItem]:
    """Decodes and prefill chunks (fresh, continued, one-token) with scattered blocks and spare blocks."""
    items = []
    for seq_id in range(rng.randint(1, 12)):
        computed = rng.choice([0, rng.randint(1, 100)])
        new = rng.choice([1, 1, 1, rng.randint(1, 40)])
        total = computed + new + rng.randint(0, 1)  # sometimes a token beyond this chunk
        table = [free.pop() for _ in range(-(-(computed + new) // bs) + rng.randint(0, 2))]
        ids = [rng.randrange(3, 49152) for _ in range(total)]
        seq = rt.FakeSeq(seq_id=seq_id, token_ids=ids, num_computed_tokens=computed, block_table=table)
        items.append(BatchItem(seq, new, sample=computed + new == total))
    return items


@pytest.mark.parametrize("seed", range(6))
def test_prepare_matches_the_per_token_layout(runner: ModelRunner, rt: Any, seed: int) -> None:
    rng = random.Random(seed)
    bs = runner.block_size
    free = list(range(runner.kv_pool.num_blocks))
    rng.shuffle(free)
    items = random_step(rng, bs, free, rt)
    ref = reference(items, bs)
    with torch.inference_mode():
        inputs = runner.prepare(items)
    m = inputs.meta
    assert isinstance(m, AttentionMetadata)
    assert inputs.order == ref["order"] and inputs.sample_items == ref["sample_items"]
    assert m.num_decodes == m.num_decode_tokens == ref["num_decodes"]
    assert m.num_tokens == len(ref["input_ids"])
    assert m.query_lens_list == ref["query_lens"] and m.seq_lens_list == ref["seq_lens"]
    assert m.max_query_len == max(ref["query_lens"]) and m.max_seq_len == max(ref["seq_lens"])
    tensors = {
        "input_ids": (inputs.input_ids, torch.int64),
        "positions": (inputs.positions, torch.int64),
        "sample_rows": (inputs.sample_rows, torch.int64),
        "slot_mapping": (m.slot_mapping, torch.int64),
        "query_start_loc": (m.query_start_loc, torch.int32),
        "seq_lens": (m.seq_lens, torch.int32),
        "context_lens": (m.context_lens, torch.int32),
        "block_tables": (m.block_tables, torch.int32),
    }
    for name, (t, dtype) in tensors.items():
        assert t.dtype == dtype, name
        assert t.device == runner.device, name
        assert t.is_contiguous(), name
        assert t.tolist() == ref[name], name
        # Packed segments start where a tensor of their own would (kernels may assume alignment).
        assert (t.storage_offset() * t.element_size()) % 64 == 0, name


def test_a_decode_only_step_packs_one_value_per_sequence(runner: ModelRunner, rt: Any) -> None:
    bs = runner.block_size
    seqs = [
        rt.FakeSeq(seq_id=i, token_ids=list(range(10, 10 + n)), num_computed_tokens=n - 1, block_table=[7 + i, 90 - i])
        for i, n in enumerate([17, 20, 32])
    ]
    with torch.inference_mode():
        inputs = runner.prepare([BatchItem(s, 1, sample=True) for s in seqs])
    m = inputs.meta
    assert inputs.input_ids.tolist() == [s.token_ids[-1] for s in seqs]
    assert inputs.positions.tolist() == [16, 19, 31]
    assert m.slot_mapping.tolist() == [(90 - i) * bs + p % bs for i, p in enumerate([16, 19, 31])]
    assert m.block_tables.tolist() == [[7, 90], [8, 89], [9, 88]]
    assert m.context_lens.tolist() == [16, 19, 31] and m.seq_lens.tolist() == [17, 20, 32]
    assert inputs.sample_rows.tolist() == [0, 1, 2]
