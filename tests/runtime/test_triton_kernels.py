"""The CUDA path's Triton kernels and the Triton backend, run on CPU tensors by Triton's interpreter."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from typing import Any

from triton_interp import (  # first: sets the interpreter
    build_with_triton_ops,
    flash_backend,
    ops,
    prefill_then_decode,
    td,
    tk,
    torch_rms_norm,
)

# isort: split
import pytest
import torch

from servelm.runtime.attention.base import AttentionMetadata

# ----------------------------------------------------------------------------- references


def reference_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale):
    """Per-sequence causal attention over the gathered context, in float64, GQA by repeating heads."""
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    outs = []
    start = 0
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(seq_len)
        blocks = block_tables[s][pos // block_size].long()
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(num_heads // num_kv_heads, 1)
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(num_heads // num_kv_heads, 1)
        qs = q[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = seq_len - q_len + torch.arange(q_len)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


def scattered_tables(num_blocks, block_size, seq_lens, width, gen):
    """Block tables drawing distinct, shuffled pool blocks; unused entries hold garbage ids."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    for s, n in enumerate(seq_lens):
        need = -(-n // block_size)
        table[s, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.int32)
    return table


def attention_inputs(seq_lens, query_lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    width = max(-(-n // block_size) for n in seq_lens) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = scattered_tables(num_blocks, block_size, seq_lens, width, gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    ctx = seq - torch.tensor(query_lens, dtype=torch.int32)
    return q, k_cache, v_cache, tables, seq, qsl, ctx


# ----------------------------------------------------------------------------- store


def test_store_writes_each_row_at_its_slot_and_skips_minus_one() -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kvh, d = 6, 4, 3, 8
    # k and v as slices of a fused projection: the token stride is not kvh * d.
    fused = torch.randn(5, 2 * kvh * d + 7, generator=gen)
    k = fused[:, : kvh * d].view(5, kvh, d)
    v = fused[:, kvh * d : 2 * kvh * d].view(5, kvh, d)
    assert not k.is_contiguous()
    k_cache = torch.full((num_blocks, block_size, kvh, d), 7.0)
    v_cache = torch.full((num_blocks, block_size, kvh, d), 7.0)
    slots = torch.tensor([13, -1, 0, 23, -1], dtype=torch.int64)

    tk.store_kvcache(k, v, k_cache, v_cache, slots)

    want_k = torch.full((num_blocks * block_size, kvh, d), 7.0)
    want_v = want_k.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s], want_v[s] = k[t], v[t]
    assert torch.equal(k_cache.view(-1, kvh, d), want_k)
    assert torch.equal(v_cache.view(-1, kvh, d), want_v)


def test_store_into_a_layer_view_of_a_shared_pool() -> None:
    # KVPool keeps all layers in one tensor; a layer's cache is a view with a storage offset.
    pool = torch.zeros(2, 3, 4, 2, 2, 8)  # [k/v, layers, blocks, block_size, kvh, d]
    k = torch.randn(2, 2, 8)
    v = torch.randn(2, 2, 8)
    tk.store_kvcache(k, v, pool[0, 1], pool[1, 1], torch.tensor([5, 2]))
    want = torch.zeros_like(pool)
    want[0, 1, 2, 1], want[0, 1, 1, 0] = k[0], k[1]
    want[1, 1, 2, 1], want[1, 1, 1, 0] = v[0], v[1]
    assert torch.equal(pool, want)  # the right layer, nothing else touched


# ----------------------------------------------------------------------------- paged attention


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(6, 2, 16, 4), (8, 2, 24, 16), (4, 4, 32, 8)],  # GQA 3 and 4, head_dim not a power of two, MHA
)
def test_decode_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    seq_lens = [1, 9, 2 * block_size, 3 * block_size + 1]  # a lone token, partial and exactly full last blocks
    query_lens = [1] * len(seq_lens)
    q, kc, vc, bt, seq, qsl, ctx = attention_inputs(
        seq_lens,
        query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
    )
    scale = 1 / math.sqrt(head_dim)
    out = tk.paged_attention(q, kc, vc, bt, seq, qsl, ctx, scale, max_query_len=1)
    ref = reference_attention(q, kc, vc, bt, seq_lens, query_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_split_kv_decode_matches_reference(num_splits: int) -> None:
    # Contexts longer than the 64-key tile, so several slices are busy and merged; a 1-token context
    # leaves all but one slice empty.
    seq_lens = [1, 70, 200, 129]
    query_lens = [1] * len(seq_lens)
    q, kc, vc, bt, seq, qsl, ctx = attention_inputs(
        seq_lens, query_lens, num_heads=8, num_kv_heads=2, head_dim=24, block_size=16, dtype=torch.float32, seed=9
    )
    out = tk.paged_attention(q, kc, vc, bt, seq, qsl, ctx, 0.2, max_query_len=1, num_splits=num_splits)
    ref = reference_attention(q, kc, vc, bt, seq_lens, query_lens, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_splits_by_occupancy() -> None:
    assert td.decode_splits(1, 8, torch.device("cpu")) == 1  # off CUDA: the one-pass kernel


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(6, 2, 4), (8, 2, 16)])
def test_prefill_chunks_match_reference(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    # A fresh prompt, a chunk over a cached context (chunked prefill / prefix hit), and a chunk
    # longer than the kernel's query tile.
    seq_lens = [7, 30, 41]
    query_lens = [7, 11, 40]
    q, kc, vc, bt, seq, qsl, ctx = attention_inputs(
        seq_lens,
        query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=block_size,
        dtype=torch.float32,
        seed=3,
    )
    out = tk.paged_attention(q, kc, vc, bt, seq, qsl, ctx, 0.3)  # max_query_len derived
    ref = reference_attention(q, kc, vc, bt, seq_lens, query_lens, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_half_precision_inputs() -> None:
    # Triton's interpreter mis-computes bfloat16 dots, so the low-precision path is checked in fp16.
    seq_lens, query_lens = [19, 5], [1, 5]
    q, kc, vc, bt, seq, qsl, ctx = attention_inputs(
        seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16
    )
    out = tk.paged_attention(q, kc, vc, bt, seq, qsl, ctx, 0.25)
    assert out.dtype == torch.float16
    ref = reference_attention(q, kc, vc, bt, seq_lens, query_lens, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


# ----------------------------------------------------------------------------- the Triton backend


def mixed_step(block_size: int, *, num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16):
    """Two decodes then two prefill chunks (one over a cached context), as the runner lays them out."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = [10, 5, 6, 13]
    query_lens = [1, 1, 6, 4]
    num_blocks = 32
    width = max(-(-n // block_size) for n in seq_lens)
    tables = scattered_tables(num_blocks, block_size, seq_lens, width, gen)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    T = sum(query_lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    slots = []
    for s, (n, ql) in enumerate(zip(seq_lens, query_lens)):
        for p in range(n - ql, n):
            slots.append(int(tables[s, p // block_size]) * block_size + p % block_size)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    meta = AttentionMetadata(
        num_tokens=T,
        num_decodes=2,
        num_decode_tokens=2,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([n - ql for n, ql in zip(seq_lens, query_lens)], dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
    return q, k, v, k_cache, v_cache, meta


def expected_step(q, k, v, k_cache, v_cache, meta, scale):
    kc, vc = k_cache.clone(), v_cache.clone()
    bs = kc.shape[1]
    for t, s in enumerate(meta.slot_mapping.tolist()):
        kc[s // bs, s % bs], vc[s // bs, s % bs] = k[t], v[t]
    out = reference_attention(q, kc, vc, meta.block_tables, meta.seq_lens_list, meta.query_lens_list, scale)
    return out, kc, vc


def test_triton_backend_mixed_step_matches_reference() -> None:
    q, k, v, kc, vc, meta = mixed_step(block_size=4)
    want, want_kc, want_vc = expected_step(q, k, v, kc, vc, meta, 0.25)
    backend = flash_backend.TritonPagedBackend()
    m = backend.build_metadata(meta)
    assert m.num_prefills == 2 and m.decode_seq_lens.tolist() == [10, 5]
    out = backend.forward(q, k, v, kc, vc, m, 0.25)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_views_follow_the_runner_buffers() -> None:
    # CUDA graphs replay over fixed buffers: the decode half must be views, not copies.
    _, _, _, _, _, meta = mixed_step(block_size=4)
    m = flash_backend.TritonPagedBackend().build_metadata(meta)
    meta.seq_lens[0] = 99
    meta.block_tables[1, 0] = 17
    assert m.decode_seq_lens[0] == 99 and m.decode_block_tables[1, 0] == 17


# ----------------------------------------------------------------------------- FlashAttentionBackend plumbing
# flash-attn cannot be installed here (no CUDA); a stand-in implementing its documented semantics
# (paged KV through block_table, causal mask aligned to the bottom-right corner, int32 metadata,
# the upstream page-size constraint) checks what the backend passes it.

FAKE_FLASH_ATTN = """
import torch

def _attend(q, k_cache, v_cache, table, seqlen_k, scale, causal):
    page = k_cache.shape[1]
    pos = torch.arange(seqlen_k)
    blocks = table[pos // page].long()
    group = q.shape[1] // k_cache.shape[2]
    k = k_cache[blocks, pos % page].repeat_interleave(group, 1)
    v = v_cache[blocks, pos % page].repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        shift = seqlen_k - q.shape[0]
        s = s.masked_fill(pos[None, :] > torch.arange(q.shape[0])[:, None] + shift, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

def _check_paged(k_cache, block_table):
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, **kw):
    assert k is None and v is None and q.dim() == 4
    _check_paged(k_cache, block_table)
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape[0] == q.shape[0] == block_table.shape[0]
    return torch.stack([
        _attend(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]), softmax_scale, causal)
        for b in range(q.shape[0])
    ])

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    _check_paged(k, block_table)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == q.shape[0]
    outs = []
    for b in range(cu_seqlens_q.shape[0] - 1):
        qs = q[int(cu_seqlens_q[b]) : int(cu_seqlens_q[b + 1])]
        seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert qs.shape[0] <= max_seqlen_q and seqlen_k <= max_seqlen_k
        outs.append(_attend(qs, k, v, block_table[b], seqlen_k, softmax_scale, causal))
    return torch.cat(outs)
"""


def test_flash_backend_passes_flash_attn_the_documented_arguments(monkeypatch) -> None:
    fake = types.ModuleType("flash_attn")
    exec(FAKE_FLASH_ATTN, fake.__dict__)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)  # removed again after the test

    q, k, v, kc, vc, meta = mixed_step(block_size=256, head_dim=16)
    want, want_kc, want_vc = expected_step(q, k, v, kc, vc, meta, 0.25)
    backend = flash_backend.FlashAttentionBackend()
    m = backend.build_metadata(meta)
    assert m.prefill_cu_seqlens_q.tolist() == [0, 6, 10]
    assert m.prefill_cu_seqlens_k.tolist() == [0, 6, 19]
    assert (m.prefill_max_query_len, m.prefill_max_seq_len) == (6, 13)
    out = backend.forward(q, k, v, kc, vc, m, 0.25)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- CUDA-graph padding
# Capture needs CUDA; what the graph computes does not: run the capture-time forward eagerly over the
# static buffers, padded to the next captured size, and compare with the unpadded step.


def test_padded_static_decode_batch_equals_the_plain_step() -> None:
    from servelm.runtime.cuda.graphs import CudaGraphRunner

    gen = torch.Generator().manual_seed(11)
    block_size, num_blocks, kvh, heads, d, vocab = 4, 16, 2, 4, 16, 50
    emb_q = torch.randn(vocab, heads, d, generator=gen)
    emb_kv = torch.randn(vocab, 2, kvh, d, generator=gen)
    backend = flash_backend.TritonPagedBackend()

    def make_model(kc, vc):
        def model(ids, positions, meta):
            kv = emb_kv[ids] + positions[:, None, None, None]
            return backend.forward(emb_q[ids], kv[:, 0], kv[:, 1], kc, vc, meta, 0.25)

        return model

    seq_lens = [6, 9, 3]
    tables = scattered_tables(num_blocks, block_size, seq_lens, 3, gen)
    ids = torch.tensor([3, 14, 27])
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = torch.tensor(
        [int(tables[s, p // block_size]) * block_size + p % block_size for s, p in enumerate(positions)]
    )
    kc0 = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    vc0 = torch.randn(num_blocks, block_size, kvh, d, generator=gen)

    kc, vc = kc0.clone(), vc0.clone()
    plain_meta = AttentionMetadata(
        num_tokens=3,
        num_decodes=3,
        num_decode_tokens=3,
        slot_mapping=slots,
        query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(seq_lens, dtype=torch.int32) - 1,
        block_tables=tables,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_list=[1, 1, 1],
        seq_lens_list=seq_lens,
    )
    want = make_model(kc, vc)(ids, positions, backend.build_metadata(plain_meta))

    gkc, gvc = kc0.clone(), vc0.clone()
    runner = CudaGraphRunner(
        make_model(gkc, gvc),
        backend,
        max_num_seqs=6,
        max_blocks_per_seq=5,
        block_size=block_size,
        device=torch.device("cpu"),
    )
    assert runner.sizes == [1, 2, 4, 6]
    runner.inputs.block_tables.fill_(9)  # stale ids from an earlier step in the unused columns
    runner.inputs.fill(ids, positions, slots, torch.tensor(seq_lens, dtype=torch.int32), tables, padded_to=4)
    b = runner.inputs
    got = runner.model(b.input_ids[:4], b.positions[:4], runner.static_metadata(4))
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    # The padding row wrote nothing: both pools saw exactly the same writes.
    assert torch.equal(gkc, kc) and torch.equal(gvc, vc)


# ----------------------------------------------------------------------------- fused ops (runtime.cuda.triton_ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_and_without_the_residual_add(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    # 96 columns: not a power of two (masked tail); x a strided view, as projections' slices are.
    x = (torch.randn(5, 100, generator=gen) * 3)[:, :96].to(dtype)
    res = torch.randn(5, 96, generator=gen).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)

    out, none = ops.rms_norm(x, None, w, 1e-5)
    assert none is None
    torch.testing.assert_close(out, torch_rms_norm(x, w, 1e-5), **tol)

    want_sum = x + res  # rounded to dtype, as the eager add is
    r = res.clone()
    out, r_back = ops.rms_norm(x, r, w, 1e-5)
    assert r_back is r and torch.equal(r, want_sum)  # the sum landed in the residual, in place
    torch.testing.assert_close(out, torch_rms_norm(want_sum, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_of_the_fused_gate_up_projection(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    inter = 1500  # more than one column tile, with a masked tail
    gu = (torch.randn(3, 2 * inter, generator=gen) * 4).to(dtype)
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    got = ops.silu_mul(gu)
    assert got.shape == (3, inter) and got.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_equals_rotation_then_store(dtype: torch.dtype) -> None:
    from servelm.runtime.models.layers import apply_rope

    gen = torch.Generator().manual_seed(5)
    heads, kvh, d, page, blocks = 6, 2, 16, 4, 8
    positions = torch.tensor([0, 7, 3, 12, 5])
    slots = torch.tensor([9, -1, 0, 30, 17])  # -1: a padding token writes nothing
    qkv = torch.randn(5, (heads + 2 * kvh) * d + 8, generator=gen)[:, : (heads + 2 * kvh) * d].to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(16).float()[:, None] * inv[None, :]
    cos_t, sin_t = freqs.cos().to(dtype), freqs.sin().to(dtype)
    cos_sin = (cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1))
    k_cache = torch.full((blocks, page, kvh, d), 5.0, dtype=dtype)
    v_cache = torch.full((blocks, page, kvh, d), 5.0, dtype=dtype)

    q = ops.rope_store(qkv, cos_sin[0][:, 0], cos_sin[1][:, 0], k_cache, v_cache, slots, heads)

    qk = apply_rope(qkv[:, : (heads + kvh) * d].reshape(5, heads + kvh, d), cos_sin)
    v = qkv[:, (heads + kvh) * d :].reshape(5, kvh, d)
    want_k = torch.full((blocks * page, kvh, d), 5.0, dtype=dtype)
    want_v = want_k.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s], want_v[s] = qk[t, heads:], v[t]
    # The same roundings as apply_rope: equal, not just close.
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(k_cache.view(-1, kvh, d), want_k)
    assert torch.equal(v_cache.view(-1, kvh, d), want_v)


@pytest.mark.parametrize("splits", [1, 4], ids=["decode unsplit", "split-KV decode"])
def test_model_with_fused_ops_equals_the_eager_model(tiny_llama_dir, build_runner, rt, monkeypatch, splits) -> None:
    """The whole CUDA-path model structure on CPU tensors: Triton backend + fused norms, activation and
    RoPE/store against the plain torch path, prefill then decode steps. With split-KV decode (as on a
    GPU a small batch gets) the decode step's RoPE and K/V store run inside the attention kernel."""
    from servelm.runtime.cpu.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(td, "decode_splits", lambda num_seqs, num_kv_heads, device: splits)
    fused = build_with_triton_ops(
        build_runner, monkeypatch, tiny_llama_dir, backend=flash_backend.TritonPagedBackend(16, fused_rope=True)
    )
    calls = {"rope_store": 0, "rms_norm": 0}

    def counting(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any) -> Any:
            calls[name] += 1
            return op(*a)

        return counted

    for name in calls:
        monkeypatch.setattr(ops, name, counting(name, getattr(ops, name)))
    folded = []
    monkeypatch.setattr(
        td, "rope_paged_decode", lambda *a, _f=td.rope_paged_decode, **kw: folded.append(1) or _f(*a, **kw)
    )
    plain = build_runner(tiny_llama_dir, backend=TorchAttentionBackend(16, use_kernel=False))
    # Both prompts but the last token as one prefill step, then a decode step for each.
    outs = [prefill_then_decode(runner, rt, [7, 8], [[0, 1]]) for runner in (fused, plain)]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)
    layers = len(fused.model.model.layers)
    # Two steps: one RoPE/store per layer each (the decode step's inside split-KV attention when it
    # splits); two norms per layer plus the final one each.
    in_attention = layers if splits > 1 else 0
    assert calls == {"rope_store": 2 * layers - in_attention, "rms_norm": 2 * (2 * layers + 1)}
    assert len(folded) == layers  # asked every decode layer; served it only when splitting


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [2, 8])
def test_rope_paged_decode_equals_rope_store_then_split_decode(dtype: torch.dtype, num_splits: int) -> None:
    """The decode step's RoPE + K/V store folded into the split-KV kernel: the same output and the same
    pool as ``rope_store`` followed by split-KV decode. Contexts of 1 token (the newest is the only one),
    long ones (the newest in a later tile of its slice), and a padding row (slot -1: nothing stored)."""
    gen = torch.Generator().manual_seed(11 + num_splits)
    heads, kvh, d, page = 6, 2, 32, 4
    seq_lens = [1, 70, 200, 33, 9]
    slots_known = [True, True, True, True, False]  # the last row is padding
    num_blocks = 128
    width = max(-(-n // page) for n in seq_lens) + 1
    tables = scattered_tables(num_blocks, page, seq_lens, width, gen)
    k_cache = torch.randn(num_blocks, page, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, kvh, d, generator=gen).to(dtype)
    slots = torch.tensor(
        [
            int(tables[i, (n - 1) // page]) * page + (n - 1) % page if known else -1
            for i, (n, known) in enumerate(zip(seq_lens, slots_known))
        ]
    )
    qkv = torch.randn(len(seq_lens), (heads + 2 * kvh) * d + 4, generator=gen)[:, : (heads + 2 * kvh) * d].to(dtype)
    freqs = torch.tensor(seq_lens).float()[:, None] - 1  # each new token sits at position seq_len - 1
    freqs = freqs * (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)

    kc_a, vc_a = k_cache.clone(), v_cache.clone()
    q = ops.rope_store(qkv, cos, sin, kc_a, vc_a, slots, heads)
    want = tk.paged_attention(q, kc_a, vc_a, tables, seq, qsl, seq - 1, 0.3, max_query_len=1, num_splits=num_splits)

    kc_b, vc_b = k_cache.clone(), v_cache.clone()
    got = td.rope_paged_decode(qkv, cos, sin, kc_b, vc_b, slots, tables, seq, 0.3, heads, num_splits=num_splits)
    assert got is not None
    assert torch.equal(kc_b, kc_a) and torch.equal(vc_b, vc_a)  # the same K/V stored, nothing else
    # The padding row attends over its own (unstored) newest key from registers; the two-kernel path
    # reads whatever its slot held: only the real rows are comparable.
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[:4], want[:4], **tol)
    # A batch that fills the GPU unsplit is left to the two-kernel path.
    assert td.rope_paged_decode(qkv, cos, sin, kc_b, vc_b, slots, tables, seq, 0.3, heads, num_splits=1) is None
