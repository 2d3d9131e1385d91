"""The KV pool: layout, sizes, and independence of layers and blocks."""

from __future__ import annotations

import re
from pathlib import Path

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


def resident_mib(kind: str) -> float:
    """``RssAnon`` (private) or ``RssShmem`` of this process, in MiB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{kind}:\s+(\d+) kB", text, re.M).group(1)) / 1024  # type: ignore[union-attr]


def test_a_cpu_pool_is_resident_only_where_written() -> None:
    """A CPU pool costs memory as its blocks are written, like the tokens it holds, not its full size at
    start; what is never written still reads as zeros."""
    before, shared_before = resident_mib("RssAnon"), resident_mib("RssShmem")
    pool = KVPool(num_layers=4, num_blocks=1024, block_size=16, num_kv_heads=4, head_dim=256, dtype=torch.float16, device="cpu")
    assert pool.nbytes == 256 * 2**20
    allocated = resident_mib("RssAnon")
    assert allocated - before < 32, f"a 256 MiB pool made {allocated - before:.0f} MiB resident before any write"
    pool.k_cache[0][:256].fill_(1.0)  # 256 blocks of 32 KiB: 8 MiB
    pool.v_cache[3][7].fill_(2.0)
    assert not pool.k_cache[3].any() and not pool.v_cache[3][8:].any() and not pool.k_cache[0][256:].any()
    written = resident_mib("RssAnon") - before
    assert 6 < written < 40, f"8 MiB of written blocks made {written:.0f} MiB private memory resident"
    shared = resident_mib("RssShmem") - shared_before
    assert shared < 2, f"the pool is private memory, not {shared:.0f} MiB of shared memory"
    assert pool.k_cache[0][255].sum().item() == 16 * 4 * 256 and pool.v_cache[3][7].sum().item() == 2 * 16 * 4 * 256
