"""Split-KV ("flash-decoding") decode attention for the CUDA path, with RoPE + K/V store folded in.

A decode step of a few sequences has too few (sequence, KV head) pairs to fill the GPU: each pair's
context is cut into ``decode_splits`` slices, one program each, whose partial softmax states one
merge kernel combines (``_split_decode``, used by ``triton_kernels.paged_attention``). On a
decode-only step the same kernel can also rotate q and k from the fused q/k/v projection and store the
new K/V itself (``rope_paged_decode``), so a layer needs no separate RoPE + store kernel.

Both kernels are PDL-aware (``runtime.cuda.pdl``); the split kernel loads the first tile of older keys and
values before its wait. Like ``triton_kernels``, this module imports triton at import time: only CUDA
code imports it, and tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from servelm.runtime.cuda import pdl
from servelm.runtime.cuda.triton_pdl import wait_then_release
from servelm.runtime.cuda.triton_tiles import (
    _LOG2E,
    _MIN_DOT,
    _attend_keys,
    _check_row_contiguous,
    _fold_keys,
    _kv_rows,
)


@triton.jit
def _rotate(x, partner, c, s, first):
    """RoPE of a row tile ``x`` given each element's partner in the other half (``first``: the first
    half), as ``rope_store`` / ``apply_rope`` compute it: each product and the sum rounded."""
    dt = x.dtype
    xc = (x.to(tl.float32) * c).to(dt).to(tl.float32)
    ps = (partner.to(tl.float32) * s).to(dt).to(tl.float32)
    return tl.where(first, xc - ps, xc + ps).to(dt)


@triton.jit(
    do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "slot_ptr"]
)
def _paged_decode_split_kernel(
    q_ptr,  # q [S, H, D]; with ROPE the fused projection [S, (H + 2 KVH) D] (q heads first)
    k_cache_ptr,
    v_cache_ptr,
    part_acc_ptr,  # [S, H, NUM_SPLITS, HEAD_DIM_PAD] float32, unnormalised
    part_m_ptr,  # [S, H, NUM_SPLITS] float32: running max (base-2 logits)
    part_l_ptr,  # [S, H, NUM_SPLITS] float32: running sum of exp2
    block_tables_ptr,
    seq_lens_ptr,
    cos_ptr,  # ROPE: [S, D / 2] rows of the step (row stride stride_cos)
    sin_ptr,
    slot_ptr,  # ROPE: [S] int64, where each new token's K/V goes (-1: nowhere)
    softmax_scale_log2,
    stride_qt,
    stride_qh,
    stride_cos,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    ROPE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # GROUP padded to a tile tl.dot accepts
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    # Split-KV decode ("flash-decoding"): one program = one sequence x one KV head x one slice of its
    # context, so a small batch still fills the GPU. The slice length follows the sequence's own
    # length (read on the device), so one launch shape serves every context inside a CUDA graph.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_start = split * chunk
    k_end = tl.minimum(seq_len, k_start + chunk)

    g = tl.arange(0, BLOCK_M)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    n_offs = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # The slice's first tile of keys is loaded before the PDL wait, all but the newest position:
    # the step's inputs (lengths, block tables) and the K/V of earlier steps are written before the
    # graph starts; only the newest token's K/V (and q) come from the kernel before this one.
    n = k_start + n_offs
    n_ok = n < k_end
    kv_rows = _kv_rows(n, n_ok, bt_row, kv_head, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE)
    kv_off = kv_rows[:, None] + d[None, :]
    older = (n_ok & (n < seq_len - 1))[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=older, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=older, other=0.0)
    wait_then_release(PDL)
    newest = (n_ok & (n == seq_len - 1))[:, None] & d_ok[None, :]
    q_rows = seq.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_mask = row_ok[:, None] & d_ok[None, :]
    if ROPE:
        # RoPE + K/V store folded in (no rope_store kernel before this one): every program rotates its
        # group's q rows; the one whose slice holds the newest position also rotates that token's k,
        # stores k and v at its slot, and uses them from registers.
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        c = tl.load(cos_ptr + seq * stride_cos + d % HALF, mask=d_ok, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + seq * stride_cos + d % HALF, mask=d_ok, other=0.0).to(tl.float32)
        q = _rotate(
            tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0),
            tl.load(q_ptr + q_rows[:, None] + partner[None, :], mask=q_mask, other=0.0),
            c[None, :],
            sn[None, :],
            first[None, :],
        )
        row = q_ptr + seq.to(tl.int64) * stride_qt
        k_at = row + (NUM_HEADS + kv_head) * HEAD_DIM
        k_new = _rotate(
            tl.load(k_at + d, mask=d_ok, other=0.0), tl.load(k_at + partner, mask=d_ok, other=0.0), c, sn, first
        )
        v_new = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + d, mask=d_ok, other=0.0)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        owner = (k_start <= seq_len - 1) & (seq_len - 1 < k_end)
        dst = (slot // PAGE) * stride_cache_block + (slot % PAGE) * stride_cache_slot + kv_head * stride_cache_head + d
        tl.store(k_cache_ptr + dst, k_new, mask=d_ok & owner & (slot >= 0))
        tl.store(v_cache_ptr + dst, v_new, mask=d_ok & owner & (slot >= 0))
        k = tl.where(newest, k_new[None, :], k)
        v = tl.where(newest, v_new[None, :], v)
    else:
        k = tl.where(newest, tl.load(k_cache_ptr + kv_off, mask=newest, other=0.0), k)
        v = tl.where(newest, tl.load(v_cache_ptr + kv_off, mask=newest, other=0.0), v)
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # An empty first tile (n_ok all false) folds in nothing: its scores are all -inf.
    m_i, l_i, acc = _fold_keys(q, m_i, l_i, acc, k, v, n_ok[None, :], softmax_scale_log2, DOT_PRECISION)
    for start in range(k_start + BLOCK_N, k_end, BLOCK_N):
        n = start + n_offs
        n_ok = n < k_end
        if ROPE:  # the newest key (in the slice's last tile) from registers: this program stores it
            kv_off = _kv_rows(n, n_ok, bt_row, kv_head, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE)
            kv_off = kv_off[:, None] + d[None, :]
            older = (n_ok & (n < seq_len - 1))[:, None] & d_ok[None, :]
            newest = (n_ok & (n == seq_len - 1))[:, None] & d_ok[None, :]
            k = tl.where(newest, k_new[None, :], tl.load(k_cache_ptr + kv_off, mask=older, other=0.0))
            v = tl.where(newest, v_new[None, :], tl.load(v_cache_ptr + kv_off, mask=older, other=0.0))
            m_i, l_i, acc = _fold_keys(q, m_i, l_i, acc, k, v, n_ok[None, :], softmax_scale_log2, DOT_PRECISION)
        else:
            m_i, l_i, acc = _attend_keys(
                q, m_i, l_i, acc, n, n_ok, n_ok[None, :], bt_row, kv_head, d, d_ok, k_cache_ptr, v_cache_ptr,
                softmax_scale_log2, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE, DOT_PRECISION,
            )  # fmt: skip

    # An empty slice (a context shorter than the split count asks for) leaves m = -inf, l = 0.
    part = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _paged_decode_reduce_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    sp = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_m_ptr + base + sp)
    l_part = tl.load(part_l_ptr + base + sp)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    total = tl.sum(l_part * w, 0)
    d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * HEAD_DIM_PAD + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many context slices a decode launch uses: enough programs for ~2 per SM, at most 32; 1 when
    the batch alone fills the GPU (or off CUDA)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device)
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    return min(32, triton.next_power_of_2(triton.cdiv(2 * sms, programs)))


def _split_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
    num_splits: int,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """Decode attention in ``num_splits`` context slices per sequence, then one merge per head.

    ``rope`` = (cos, sin, slot_mapping, num_heads): ``q`` is then the fused q/k/v projection
    ``[S, (H + 2 KVH) D]``, RoPE'd and its new K/V stored inside the split kernel; ``out`` ``[S, H, D]``.
    """
    num_seqs = seq_lens.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_heads = rope[3] if rope is not None else q.shape[1]
    group = num_heads // num_kv_heads
    head_dim_pad = max(triton.next_power_of_2(head_dim), _MIN_DOT)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    # Decode tokens are rows 0..num_seqs-1 (query_start_loc is 0, 1, 2, ...): q and out are indexed by sequence.
    del query_start_loc
    f32: dict[str, Any] = dict(dtype=torch.float32, device=q.device)
    part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, **f32)
    part_m = torch.empty(num_seqs, num_heads, num_splits, **f32)
    part_l = torch.empty(num_seqs, num_heads, num_splits, **f32)
    if rope is not None:
        cos, sin, slots, _ = rope
        stride_qt, stride_qh, stride_cos = q.stride(0), head_dim, cos.stride(0)
    else:
        cos = sin = slots = seq_lens  # unused without ROPE
        stride_qt, stride_qh, stride_cos = q.stride(0), q.stride(1), 0
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_acc,
        part_m,
        part_l,
        block_tables,
        seq_lens,
        cos,
        sin,
        slots,
        scale * _LOG2E,
        stride_qt,
        stride_qh,
        stride_cos,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        ROPE=rope is not None,
        NUM_KV_HEADS=num_kv_heads,
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_M=max(triton.next_power_of_2(group), _MIN_DOT),
        BLOCK_N=64,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE=k_cache.shape[1],
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee",
        num_warps=4,
        **pdl.launch_kwargs(),
    )
    _paged_decode_reduce_kernel[(num_seqs, num_heads)](
        part_acc,
        part_m,
        part_l,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits,
        num_warps=4,
        **pdl.launch_kwargs(),
    )


def rope_paged_decode(
    qkv: torch.Tensor,  # [S, (H + 2 * KVH) * D], the fused projection of a decode-only step
    cos: torch.Tensor,  # [S, D / 2] (any row stride, unit column stride)
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [S] int64; -1 => the new K/V is not stored (padding)
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,  # [S] int32, the new token included
    scale: float,
    num_heads: int,
    num_splits: int | None = None,  # context slices per sequence (None: by occupancy)
) -> torch.Tensor | None:
    """``rope_store`` then decode ``paged_attention`` in one split-KV launch (plus its merge): q and k
    rotated, the new K/V stored at their slots and attended from registers. ``[S, H, D]``, or None
    when the batch fills the GPU without splitting (then the two-kernel path serves)."""
    num_seqs = seq_lens.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if qkv.shape != (num_seqs, (num_heads + 2 * num_kv_heads) * head_dim) or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not {num_seqs} rows of {num_heads}+2x{num_kv_heads} heads")
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must share strides with a unit column stride")
    _check_row_contiguous(k_cache, "k_cache")
    if k_cache.stride() != v_cache.stride() or head_dim % 2:
        raise ValueError("k_cache and v_cache must have the same strides, and head_dim must be even")
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, qkv.device)
    if num_splits <= 1 or num_seqs == 0:
        return None
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _split_decode(
        qkv, k_cache, v_cache, out, block_tables, seq_lens, None, scale, num_splits,
        rope=(cos, sin, slot_mapping, num_heads),
    )  # fmt: skip
    return out
