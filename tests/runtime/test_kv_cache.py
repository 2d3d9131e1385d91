"""The KV pool: layout, sizes, and independence of layers and blocks."""

from __future__ import annotations

import pytest
import torch

from servelm.runtime.capacity import kv_bytes_per_token
from servelm.runtime.config import ModelConfig
from servelm.runtime.kv_cache import KVPool


def test_layout_and_sizes() -> None:
    pool = KVPool(num_layers=3, num_blocks=5, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    assert len(pool.k_cache) == len(pool.v_cache) == 3
    for t in pool.k_cache + pool.v_cache:
        assert t.shape == (5, 16, 2, 8) and t.dtype == torch.float32 and t.is_contiguous()
        assert not t.any()  # zero-filled: masked positions never hold NaN garbage
    assert pool.bytes_per_token == 2 * 3 * 2 * 8 * 4
    assert pool.nbytes == 5 * 16 * pool.bytes_per_token
    assert pool.num_slots == 80


def test_layers_and_k_v_do_not_alias() -> None:
    pool = KVPool(2, 4, 4, 1, 2, torch.float32, "cpu")
    pool.k_cache[1][2, 3] = 7.0
    assert pool.k_cache[1].sum() == 14.0
    assert pool.k_cache[0].sum() == 0 and pool.v_cache[1].sum() == 0 and pool.v_cache[0].sum() == 0
    # A flat slot view (what backends write through) addresses block * block_size + offset.
    assert pool.k_cache[1].view(-1, 1, 2)[2 * 4 + 3].tolist() == [[7.0, 7.0]]


def test_bytes_per_token_matches_capacity_planning(default_model_dir) -> None:
    cfg = ModelConfig.from_dir(default_model_dir)
    pool = KVPool(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    assert pool.bytes_per_token == kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 30 * 3 * 64 * 2


def test_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError):
        KVPool(2, 0, 16, 1, 8, torch.float32, "cpu")
