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
    pool = KVPool(
        num_layers=3, num_blocks=5, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu"
    )
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
    return int(re.search(rf"^{kind}:\s+(\d+) kB", text, re.M).group(1)) / 1024


def test_a_cpu_pool_is_resident_only_where_written() -> None:
    """A CPU pool costs memory as its blocks are written, like the tokens it holds, not its full size at
    start; what is never written still reads as zeros."""
    before, shared_before = resident_mib("RssAnon"), resident_mib("RssShmem")
    pool = KVPool(
        num_layers=4, num_blocks=1024, block_size=16, num_kv_heads=4, head_dim=256, dtype=torch.float16, device="cpu"
    )
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


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s whole pages that are resident (``mincore``), exact where RSS deltas are noisy."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


def test_released_blocks_of_some_layers_read_zero_and_leave_memory() -> None:
    """Sliding-window layers hand back the blocks every window has left: those layers' pages of those
    blocks are no longer resident and read 0 (never NaN), while every other layer and block keeps its
    values."""
    pool = KVPool(
        num_layers=3, num_blocks=64, block_size=16, num_kv_heads=1, head_dim=256, dtype=torch.float16, device="cpu"
    )
    assert pool.k_cache[0][0].nbytes == 8192  # two pages a block and layer, as Gemma 3 270M's
    for i, (k, v) in enumerate(zip(pool.k_cache, pool.v_cache)):
        k.fill_(i + 1.0)
        v.fill_(-(i + 1.0))
    before = [resident_bytes(t) for t in pool.k_cache + pool.v_cache]
    assert before == [64 * 8192] * 6
    released = [5, 3, 4, 40, 63]  # unsorted, runs of one and of three blocks
    pool.release(released, layers=(0, 2))
    after = [resident_bytes(t) for t in pool.k_cache + pool.v_cache]
    assert after == [59 * 8192, 64 * 8192, 59 * 8192] * 2, after
    kept = [b for b in range(64) if b not in released]
    for layer in (0, 2):
        for side in (pool.k_cache, pool.v_cache):
            assert not side[layer][released].any()
            assert side[layer][kept].abs().eq(layer + 1.0).all()
    assert pool.k_cache[1].eq(2.0).all() and pool.v_cache[1].eq(-2.0).all()
    # A released block written again (handed to another sequence) holds what is written.
    pool.k_cache[0][4].fill_(9.0)
    assert pool.k_cache[0][4].eq(9.0).all() and not pool.k_cache[0][3].any()


def test_a_release_never_touches_a_page_it_shares_with_a_kept_block() -> None:
    """Blocks smaller than a page: only whole pages inside a run of released blocks are handed back."""
    pool = KVPool(
        num_layers=1, num_blocks=64, block_size=4, num_kv_heads=1, head_dim=64, dtype=torch.float32, device="cpu"
    )
    assert pool.k_cache[0][0].nbytes == 1024  # four blocks a page
    pool.k_cache[0].fill_(1.0)
    pool.release([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], layers=(0,))  # page 0 holds kept block 0, page 2 kept block 11
    assert resident_bytes(pool.k_cache[0]) == 64 * 1024 - 4096  # page 1 (blocks 4-7) only
    assert pool.k_cache[0][[0, 1, 2, 3, 8, 9, 10, 11]].eq(1.0).all() and not pool.k_cache[0][4:8].any()


def test_copy_blocks_copies_k_and_v_of_every_layer_and_nothing_else() -> None:
    pool = KVPool(3, 6, 4, 2, 2, torch.float32, "cpu")
    for side in (pool.k_cache, pool.v_cache):
        for t in side:
            t.copy_(torch.randn_like(t))
    before = [t.clone() for t in pool.k_cache + pool.v_cache]
    pool.copy_blocks([(1, 4), (3, 0)])
    for t, old in zip(pool.k_cache + pool.v_cache, before):
        assert torch.equal(t[4], old[1]) and torch.equal(t[0], old[3])
        assert all(torch.equal(t[b], old[b]) for b in (1, 2, 3, 5))
    pool.copy_blocks([])  # nothing to copy: no op
