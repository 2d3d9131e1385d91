"""Fused Triton kernels for the model's small CUDA ops: what a decode step launches hundreds of.

At batch 1 a decode step of an 8B model is ~3.5 ms of weight reads and, unfused, ~800 kernel
launches, most of them element-wise ops of a few KB (RMSNorm's upcast/normalise/downcast/scale, the
residual adds, RoPE's slices and products, SiLU and the gate product). Each costs a launch and a
gap even inside a CUDA graph. These kernels do each group in one pass:

- ``rms_norm``: the residual add (optional, in place) and RMSNorm in one kernel;
- ``silu_mul``: ``silu(gate) * up`` from the fused gate/up projection;
- ``rope_store``: RoPE of q and k from the fused q/k/v projection, q written out, k and v stored into
  their pool slots (slot -1 skipped).

Each rounds where the eager torch code rounds (results are cast to the activation dtype at the same
points as Hugging Face's Llama), so in bfloat16 they differ from the eager path only by the order of
the RMSNorm sum. All three are PDL-aware (``runtime.cuda.pdl``). This module imports triton at import time: only CUDA code imports it. Tests run the
kernels on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.runtime.cuda import pdl
from servelm.runtime.cuda.triton_pdl import wait_then_release


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight does not depend on the previous kernel: loaded before the PDL wait.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_then_release(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # residual + x, rounded to the activation dtype as torch's add does; written back in place.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)).to(
            x.dtype
        )
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    # HF: weight * (x * rsqrt(var + eps)).to(dtype): the normalised value is rounded before the scale.
    y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual) * weight, x + residual)``, the sum written into ``residual`` in place;
    ``(rms_norm(x) * weight, None)`` without a residual. ``x``: ``[T, hidden]`` with unit column stride."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out, residual
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)} with unit column stride")
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
        **pdl.launch_kwargs(),
    )
    return out, residual


@triton.jit
def _silu_mul_kernel(
    gu_ptr,
    out_ptr,
    stride_gu,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    wait_then_release(PDL)
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch's silu computes x / (1 + exp(-x)) in float32 and rounds; then the product rounds again.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * I]`` (gate rows then up rows, as ``MLP.gate_up_proj`` lays them out) -> ``silu(gate) * up``, ``[T, I]``."""
    rows, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4, **pdl.launch_kwargs()
    )
    return out


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qkv,
    stride_cos,
    stride_qo_t,
    stride_cache_block,
    stride_cache_slot,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next_pow2(NUM_HEADS + NUM_KV_HEADS): q and k heads rotate together
    KV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    row = qkv_ptr + t * stride_qkv
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = (slot // PAGE) * stride_cache_block + (slot % PAGE) * stride_cache_slot

    # q and k heads: [HEADS_PAD, HALF_PAD] tiles of each half; rotated as apply_rope does, rounding
    # each product and the sum to the activation dtype.
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    hm = h < NUM_HEADS + NUM_KV_HEADS
    im = i < HALF
    m = hm[:, None] & im[None, :]
    off = h[:, None] * HEAD_DIM + i[None, :]
    x1 = tl.load(row + off, mask=m, other=0.0)
    x2 = tl.load(row + off + HALF, mask=m, other=0.0)
    dt = x1.dtype
    c = tl.load(cos_ptr + t * stride_cos + i, mask=im, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_cos + i, mask=im, other=0.0).to(tl.float32)[None, :]
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    o1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    is_q = h < NUM_HEADS
    q_off = t * stride_qo_t + h[:, None] * HEAD_DIM + i[None, :]
    tl.store(q_out_ptr + q_off, o1, mask=m & is_q[:, None])
    tl.store(q_out_ptr + q_off + HALF, o2, mask=m & is_q[:, None])
    # k heads go to the pool slot (slot -1: a padding token, nothing written).
    k_mask = m & (~is_q)[:, None] & (slot >= 0)
    k_off = dst + (h[:, None] - NUM_HEADS) * HEAD_DIM + i[None, :]
    tl.store(k_cache_ptr + k_off, o1, mask=k_mask)
    tl.store(k_cache_ptr + k_off + HALF, o2, mask=k_mask)

    # v heads: copied as they are.
    kv = tl.arange(0, KV_PAD)
    d = tl.arange(0, DIM_PAD)
    vm = (kv < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :] & (slot >= 0)
    v_off = kv[:, None] * HEAD_DIM + d[None, :]
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + v_off, mask=vm, other=0.0)
    tl.store(v_cache_ptr + dst + v_off, v, mask=vm)


def rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D], the fused projection
    cos: torch.Tensor,  # [T, D / 2] (any row stride, unit column stride)
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 => write nothing
    num_heads: int,
) -> torch.Tensor:
    """Rotate q and k by the step's RoPE rows, store k and v at their slots; returns q ``[T, H, D]``."""
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads}+2x{num_kv_heads} heads of {head_dim}")
    if (
        k_cache.stride() != v_cache.stride()
        or k_cache.stride(2) != head_dim
        or k_cache.stride(1) != num_kv_heads * head_dim
    ):
        raise ValueError(f"k/v cache slots must be contiguous [heads, head_dim] rows, got {tuple(k_cache.stride())}")
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must share strides with a unit column stride")
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    half = head_dim // 2
    _rope_store_kernel[(tokens,)](
        qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE=k_cache.shape[1],
        num_warps=4,
        **pdl.launch_kwargs(),
    )
    return q
