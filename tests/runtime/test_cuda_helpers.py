"""CPU-checkable parts of the CUDA path: the CUDA-graph size ladder and buffers, KV budget arithmetic."""

from __future__ import annotations

import pytest
import torch

from runtime.cuda_graphs import GraphInputs, capture_sizes, padded_size
from runtime.gpu_memory import MemoryProfile

GiB = 2**30


def test_capture_sizes_double_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_a_batch_pads_to_the_next_captured_size() -> None:
    sizes = capture_sizes(48)
    assert [padded_size(sizes, n) for n in (1, 3, 8, 9, 33, 48)] == [1, 4, 8, 16, 48, 48]
    assert padded_size(sizes, 49) is None


def test_fill_copies_real_rows_and_neutralises_padding() -> None:
    buf = GraphInputs.allocate(8, 4, torch.device("cpu"))
    # Leftovers from a previous, larger step.
    buf.slot_mapping.fill_(123)
    buf.seq_lens.fill_(50)
    buf.block_tables.fill_(7)
    buf.fill(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([10, 3, 0]),
        slot_mapping=torch.tensor([42, 19, 0]),
        seq_lens=torch.tensor([11, 4, 1], dtype=torch.int32),
        block_tables=torch.tensor([[2, 9], [4, 0], [1, 0]], dtype=torch.int32),
        padded_to=4,
    )
    assert buf.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert buf.slot_mapping[:4].tolist() == [42, 19, 0, -1]
    assert buf.seq_lens[:4].tolist() == [11, 4, 1, 1]
    assert buf.context_lens[:4].tolist() == [10, 3, 0, 0]
    assert buf.block_tables[:3, :2].tolist() == [[2, 9], [4, 0], [1, 0]]
    assert buf.block_tables[3, 0] == 0
    assert buf.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        buf.fill(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                 torch.ones(1, dtype=torch.int32), torch.zeros(1, 5, dtype=torch.int32), padded_to=1)


def test_kv_budget_is_the_allowed_fraction_minus_everything_else() -> None:
    prof = MemoryProfile(total=100 * GiB, torch_peak=20 * GiB, non_torch=2 * GiB, scratch=1 * GiB)
    # 90 allowed - (20 - 1) torch peak without the scratch pool - 2 outside torch - 1 reserved.
    assert prof.kv_budget(0.9, reserve_bytes=1 * GiB) == 68 * GiB
    assert prof.kv_budget(0.2) < 0
    assert "KV" in prof.describe(0.9)
