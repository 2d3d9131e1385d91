"""The attention-backend interface: one implementation per device, chosen at start-up.

Token order inside a step: the runner lays out all *decode* sequences first (exactly one new
token each), then the *prefill* sequences (a prompt, a prompt chunk, or a recompute after
preemption: any number of new tokens, attending causally to their cached context plus themselves).

KV pool layout, shared by every backend (it is flash-attn's paged layout):
``k_cache[layer]``, ``v_cache[layer]``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
The slot of token position ``p`` of a sequence is ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

# The q and k heads' RMSNorm weights (float32, Gemma's 1 + w folded in) and their eps.
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and handed to every layer.

    All tensors live on the model's device. Backends may subclass it to add derived fields
    (built once in ``AttentionBackend.build_metadata``, never per layer).
    """

    num_tokens: int  # tokens in this step (decode tokens first)
    num_decodes: int  # the first ``num_decodes`` sequences (and tokens) are single-token decodes
    num_decode_tokens: int  # == num_decodes (kept explicit for readability of the slicing)
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 => padding, write nothing
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length *after* this step (computed + new)
    context_lens: torch.Tensor  # [num_seqs] int32, tokens already cached *before* this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Python copies the CPU paths use to slice without a device sync.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # Several decode rows are positions of one sequence (speculative drafts verified as decodes, each
    # attending up to its own position): every row's K/V must be stored before any row attends, so
    # kernels that store and attend row by row must not run.
    decode_rows_share_sequences: bool = field(
        default=False, kw_only=True
    )  # (keyword-only: subclasses add required fields)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class AttentionBackend(ABC):
    """Writes new K/V into the pool and attends over each sequence's blocks."""

    name: str = "abstract"

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Add backend-specific fields once per step (default: nothing to add)."""
        return meta

    def forward_from_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # the step's RoPE rows, [num_tokens, 1, head_dim / 2] each
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        num_heads: int,
        window: int | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor | None:
        """Optional fused path: RoPE, the K/V store and attention straight from the fused projection.
        ``qk_norm`` (Qwen3, Gemma 3): RMSNorm each q and k head first, with these weights and eps.

        Returns ``[num_tokens, num_heads, head_dim]`` like ``forward`` after the model's own RoPE, or
        None where this backend has no such path for this step (the model then does it the usual way;
        the CPU backend has one for decode-only float32 steps, the CUDA backends for every step).
        """
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window: attend to the last ``window`` positions only (None: all)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v at ``meta.slot_mapping``, then causal attention of each query over its sequence
        (over its last ``window`` positions, itself included, for a sliding-window layer: only the
        models' windowed layers pass one, and a backend that has no windows refuses a step it would cut)."""
