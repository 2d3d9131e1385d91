"""Decode attention over the paged KV pool on CPU: a compiled kernel and its pure-torch reference.

A decode token attends over its sequence's whole context. Gathering the context's blocks and
calling SDPA copies every K/V row every layer every step; the C++ kernel in
``csrc/paged_attention_cpu.cpp`` instead reads each row straight from the pool through the block
table (several times faster than gather + SDPA at batch 32). It is JIT-built with
``torch.utils.cpp_extension`` on first use and cached on disk; where it cannot be built or run,
``paged_decode_attention`` falls back to ``paged_decode_attention_reference``.

Shapes (shared by every function here):
    q             [B, H, D]                           float32 or bfloat16 (any strides)
    k_cache       [num_blocks, block_size, KVH, D]    q's dtype, or bf16/f16 under float32 q; contiguous (v_cache alike)
    block_tables  [B, max_blocks] int32               entries past ceil(seq_len/block_size) are never read
    seq_lens      [B] int32                           context length incl. the token just written, >= 1
    returns       [B, H, D]                           written into ``out`` when given
    window        int >= 0 (keyword)                  > 0: attend to each sequence's last ``window`` tokens only
Query head h uses KV head h // (H // KVH) (GQA; K/V are never repeated).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from servelm.runtime.cpu.extension import CompiledExtension

log = logging.getLogger(__name__)

DISABLE_ENV = "SERVELM_DISABLE_CPU_KERNEL"
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"

# (q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, window=0) -> Tensor
PagedDecodeAttention = Callable[..., torch.Tensor]


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Pure torch: gather each sequence's blocks, then masked attention (SDPA) in float32.

    The test oracle for the kernel and the fallback where it is unavailable. Like the kernel it
    reads only the pool rows of each sequence's own tokens (in its window): garbage table entries
    past its last block and stale (even NaN) rows are never touched.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if batch == 0:
        return q.new_empty(q.shape) if out is None else out
    lens = seq_lens.to(torch.int64)
    if int(lens.min()) < 1:
        raise ValueError("every sequence needs at least one token (seq_lens >= 1)")
    blocks_used = (lens + block_size - 1) // block_size  # [B]
    width = int(blocks_used.max())
    if width > block_tables.shape[1]:
        raise ValueError(f"seq_lens need {width} blocks but block_tables has {block_tables.shape[1]} columns")
    # Pool slot of every context position; only positions inside a sequence are gathered, so
    # table entries past its last block and stale rows of its last block are never read.
    ctx = width * block_size
    pos = torch.arange(ctx)
    valid = pos < lens[:, None]  # [B, ctx]
    if window > 0:  # only each sequence's last ``window`` positions are read
        valid &= pos >= lens[:, None] - window
    table = block_tables[:, :width].to(torch.int64)
    slots = table.gather(1, (pos // block_size).expand(batch, ctx)) * block_size + pos % block_size
    dst = valid.view(-1).nonzero().squeeze(1)
    src = slots.view(-1)[dst]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.reshape(-1, num_kv_heads, head_dim).index_select(0, src).float()
        padded = rows.new_zeros(batch * ctx, num_kv_heads, head_dim).index_copy_(0, dst, rows)
        return padded.view(batch, ctx, num_kv_heads, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    # GQA without repeating K/V: a KV head's query heads become the rows of one attention problem.
    group = num_heads // num_kv_heads
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    attn = F.scaled_dot_product_attention(
        qf, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale
    )  # [B, KVH, G, D]
    result = attn.reshape(batch, num_heads, head_dim).to(q.dtype)
    if out is None:
        return result
    return out.copy_(result)


def _self_check(fn: PagedDecodeAttention) -> str | None:
    """Compare the compiled kernel against the reference on a small case; a reason if it differs."""
    gen = torch.Generator().manual_seed(0)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    # (queries, cache): a 16-bit cache under float32 queries is what --kv-cache-dtype gives.
    cases = (
        (f32, f32, 64, 1e-5),
        (f32, f32, 40, 1e-5),
        (bf16, bf16, 64, 2e-2),
        (f32, bf16, 64, 1e-5),
        (f32, f16, 40, 1e-5),
    )
    for dtype, kv_dtype, head_dim, tol in cases:
        k_cache = torch.randn(8, 4, 2, head_dim, generator=gen).to(kv_dtype)
        v_cache = torch.randn(8, 4, 2, head_dim, generator=gen).to(kv_dtype)
        q = torch.randn(2, 6, head_dim, generator=gen).to(dtype)
        tables = torch.tensor([[3, 0, 5, 7, 1], [6, 2, 4, -1, -1]], dtype=torch.int32)
        lens = torch.tensor([19, 9], dtype=torch.int32)
        got = fn(q, k_cache, v_cache, tables, lens, 0.125)
        want = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125)
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=0):
            return f"self-check failed ({dtype} queries, {kv_dtype} cache, head_dim {head_dim})"
    return None


class _KernelLoader(CompiledExtension):
    """Builds the extension at most once per process and remembers the outcome (module or None)."""

    def __init__(self) -> None:
        # SOURCE is read at build time so that tests can point it at another file.
        super().__init__(
            "CPU paged-attention kernel",
            "servelm_paged_attention",
            lambda: SOURCE,
            lambda module: _self_check(module.paged_decode_attention),
            log,
        )


_loader = _KernelLoader()


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")


def _compiled(name: str, verbose: bool = False) -> Callable[..., torch.Tensor] | None:
    """Function ``name`` of the built extension, or None (disabled, or no build). Never raises."""
    if _disabled():
        return None
    module = _loader.get(verbose)
    return None if module is None else getattr(module, name)


def load_kernel(verbose: bool = False) -> PagedDecodeAttention | None:
    """The compiled ``paged_decode_attention``, or None where it cannot be used. Never raises.

    Builds once per process (cached on disk under ``$SERVELM_CACHE/torch_extensions``; the first
    build takes tens of seconds). ``SERVELM_DISABLE_CPU_KERNEL=1`` forces None.
    """
    return _compiled("paged_decode_attention", verbose)


def load_rope_decode() -> Callable[..., torch.Tensor] | None:
    """The compiled fused decode step (RoPE + K/V store + attention, float32), or None. Never raises."""
    return _compiled("rope_write_decode")


def load_rope_decode_address() -> tuple[int, int] | None:
    """``rope_write_decode``'s address and ABI number, for a caller in another compiled extension
    (``gguf_decode_stack``), or None. Never raises."""
    address = _compiled("rope_write_decode_address")
    return None if address is None else (int(address), int(_compiled("rope_write_decode_abi")))  # type: ignore[call-overload]


def load_portable_kernel() -> PagedDecodeAttention | None:
    """The compiled plain-loop implementation (no intrinsics), for tests and benchmarks."""
    return _compiled("paged_decode_attention_portable")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention over the paged pool: the compiled kernel where available, else the reference."""
    fn = load_kernel()
    if fn is None:
        fn = paged_decode_attention_reference
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale, out, window=window)
