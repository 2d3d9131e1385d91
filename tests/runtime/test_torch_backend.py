"""The torch attention backend against a naive per-sequence reference, both decode paths included."""

from __future__ import annotations

import random

import pytest
import torch

from servelm.runtime.attention.base import AttentionMetadata
from servelm.runtime.cpu.torch_backend import TorchAttentionBackend

BS = 16
H, KVH, D = 6, 2, 16


def make_meta(ctx: list[int], new: list[int], tables: list[list[int]], pad_slots: int = 0) -> AttentionMetadata:
    """Metadata as the runner lays it out: sequences with ``new == 1 and ctx > 0`` must come first."""
    slots: list[int] = []
    for c, n, t in zip(ctx, new, tables):
        slots += [t[p // BS] * BS + p % BS for p in range(c, c + n)]
    slots += [-1] * pad_slots
    seq_lens = [c + n for c, n in zip(ctx, new)]
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    nd = sum(1 for c, n in zip(ctx, new) if n == 1 and c > 0)
    return AttentionMetadata(
        num_tokens=len(slots),
        num_decodes=nd,
        num_decode_tokens=nd,
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
        query_lens_list=list(new),
        seq_lens_list=seq_lens,
    )


def reference(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    vals: list[torch.Tensor],
    ctx: list[int],
    new: list[int],
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Per-sequence attention with repeated KV heads and an explicit causal-offset mask (and, with a
    window, only the last ``window`` positions, the query's own included)."""
    outs, row = [], 0
    for kk, vv, c, n in zip(keys, vals, ctx, new):
        qq = q[row : row + n]
        row += n
        kr = kk.repeat_interleave(H // KVH, dim=1)  # [L, H, D]
        vr = vv.repeat_interleave(H // KVH, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kr) * scale
        qpos = torch.arange(c, c + n)[:, None]
        s = s.masked_fill(torch.arange(c + n)[None, :] > qpos, float("-inf"))
        if window:
            s = s.masked_fill(torch.arange(c + n)[None, :] <= qpos - window, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vr))
    return torch.cat(outs)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel_if_built", "torch_fallback"])
@pytest.mark.parametrize("seed", range(10))  # covers every layout: causal, flat (1 and n), padded
def test_matches_reference_on_random_batches(use_kernel: bool, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BS, KVH, D)
    v_cache = torch.zeros(num_blocks, BS, KVH, D)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # decodes first, then prefills (some with cached context, some fresh)
    n_dec, n_pre = rng.randint(0, 4), rng.randint(0 if seed else 1, 3)
    ctx = [rng.randint(1, 70) for _ in range(n_dec)] + [rng.choice([0, rng.randint(1, 40)]) for _ in range(n_pre)]
    new = [1] * n_dec + [rng.randint(2, 30) for _ in range(n_pre)]
    if not ctx:
        ctx, new = [0], [5]
    tables, keys, vals = [], [], []
    for c, n in zip(ctx, new):
        t = [free.pop() for _ in range(-(-(c + n) // BS))]
        tables.append(t)
        k_all, v_all = torch.randn(c + n, KVH, D), torch.randn(c + n, KVH, D)
        for p in range(c):  # the cached context, already in the pool
            k_cache[t[p // BS], p % BS] = k_all[p]
            v_cache[t[p // BS], p % BS] = v_all[p]
        keys.append(k_all)
        vals.append(v_all)
    pad = 2 if seed % 2 else 0  # padded rows (slot -1) must write nothing
    meta = make_meta(ctx, new, tables, pad_slots=pad)
    k_new = torch.cat([kk[c:] for kk, c in zip(keys, ctx)] + [torch.full((pad, KVH, D), float("nan"))])
    v_new = torch.cat([vv[c:] for vv, c in zip(vals, ctx)] + [torch.full((pad, KVH, D), float("nan"))])
    q = torch.randn(meta.num_tokens, H, D)
    backend = TorchAttentionBackend(BS, use_kernel=use_kernel)
    scale = D**-0.5
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, backend.build_metadata(meta), scale)
    real = meta.num_tokens - pad
    torch.testing.assert_close(out[:real], reference(q[:real], keys, vals, ctx, new, scale), atol=1e-5, rtol=1e-5)
    assert not torch.isnan(k_cache).any() and not torch.isnan(v_cache).any()
    for kk, vv, t in zip(keys, vals, tables):  # every token's K/V now sits at its slot
        for p in range(kk.shape[0]):
            assert torch.equal(k_cache[t[p // BS], p % BS], kk[p])
            assert torch.equal(v_cache[t[p // BS], p % BS], vv[p])


def test_fresh_single_prefill_needs_no_gather_or_mask() -> None:
    backend = TorchAttentionBackend(BS, use_kernel=False)
    m = backend.build_metadata(make_meta([0], [20], [[3, 9]]))
    assert m.prefill_slots is None and m.prefill_mask is None and m.write_rows is None
    # Two unequal prompts: the flat layout (24 x 24 < 2 x 20 x 20), block-diagonal.
    m2 = backend.build_metadata(make_meta([0, 0], [20, 4], [[3, 9], [4]]))
    assert m2.prefill_batch is None and m2.prefill_mask is not None and m2.prefill_mask.shape == (24, 24)
    assert not m2.prefill_mask[20:, :20].any() and not m2.prefill_mask[:20, 20:].any()
    assert m2.prefill_mask[19, :20].all() and not m2.prefill_mask[0, 1:].any()


@pytest.mark.parametrize("ctx", [[0, 0, 0, 0], [16, 0, 5, 30]], ids=["fresh", "with_context"])
def test_padded_prefill_layout_matches_reference(ctx: list[int]) -> None:
    """Several similar prompts take the padded layout (n x max_q x max_k < sum_q x sum_k) and stay exact."""
    torch.manual_seed(7)
    new = [12, 9, 12, 10]
    k_cache = torch.zeros(32, BS, KVH, D)
    v_cache = torch.zeros(32, BS, KVH, D)
    free = list(range(31, -1, -1))
    tables, keys, vals = [], [], []
    for c, n in zip(ctx, new):
        t = [free.pop(0) for _ in range(-(-(c + n) // BS))]
        tables.append(t)
        keys.append(torch.randn(c + n, KVH, D))
        vals.append(torch.randn(c + n, KVH, D))
        for p in range(c):
            k_cache[t[p // BS], p % BS] = keys[-1][p]
            v_cache[t[p // BS], p % BS] = vals[-1][p]
    backend = TorchAttentionBackend(BS, use_kernel=False)
    meta = backend.build_metadata(make_meta(ctx, new, tables))
    assert meta.prefill_batch == (4, 12, max(c + n for c, n in zip(ctx, new)))
    q = torch.randn(meta.num_tokens, H, D)
    k_new = torch.cat([kk[c:] for kk, c in zip(keys, ctx)])
    v_new = torch.cat([vv[c:] for vv, c in zip(vals, ctx)])
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, reference(q, keys, vals, ctx, new, 0.25), atol=1e-5, rtol=1e-5)


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Bands of 8 queries, and the (queries, keys) of every SDPA call the backend makes."""
    from servelm.runtime.cpu import torch_backend

    monkeypatch.setattr(torch_backend, "PREFILL_Q_CHUNK", 8)
    seen: list[tuple[int, int]] = []
    sdpa = torch_backend.F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, *args, **kwargs)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize("ctx", [0, 20], ids=["fresh", "with_context"])
@pytest.mark.parametrize("window", [0, 12], ids=["causal", "window"])
def test_one_long_prefill_attends_in_bands_of_queries(sdpa_calls: list[tuple[int, int]], ctx: int, window: int) -> None:
    """One long prompt's queries are attended a chunk at a time, each against only the keys it can see
    (its window, or the causal prefix): a 2,048-row step of Gemma 3 computed every query against every
    key under a mask, three times the work of its 512-token windows. Same values as the reference."""
    torch.manual_seed(3)
    new = 50
    k_cache = torch.zeros(16, BS, KVH, D)
    v_cache = torch.zeros(16, BS, KVH, D)
    table = [5, 2, 11, 7, 0]
    keys, vals = torch.randn(ctx + new, KVH, D), torch.randn(ctx + new, KVH, D)
    for p in range(ctx):
        k_cache[table[p // BS], p % BS] = keys[p]
        v_cache[table[p // BS], p % BS] = vals[p]
    backend = TorchAttentionBackend(BS, use_kernel=False)
    meta = backend.build_metadata(make_meta([ctx], [new], [table]))
    q = torch.randn(new, H, D)
    out = backend.forward(q, keys[ctx:], vals[ctx:], k_cache, v_cache, meta, 0.25, window=window or None)
    want = reference(q, [keys], [vals], [ctx], [new], 0.25, window=window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert sum(rows for rows, _ in sdpa_calls) == new and all(rows <= 8 for rows, _ in sdpa_calls), sdpa_calls
    for i, (rows, cols) in enumerate(sdpa_calls):
        last = ctx + 8 * i + rows  # keys up to the chunk's last query
        assert cols <= (rows + window - 1 if window else last), sdpa_calls


def test_a_windowed_band_gathers_only_its_windows_keys(
    sdpa_calls: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long context's windowed layer copies out of the pool only the keys each band's window reaches
    (their pages, once every window has left them, may be handed back), not the whole context."""
    torch.manual_seed(4)
    ctx, new, window = 60, 20, 12
    k_cache, v_cache = torch.randn(16, BS, KVH, D), torch.randn(16, BS, KVH, D)
    table = list(range(-(-(ctx + new) // BS)))
    keys = k_cache.view(-1, KVH, D)[: ctx + new].clone()
    vals = v_cache.view(-1, KVH, D)[: ctx + new].clone()
    gathered: list[int] = []
    index_select = torch.Tensor.index_select

    def recording(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        if t.shape[-2:] == (KVH, D):  # K/V rows
            gathered.append(index.numel())
        return index_select(t, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", recording)
    backend = TorchAttentionBackend(BS, use_kernel=False)
    meta = backend.build_metadata(make_meta([ctx], [new], [table]))
    q = torch.randn(new, H, D)
    out = backend.forward(q, keys[ctx:], vals[ctx:], k_cache, v_cache, meta, 0.25, window=window)
    torch.testing.assert_close(
        out, reference(q, [keys], [vals], [ctx], [new], 0.25, window=window), atol=1e-5, rtol=1e-5
    )
    assert gathered and max(gathered) <= 8 + window - 1, gathered  # bands of 8 queries: 19 keys each at most
    assert sum(gathered) < 2 * (ctx + new), gathered


@pytest.mark.parametrize("window", [0, 12], ids=["causal", "window"])
def test_long_prefills_side_by_side_attend_in_bands(sdpa_calls: list[tuple[int, int]], window: int) -> None:
    """Several prefills in one step, any of them longer than a band: the flat layout, each sequence's
    queries in bands against its own visible keys (a padded batch or one block-diagonal mask computes
    every sequence's every score). A decode beside them keeps its own path."""
    torch.manual_seed(5)
    ctx, new = [30, 20, 0, 0], [1, 30, 25, 6]
    k_cache = torch.zeros(32, BS, KVH, D)
    v_cache = torch.zeros(32, BS, KVH, D)
    free = list(range(31, -1, -1))
    tables, keys, vals = [], [], []
    for c, n in zip(ctx, new):
        tables.append([free.pop(0) for _ in range(-(-(c + n) // BS))])
        keys.append(torch.randn(c + n, KVH, D))
        vals.append(torch.randn(c + n, KVH, D))
        for p in range(c):
            k_cache[tables[-1][p // BS], p % BS] = keys[-1][p]
            v_cache[tables[-1][p // BS], p % BS] = vals[-1][p]
    backend = TorchAttentionBackend(BS, use_kernel=False)
    meta = backend.build_metadata(make_meta(ctx, new, tables))
    assert meta.prefill_batch is None  # flat, though padded would compute fewer scores unbanded
    q = torch.randn(meta.num_tokens, H, D)
    k_new = torch.cat([kk[c:] for kk, c in zip(keys, ctx)])
    v_new = torch.cat([vv[c:] for vv, c in zip(vals, ctx)])
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, 0.25, window=window or None)
    torch.testing.assert_close(out, reference(q, keys, vals, ctx, new, 0.25, window=window), atol=1e-5, rtol=1e-5)
    # (The decode row goes its own way, no SDPA.)
    assert sum(rows for rows, _ in sdpa_calls) == sum(new[1:]) and all(rows <= 8 for rows, _ in sdpa_calls), sdpa_calls
    assert max(cols for _, cols in sdpa_calls) <= (
        8 + window - 1 if window else max(c + n for c, n in zip(ctx, new))
    ), sdpa_calls
