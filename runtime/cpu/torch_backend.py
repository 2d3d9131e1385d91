"""Paged attention in plain torch: the CPU backend, and the reference the other backends are tested against.

Decode tokens read their context straight from the pool with the C++ kernel when it loads
(``runtime.cpu.paged_attention``), else through one ``index_select`` gather per layer followed by a
batched masked attention (GQA by grouping query heads, never repeating K/V). Prefill tokens gather
their sequences' whole context (cached + new) and run one ``scaled_dot_product_attention`` per layer,
either flat under a block-diagonal causal mask or padded to one batch row per sequence, whichever
computes fewer scores this step; where a context is longer than PREFILL_Q_CHUNK, flat, each
sequence's queries that many at a time against only the keys they can see. Every index and mask is
built once per step in ``build_metadata``; a layer does no Python work per request.

Sliding-window layers (``window``: each query attends to its sequence's last ``window`` positions,
itself included, as transformers masks them) pass their window to the decode kernel, use the step's
masks narrowed to it (built once a step), and in bands gather only the keys each band's window reaches.
A step whose sequences all fit in the window is computed as without one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields

import torch
import torch.nn.functional as F

from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata, QKNorm
from servelm.runtime.cpu import paged_attention as _cpu_kernel
from servelm.runtime.cpu.torch_metadata import (  # builds on first use; unbuildable => torch path
    TorchAttentionMetadata,
    build_prefill,
    window_mask,
)

log = logging.getLogger(__name__)

# Query rows per attention call on a long context: each band meets only the keys it can see.
PREFILL_Q_CHUNK = 256

# (q, k_cache, v_cache, block_tables, seq_lens, scale, window=) -> out; a Callable cannot spell the keyword
DecodeKernel = Callable[..., torch.Tensor]


def _load_decode_kernel() -> DecodeKernel | None:
    try:
        # The compiled function itself: calling it directly skips the module wrapper's per-call lookup.
        return _cpu_kernel.load_kernel()
    except Exception as e:  # a broken build must not stop the server: the torch path is exact too
        log.warning("CPU paged-attention kernel failed to load (%s); using the torch fallback", e)
        return None


class TorchAttentionBackend(AttentionBackend):
    """CPU paged attention (see the module docstring). ``use_kernel=False`` forces the torch decode path."""

    def __init__(self, block_size: int, *, use_kernel: bool = True) -> None:
        self.block_size = block_size
        self.decode_kernel: DecodeKernel | None = _load_decode_kernel() if use_kernel else None
        # RoPE + K/V store + decode attention in one compiled call (decode-only float32 steps).
        self.rope_decode = _cpu_kernel.load_rope_decode() if self.decode_kernel is not None else None
        # Its address and ABI number, for a caller in another extension (``gguf.layer.DecodeStack``).
        self.rope_decode_address = _cpu_kernel.load_rope_decode_address() if self.rope_decode is not None else None
        self.name = "torch+cpu_kernel" if self.decode_kernel is not None else "torch"

    # ---- once per step -------------------------------------------------------------------------
    def build_metadata(self, meta: AttentionMetadata) -> TorchAttentionMetadata:
        m = TorchAttentionMetadata(**{f.name: getattr(meta, f.name) for f in fields(AttentionMetadata)})
        dev = m.slot_mapping.device
        bs = self.block_size
        nd = m.num_decodes
        m.num_real_tokens = sum(m.query_lens_list)

        if m.num_tokens and bool((m.slot_mapping < 0).any()):
            rows = torch.nonzero(m.slot_mapping >= 0).flatten()
            m.write_rows = rows
            m.write_slots = m.slot_mapping.index_select(0, rows)

        if nd:
            span_blocks = -(-max(m.seq_lens_list[:nd]) // bs)
            m.decode_seq_lens = m.seq_lens[:nd]
            m.decode_block_tables = m.block_tables[:nd, :span_blocks].contiguous()
            if self.decode_kernel is None:
                span = span_blocks * bs
                offs = torch.arange(bs, device=dev)
                slots = m.decode_block_tables.long().unsqueeze(-1) * bs + offs  # [nd, blocks, bs]
                m.decode_slots = slots.reshape(-1)
                valid = torch.arange(span, device=dev).unsqueeze(0) < m.decode_seq_lens.unsqueeze(1)
                mask = torch.zeros(valid.shape, dtype=torch.float32, device=dev).masked_fill_(~valid, float("-inf"))
                m.decode_mask = mask.view(nd, 1, 1, span)
                m.decode_span = span

        if m.num_seqs > nd:
            build_prefill(m, self.block_size, PREFILL_Q_CHUNK)
        return m

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
        args, rope_decode = self.fused_decode_args(meta), self.rope_decode
        if (
            args is None
            or rope_decode is None
            or qkv.dtype != torch.float32  # (the cache may be float32 or 16-bit: it stores k, v rounded)
            or not self.fused_decode_takes(k_cache, qk_norm)
        ):
            return None
        slots, block_tables, seq_lens, _ = args
        cos, sin = cos_sin
        q_w, k_w, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        return rope_decode(
            qkv,
            cos,
            sin,
            k_cache,
            v_cache,
            slots,
            block_tables,
            seq_lens,
            num_heads,
            scale,
            _effective(window, meta),
            q_w,
            k_w,
            eps,
        )

    @staticmethod
    def fused_decode_takes(k_cache: torch.Tensor, qk_norm: QKNorm | None) -> bool:
        """Whether the fused decode call takes a layer with this pool and these q/k norms."""
        return k_cache.dtype in (torch.float32, torch.float16, torch.bfloat16) and (
            qk_norm is None or all(w.dtype == torch.float32 and w.is_contiguous() for w in qk_norm[:2])
        )

    def fused_decode_args(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """The step's slot mapping, block tables, sequence lengths and longest sequence for the fused
        decode call (``rope_write_decode``), or None where the step has no such path: it must be
        decode-only and write every row. Rows may share a sequence (drafts, a draft model's catch-up):
        the call writes every row's K/V before any row attends, each up to its own length."""
        if (
            self.rope_decode is None
            or meta.num_decode_tokens != meta.num_tokens
            or not isinstance(meta, TorchAttentionMetadata)
            or meta.write_rows is not None
        ):
            return None
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        return meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens, meta.max_seq_len

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
        assert isinstance(meta, TorchAttentionMetadata), "metadata must come from build_metadata()"
        w = _effective(window, meta)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        # A 16-bit cache under float32 queries: every path attends to K/V as stored (rounded), so a
        # prompt gives the same tokens whether it is prefilled whole, chunked or cached.
        rounded = k_flat.dtype != k.dtype
        if rounded:
            k, v = k.to(k_flat.dtype), v.to(v_flat.dtype)
        if meta.write_rows is None:
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
        else:
            assert meta.write_slots is not None
            k_flat.index_copy_(0, meta.write_slots, k.index_select(0, meta.write_rows))
            v_flat.index_copy_(0, meta.write_slots, v.index_select(0, meta.write_rows))
        if rounded:
            k, v = k.to(q.dtype), v.to(q.dtype)

        nd = meta.num_decode_tokens
        real = meta.num_real_tokens
        outs = []
        if nd:
            outs.append(self._decode(q[:nd], k_cache, v_cache, k_flat, v_flat, meta, scale, w))
        if nd < real:
            outs.append(self._prefill(q[nd:real], k[nd:real], v[nd:real], k_flat, v_flat, meta, scale, w))
        if real < meta.num_tokens:  # padding rows (slot -1) at the tail attend to nothing
            outs.append(q.new_zeros((meta.num_tokens - real, *q.shape[1:])))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        if self.decode_kernel is not None:
            return self.decode_kernel(
                q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, window=window
            )
        assert meta.decode_slots is not None and meta.decode_mask is not None
        b, num_heads, head_dim = q.shape
        num_kv_heads = k_flat.shape[1]
        span = meta.decode_span
        # GQA by grouping query heads under their KV head: no repeated K/V.
        qg = q.reshape(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        keys = k_flat.index_select(0, meta.decode_slots).view(b, span, num_kv_heads, head_dim).to(q.dtype)
        vals = v_flat.index_select(0, meta.decode_slots).view(b, span, num_kv_heads, head_dim).to(q.dtype)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [b, kvh, group, span]
        mask = window_mask(meta, "decode", window) if window else meta.decode_mask
        probs = torch.softmax(scores + mask.to(scores.dtype), dim=-1)
        out = torch.matmul(probs, vals.transpose(1, 2))  # [b, kvh, group, head_dim]
        return out.reshape(b, num_heads, head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        mask = window_mask(meta, "prefill", window) if window else meta.prefill_mask
        if meta.prefill_batch is not None:
            assert meta.prefill_slots is not None and meta.prefill_q_index is not None
            assert meta.prefill_out_index is not None
            n, q_max, k_max = meta.prefill_batch
            num_heads, head_dim = q.shape[1], q.shape[2]
            qb = q.index_select(0, meta.prefill_q_index).view(n, q_max, num_heads, head_dim).transpose(1, 2)
            kb = k_flat.index_select(0, meta.prefill_slots).view(n, k_max, -1, head_dim).transpose(1, 2).to(q.dtype)
            vb = v_flat.index_select(0, meta.prefill_slots).view(n, k_max, -1, head_dim).transpose(1, 2).to(q.dtype)
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
            return out.transpose(1, 2).reshape(n * q_max, num_heads, head_dim).index_select(0, meta.prefill_out_index)
        banded = max(meta.seq_lens_list[meta.num_decodes :]) > PREFILL_Q_CHUNK
        if meta.prefill_slots is not None:
            if banded and window:  # each band gathers only the keys its window reaches, not the whole context
                return self._prefill_in_bands(q, k_flat, v_flat, mask, meta, scale, window, meta.prefill_slots)
            k = k_flat.index_select(0, meta.prefill_slots).to(q.dtype)
            v = v_flat.index_select(0, meta.prefill_slots).to(q.dtype)
        if banded:
            return self._prefill_in_bands(q, k, v, mask, meta, scale, window)
        # SDPA wants [batch, heads, tokens, head_dim]; the whole prefill is one "batch" row.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    @staticmethod
    def _prefill_in_bands(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        meta: TorchAttentionMetadata,
        scale: float,
        window: int,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The flat layout's prefills, each PREFILL_Q_CHUNK queries at a time against the keys those can
        see: from the first query's window (or position 0) to the last query. Under one mask over all
        keys SDPA computes every score, masked or not: the whole square for a windowed layer. With
        ``slots``, ``k`` and ``v`` are the pool's flat rows and each band gathers its own keys."""
        assert meta.prefill_positions is not None
        q_pos, k_pos = meta.prefill_positions
        outs, q0, k0 = [], 0, 0
        # Queries and keys go sequence by sequence: query row q0 + r is position ctx + r of its
        # sequence, key row k0 + i its position i.
        for ql, sl in zip(meta.query_lens_list[meta.num_decodes :], meta.seq_lens_list[meta.num_decodes :]):
            ctx = sl - ql
            for r0 in range(q0, q0 + ql, PREFILL_Q_CHUNK):
                r1 = min(q0 + ql, r0 + PREFILL_Q_CHUNK)
                lo, hi = k0 + (max(0, ctx + r0 - q0 - window + 1) if window else 0), k0 + ctx + r1 - q0
                band = mask[r0:r1, lo:hi] if mask is not None else k_pos[:, lo:hi] <= q_pos[r0:r1]
                kb, vb = (
                    (k[lo:hi], v[lo:hi])
                    if slots is None
                    else (t.index_select(0, slots[lo:hi]).to(q.dtype) for t in (k, v))
                )
                qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q[r0:r1], kb, vb))
                out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=band, scale=scale, enable_gqa=True)
                outs.append(out[0].transpose(0, 1))
            q0, k0 = q0 + ql, k0 + sl
        return torch.cat(outs)


def _effective(window: int | None, meta: AttentionMetadata) -> int:
    """The window to apply this step, 0 for none: a step whose sequences all fit in it needs none."""
    return window if window is not None and meta.max_seq_len > window else 0
