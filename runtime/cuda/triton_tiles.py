"""The Triton tile helpers both paged-attention kernels share (``triton_kernels``' prefill/decode
kernel and ``triton_decode``'s split-KV decode): loading keys through the block table and folding
them into an online softmax. Imports triton at import time, like its users.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Smallest tile edge tl.dot accepts on tensor cores; the decode tile is padded up to it.
_MIN_DOT = 16
# log2(e): the kernels' softmax runs in base 2 (exp2).
_LOG2E = 1.4426950408889634


def _check_row_contiguous(x: torch.Tensor, name: str) -> None:
    # Each token's [heads, head_dim] must be one contiguous row; the token stride may be anything
    # (k and v are usually slices of the fused qkv projection).
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        raise ValueError(f"{name}: the [heads, head_dim] part must be contiguous, got strides {tuple(x.stride())}")


@triton.jit
def _attend_keys(
    q,
    m_i,
    l_i,
    acc,
    n,
    n_ok,
    visible,
    bt_row,
    kv_head,
    d,
    d_ok,
    k_cache_ptr,
    v_cache_ptr,
    softmax_scale_log2,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys ``n`` (positions in the sequence; ``n_ok`` the real ones,
    ``visible`` [rows, keys] those each query row may see): load their K/V rows through the block table
    and fold them into the running max ``m_i``, sum ``l_i`` and output ``acc`` (base-2 logits)."""
    kv_rows = _kv_rows(n, n_ok, bt_row, kv_head, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return _fold_keys(q, m_i, l_i, acc, k, v, visible, softmax_scale_log2, DOT_PRECISION)


@triton.jit
def _kv_rows(n, n_ok, bt_row, kv_head, stride_cache_block, stride_cache_slot, stride_cache_head, PAGE: tl.constexpr):
    """Pool offsets of key positions ``n`` of one KV head, through the sequence's block-table row."""
    # Never read a block-table entry past the sequence's last block.
    block = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
    return block * stride_cache_block + (n % PAGE) * stride_cache_slot + kv_head * stride_cache_head


@triton.jit
def _fold_keys(q, m_i, l_i, acc, k, v, visible, softmax_scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold a tile of keys ``k`` / values ``v`` into the running max, sum and output (base-2 logits)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * softmax_scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen only masked keys keeps m = -inf; shift by 0 there to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
