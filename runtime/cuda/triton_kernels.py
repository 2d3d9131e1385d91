"""Triton kernels for the CUDA path: the KV-pool store and a paged attention fallback (its split-KV
decode for small batches, with RoPE + K/V store folded in, is ``runtime.cuda.triton_decode``).

This module imports triton at import time, so nothing on the CPU path may import it unconditionally:
backends import it lazily when they are built on a CUDA device. Tests run the kernels on CPU tensors
under ``TRITON_INTERPRET=1`` (set before triton is first imported).

Pool layout (``runtime/attention/base.py``): ``[num_blocks, block_size, num_kv_heads, head_dim]`` per
layer, with the ``[num_kv_heads, head_dim]`` part of each slot contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.runtime.cuda import triton_decode
from servelm.runtime.cuda.triton_tiles import _LOG2E, _MIN_DOT, _attend_keys, _check_row_contiguous


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_cache_block,
    stride_cache_slot,
    PAGE: tl.constexpr,  # tokens per pool block
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    # slot -1 marks a padding token (CUDA-graph batches): mask everything rather than branch.
    mask = (offs < ROW) & (slot >= 0)
    dst = (slot // PAGE) * stride_cache_block + (slot % PAGE) * stride_cache_slot + offs
    k = tl.load(k_ptr + token * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); -1 => skip
) -> None:
    """Write each token's K and V row into its pool slot; slot -1 writes nothing."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or k.stride(-2) != k.shape[-1]:
        k = k.contiguous()
    if v.stride(-1) != 1 or v.stride(-2) != v.shape[-1]:
        v = v.contiguous()
    _check_row_contiguous(k_cache, "k_cache")
    _check_row_contiguous(v_cache, "v_cache")
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(2) * k_cache.shape[2] != k_cache.stride(1):
        raise ValueError(f"k_cache: each slot's [heads, head_dim] must be contiguous, got {tuple(k_cache.stride())}")
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        PAGE=k_cache.shape[1],
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


# Per-step metadata must not pick the kernel variant: Triton specialises integer arguments on
# "== 1" / "divisible by 16" and pointers on 16-byte alignment, so a block-table width or a prefill
# half that starts at an odd decode count would each compile a new variant in the middle of serving.
_STEP_META_PTRS = ["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "context_lens_ptr"]


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=_STEP_META_PTRS)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    softmax_scale_log2,  # scale * log2(e): the softmax runs in base 2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP_PAD
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program = one sequence x one KV head x one tile of query tokens. All GROUP query heads that
    # share the KV head are rows of the same tile, so each K/V row is loaded once (GQA without repeats).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = q_tile * BLOCK_Q
    if first_q >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP_PAD  # index among this sequence's new tokens
    g = rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    q_rows = (q_start + q_idx).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Causal over cached context + new tokens: query i sits at absolute position ctx_len + i.
    q_pos = ctx_len + q_idx
    last_q = tl.minimum(first_q + BLOCK_Q, q_len)  # exclusive
    kv_end = tl.minimum(seq_len, ctx_len + last_q)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    n_offs = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        n = start + n_offs
        n_ok = n < kv_end
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, n, n_ok, visible, bt_row, kv_head, d, d_ok, k_cache_ptr, v_cache_ptr,
            softmax_scale_log2, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE, DOT_PRECISION,
        )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    o_rows = (q_start + q_idx).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D], tokens of each sequence contiguous, in query_start_loc order
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: cached + new tokens
    query_start_loc: torch.Tensor,  # [S + 1] int32, starting at 0
    context_lens: torch.Tensor,  # [S] int32: tokens cached before this step (seq_lens - query lens)
    scale: float,
    *,
    max_query_len: int | None = None,  # pass it to avoid a device sync (and inside CUDA graphs)
    out: torch.Tensor | None = None,
    num_splits: int | None = None,  # decode only: context slices per sequence (None: by occupancy)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (K/V already stored).

    Decode (one new token) and prefill chunks (many, attending to the cached context plus
    themselves) are the same computation; ``max_query_len`` only sizes the launch grid.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be shaped like q {tuple(q.shape)} with a contiguous last dim")
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    _check_row_contiguous(k_cache, "k_cache")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(triton.next_power_of_2(head_dim), _MIN_DOT)
    if max_query_len <= 1:
        if num_splits is None:
            num_splits = triton_decode.decode_splits(num_seqs, num_kv_heads, q.device)
        if num_splits > 1:
            triton_decode._split_decode(
                q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale, num_splits
            )
            return out
        # Decode: one token; pad the rows up to the smallest tile tl.dot supports.
        block_q = max(1, _MIN_DOT // group_pad)
        block_n, num_warps = 64, 4
    else:
        block_q = max(1, 64 // group_pad)
        block_n, num_warps = 64, 4
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        context_lens,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE=k_cache.shape[1],
        # fp32 pools get true fp32 products (tf32 would break token-exact greedy); ignored for bf16/fp16.
        DOT_PRECISION="ieee",
        num_warps=num_warps,
    )
    return out
