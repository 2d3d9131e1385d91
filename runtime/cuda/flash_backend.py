"""CUDA attention backends: FlashAttention 2 over the paged pool, and a Triton fallback.

Importing this module imports neither ``flash_attn`` nor ``triton``: both are imported when a
backend is constructed, so ``runtime.platform`` may import it to ask questions (block size, availability).

Token order (``runtime/attention/base.py``): the first ``num_decodes`` tokens are single-token
decodes, the rest are prefill chunks. Every derived tensor the decode half reads is a *view* of
the runner's metadata tensors, so a CUDA graph captured over a decode-only step reads whatever
the runner writes into those buffers before each replay.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata, QKNorm

log = logging.getLogger(__name__)

# Upstream flash-attn 2.x checks ``page_block_size % 256 == 0`` for a paged KV cache, in both
# ``flash_attn_with_kvcache`` and ``flash_attn_varlen_func`` ("Paged KV cache block size must be
# divisible by 256"); forks such as vLLM's relax it to 16, upstream does not.
FLASH_PAGED_BLOCK_SIZE = 256
# The Triton fallback has no constraint; 16 keeps internal fragmentation and prefix-cache granularity low.
TRITON_BLOCK_SIZE = 16


@dataclass
class CudaAttentionMetadata(AttentionMetadata):
    """The step's metadata split into its decode and prefill halves (built once per step)."""

    # Decode half: views into the base tensors (CUDA-graph safe).
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_query_start_loc: torch.Tensor  # [num_decodes + 1] int32 (0, 1, 2, ...)
    # Prefill half.
    num_prefills: int
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    prefill_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets into the *whole* step
    prefill_cu_seqlens_q: torch.Tensor | None  # [num_prefills + 1] int32 from 0 (flash-attn only)
    prefill_cu_seqlens_k: torch.Tensor | None  # [num_prefills + 1] int32 from 0 (flash-attn only)
    prefill_max_query_len: int
    prefill_max_seq_len: int


def split_metadata(meta: AttentionMetadata, *, cu_seqlens: bool) -> CudaAttentionMetadata:
    """Derive the decode/prefill views once per step. ``cu_seqlens``: also build flash-attn's
    zero-based cumulative lengths for the prefill half (two tiny device ops)."""
    if isinstance(meta, CudaAttentionMetadata):
        return meta
    nd = meta.num_decodes
    num_seqs = meta.num_seqs
    num_prefills = num_seqs - nd
    prefill_qsl = meta.query_start_loc[nd:]
    cu_q = cu_k = None
    max_q = max_k = 0
    if num_prefills:
        max_q = max(meta.query_lens_list[nd:])
        max_k = max(meta.seq_lens_list[nd:])
        if cu_seqlens:
            cu_q = prefill_qsl - meta.num_decode_tokens
            cu_k = torch.zeros(num_prefills + 1, dtype=torch.int32, device=meta.seq_lens.device)
            torch.cumsum(meta.seq_lens[nd:], 0, out=cu_k[1:])
    base = {f.name: getattr(meta, f.name) for f in fields(AttentionMetadata)}
    return CudaAttentionMetadata(
        **base,
        decode_seq_lens=meta.seq_lens[:nd],
        decode_context_lens=meta.context_lens[:nd],
        decode_block_tables=meta.block_tables[:nd],
        decode_query_start_loc=meta.query_start_loc[: nd + 1],
        num_prefills=num_prefills,
        prefill_seq_lens=meta.seq_lens[nd:],
        prefill_context_lens=meta.context_lens[nd:],
        prefill_block_tables=meta.block_tables[nd:],
        prefill_query_start_loc=prefill_qsl,
        prefill_cu_seqlens_q=cu_q,
        prefill_cu_seqlens_k=cu_k,
        prefill_max_query_len=max_q,
        prefill_max_seq_len=max_k,
    )


def fused_ops_enabled() -> bool:
    """Whether the CUDA path uses the fused Triton ops of ``runtime.cuda.triton_ops`` (RoPE + K/V store,
    residual add + RMSNorm, SiLU x up); ``SERVELM_DISABLE_FUSED_OPS=1`` falls back to plain torch ops."""
    return os.environ.get("SERVELM_DISABLE_FUSED_OPS", "").lower() not in ("1", "true", "yes")


DECODE_GEMV_MODES = ("auto", "on", "off")


def decode_gemv_mode() -> str:
    """``SERVELM_DECODE_GEMV``: whether decode steps of 1-4 rows use the fused few-row projections
    (``runtime.cuda.triton_gemv``). ``auto`` (default): per captured CUDA-graph size up to
    ``triton_gemv.AUTO_MAX_ROWS``, whichever of fused and plain replays faster at start-up (plain
    when eager); ``on``: always, up to ``MAX_ROWS``; ``off``: never."""
    mode = os.environ.get("SERVELM_DECODE_GEMV", "auto").strip().lower() or "auto"
    if mode not in DECODE_GEMV_MODES:
        raise ValueError(f"SERVELM_DECODE_GEMV must be one of {', '.join(DECODE_GEMV_MODES)}, got {mode!r}")
    return mode


def flash_attn_importable() -> bool:
    """True when flash-attn 2 is installed: a ``flash_attn`` package with its ``flash_attn_interface``
    (checked without importing it). flash-attn-4 alone installs only ``flash_attn.cute``, without the
    paged-KV functions this backend calls; a package that is there but does not load is caught when the
    backend is built (``select_cuda_backend``)."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        return False
    return any(Path(p, "flash_attn_interface.py").is_file() for p in spec.submodule_search_locations or [])


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_no_window(window: int | None, meta: AttentionMetadata) -> None:
    """The CUDA backends attend over whole contexts: a sliding window that would cut one is refused
    (the engine caps max_model_len at the window on CUDA, so this does not happen when serving)."""
    if window is not None and meta.max_seq_len > window:
        raise NotImplementedError(
            f"sliding-window attention (window {window}, a sequence of {meta.max_seq_len} tokens) is not implemented on CUDA"
        )


class PagedCudaBackend(AttentionBackend):
    """What both CUDA backends share: new K/V go into the pool through the Triton store kernel (or,
    on the fused path, through one RoPE + store kernel), then ``_attend`` reads the pool."""

    fused_rope: bool = True

    def __init__(self, fused_rope: bool | None) -> None:
        from servelm.runtime.cuda import triton_ops
        from servelm.runtime.cuda.triton_kernels import store_kvcache

        self._store = store_kvcache
        self._ops = triton_ops
        self.fused_rope = fused_ops_enabled() if fused_rope is None else fused_rope

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        check_no_window(window, meta)
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def forward_from_qkv(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        num_heads: int,
        window: int | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor | None:
        """One Triton kernel rotates q and k and stores k and v (``runtime.cuda.triton_ops``), then
        ``_attend`` reads the pool; None (the model's own RoPE, then ``forward``) when the fused ops are off."""
        check_no_window(window, meta)
        if not self.fused_rope or qk_norm is not None:  # (no q/k norms in the Triton kernel)
            return None
        cos, sin = cos_sin  # [T, 1, D / 2] rows of the step
        q = self._ops.rope_store(qkv, cos[:, 0], sin[:, 0], k_cache, v_cache, meta.slot_mapping, num_heads)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention of the step's queries over the pool (their own K/V already stored)."""
        raise NotImplementedError


class FlashAttentionBackend(PagedCudaBackend):
    """FlashAttention 2 reading K/V straight from the paged pool through the block table.

    Decodes go through ``flash_attn_with_kvcache`` (split-KV kernels tuned for one query token);
    prefill chunks through ``flash_attn_varlen_func(..., block_table=...)`` so a chunk attends to its
    cached context (earlier chunks, prefix-cache hits) in place. New K/V are written first by the
    Triton store kernel. Requires fp16/bf16, head_dim % 8 == 0 and <= 256, and a pool block size
    that is a multiple of ``required_block_size``.
    """

    name = "flash-attn"
    required_block_size: int = FLASH_PAGED_BLOCK_SIZE

    def __init__(self, block_size: int = FLASH_PAGED_BLOCK_SIZE, fused_rope: bool | None = None) -> None:
        if block_size % self.required_block_size:
            raise ValueError(
                f"flash-attn's paged KV needs a block size divisible by {self.required_block_size}, got {block_size}"
            )
        self.block_size = block_size  # the pool's block size this backend was built for (the engine reads it)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        super().__init__(fused_rope)
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @classmethod
    def supports(cls, dtype: torch.dtype, head_dim: int, block_size: int | None = None) -> str | None:
        """None when this backend can serve the configuration, else the reason it cannot."""
        if not flash_attn_importable():
            return "flash_attn 2 is not installed (flash-attn-4's flash_attn.cute alone does not count)"
        if not triton_importable():
            return "triton is not installed (needed for the KV store kernel)"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn needs float16 or bfloat16, not {dtype}"
        if head_dim % 8 or head_dim > 256:
            return f"flash-attn needs head_dim divisible by 8 and at most 256, got {head_dim}"
        if block_size is not None and block_size % cls.required_block_size:
            return f"flash-attn's paged KV needs a block size divisible by {cls.required_block_size}, got {block_size}"
        return None

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        return split_metadata(meta, cu_seqlens=True)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention of the step's queries over the pool (their own K/V already stored)."""
        # Built once per step by build_metadata (the runner and the graph runner both call it), never per layer.
        assert isinstance(meta, CudaAttentionMetadata), "metadata must come from build_metadata()"
        m = meta
        out = torch.empty_like(q)
        nd = m.num_decode_tokens
        if nd:
            # k/v are not passed: the new token is already in the pool, so cache_seqlens counts it.
            dec = self._with_kvcache(
                q[:nd].unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=m.decode_seq_lens,
                block_table=m.decode_block_tables,
                softmax_scale=scale,
                causal=True,
            )
            out[:nd] = dec.squeeze(1)
        if m.num_prefills:
            # Paged varlen: k/v are the pool; cu_seqlens_k gives each sequence's key count (cached +
            # new) and the causal mask is bottom-right aligned, i.e. offset by the cached context.
            # (Upstream 2.x exposes no seqused_k on this function; with block_table, cu_seqlens_k
            # only carries lengths, the block table says where the keys are.)
            out[nd : m.num_tokens] = self._varlen(
                q[nd : m.num_tokens],
                k_cache,
                v_cache,
                cu_seqlens_q=m.prefill_cu_seqlens_q,
                cu_seqlens_k=m.prefill_cu_seqlens_k,
                max_seqlen_q=m.prefill_max_query_len,
                max_seqlen_k=m.prefill_max_seq_len,
                softmax_scale=scale,
                causal=True,
                block_table=m.prefill_block_tables,
            )
        return out


class TritonPagedBackend(PagedCudaBackend):
    """The CUDA fallback when flash-attn is missing (or the dtype is float32): Triton store and
    paged attention kernels; any block size."""

    name = "triton-paged"
    required_block_size: int = 1
    preferred_block_size: int = TRITON_BLOCK_SIZE

    def __init__(self, block_size: int = TRITON_BLOCK_SIZE, fused_rope: bool | None = None) -> None:
        self.block_size = block_size
        from servelm.runtime.cuda import triton_decode, triton_kernels

        super().__init__(fused_rope)
        self._kernels: Any = triton_kernels
        self._decode: Any = triton_decode

    @classmethod
    def supports(cls, dtype: torch.dtype, head_dim: int, block_size: int | None = None) -> str | None:
        if not triton_importable():
            return "triton is not installed"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"unsupported dtype {dtype}"
        return None

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        return split_metadata(meta, cu_seqlens=False)

    def forward_from_qkv(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        num_heads: int,
        window: int | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor | None:
        """A decode-only step small enough for split-KV decode does RoPE, the K/V store and attention in
        one launch (``triton_decode.rope_paged_decode``, plus its merge): one kernel a layer fewer."""
        check_no_window(window, meta)
        if (
            self.fused_rope
            and qk_norm is None
            and isinstance(meta, CudaAttentionMetadata)
            and meta.num_prefills == 0
            and meta.num_decodes
            and not meta.decode_rows_share_sequences
        ):
            cos, sin = cos_sin  # [T, 1, D / 2] rows of the step
            out = self._decode.rope_paged_decode(
                qkv, cos[:, 0], sin[:, 0], k_cache, v_cache, meta.slot_mapping,
                meta.decode_block_tables, meta.decode_seq_lens, scale, num_heads,
            )  # fmt: skip
            if out is not None:
                return out
        return super().forward_from_qkv(qkv, cos_sin, k_cache, v_cache, meta, scale, num_heads)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention of the step's queries over the pool (their own K/V already stored)."""
        # Built once per step by build_metadata (the runner and the graph runner both call it), never per layer.
        assert isinstance(meta, CudaAttentionMetadata), "metadata must come from build_metadata()"
        m = meta
        kern = self._kernels
        out = torch.empty_like(q)
        if m.num_decodes:
            kern.paged_attention(
                q,
                k_cache,
                v_cache,
                m.decode_block_tables,
                m.decode_seq_lens,
                m.decode_query_start_loc,
                m.decode_context_lens,
                scale,
                max_query_len=1,
                out=out,
            )
        if m.num_prefills:
            # query_start_loc holds offsets into the whole step, so q and out are passed whole.
            kern.paged_attention(
                q,
                k_cache,
                v_cache,
                m.prefill_block_tables,
                m.prefill_seq_lens,
                m.prefill_query_start_loc,
                m.prefill_context_lens,
                scale,
                max_query_len=m.prefill_max_query_len,
                out=out,
            )
        return out


def default_cuda_block_size(dtype: torch.dtype, head_dim: int) -> int:
    """The block size the engine should use on CUDA: flash-attn's when it can serve, else Triton's."""
    if FlashAttentionBackend.supports(dtype, head_dim) is None:
        return FlashAttentionBackend.required_block_size
    return TritonPagedBackend.preferred_block_size


def select_cuda_backend(
    block_size: int, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> AttentionBackend:
    """FlashAttention when it can serve (installed, fp16/bf16, head_dim, ``block_size``), else the
    Triton paged fallback with a warning saying why; ``dtype``/``head_dim`` refine the check when given."""
    if dtype is not None and head_dim is not None:
        why_not = FlashAttentionBackend.supports(dtype, head_dim, block_size)
    else:
        why_not = FlashAttentionBackend.supports(torch.bfloat16, 128, block_size)
    flash: AttentionBackend | None = None
    if why_not is None:
        try:
            flash = FlashAttentionBackend(block_size)
        except Exception as exc:  # installed but not loadable: built for another torch / CUDA, say
            why_not = f"it is installed but does not load: {type(exc).__name__}: {exc}"
    if flash is None:
        log.warning("not using flash-attn (%s); using the Triton paged-attention fallback", why_not)
    return flash if flash is not None else TritonPagedBackend(block_size)
