"""Gemma 3 text layers run bidirectionally (EmbeddingGemma): every token attends to every token of its
sequence, within half the sliding window either way on its sliding-window layers, over the flat batch of
``models.encoder`` (projections on the tokens laid end to end, attention padded to the longest)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from servelm.runtime.models.encoder import EncoderBatch, rotate_neox


@dataclass(frozen=True)
class GemmaEncoderConfig:
    """The shape of a ``gemma3_text`` model with ``use_bidirectional_attention``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    sliding_window: int
    sliding: tuple[bool, ...]  # per layer: a sliding-window layer (else full attention)
    rope_theta: float
    rope_local_theta: float
    query_pre_attn_scalar: float
    architecture: str = "gemma3_text"
    type_vocab_size: int = 0

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict[str, object]) -> GemmaEncoderConfig:
        if not cfg.get("use_bidirectional_attention"):
            raise ValueError("a gemma3_text model without use_bidirectional_attention is a decoder, not an encoder")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh" or cfg.get("rope_scaling"):
            raise ValueError("gemma3_text encoder: only gelu_pytorch_tanh and unscaled RoPE are implemented")
        layers = int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
        types: list[str] = cfg.get("layer_types") or [  # type: ignore[assignment]
            "full_attention" if (i + 1) % int(cfg.get("_sliding_window_pattern", 6)) == 0 else "sliding_attention"  # type: ignore[call-overload]
            for i in range(layers)
        ]
        return cls(
            vocab_size=int(cfg["vocab_size"]),  # type: ignore[call-overload]
            hidden_size=int(cfg["hidden_size"]),  # type: ignore[call-overload]
            num_layers=layers,
            num_heads=int(cfg["num_attention_heads"]),  # type: ignore[call-overload]
            num_kv_heads=int(cfg["num_key_value_heads"]),  # type: ignore[call-overload]
            head_dim=int(cfg["head_dim"]),  # type: ignore[call-overload]
            intermediate_size=int(cfg["intermediate_size"]),  # type: ignore[call-overload]
            max_position_embeddings=int(cfg["max_position_embeddings"]),  # type: ignore[call-overload]
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            sliding_window=int(cfg["sliding_window"]),  # type: ignore[call-overload]
            sliding=tuple(t == "sliding_attention" for t in types),
            rope_theta=float(cfg.get("rope_theta", 1e6)),  # type: ignore[arg-type]
            rope_local_theta=float(cfg.get("rope_local_base_freq", 1e4)),  # type: ignore[arg-type]
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", cfg["head_dim"])),  # type: ignore[arg-type]
        )


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scaled by (1 + weight), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaEncoderLayer(nn.Module):
    def __init__(self, cfg: GemmaEncoderConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.q_norm, self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps), GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)

    def _heads(self, y: torch.Tensor, n: int, batch: EncoderBatch) -> torch.Tensor:
        """``[T, n * hd]`` -> ``[B, n, L, hd]`` (padded where the batch pads)."""
        hd, b, longest = self.cfg.head_dim, len(batch.seq_lens), batch.max_len
        y = y.view(-1, n, hd)
        if batch.pad_rows is not None:
            y = y.new_zeros(b * longest, n, hd).index_copy_(0, batch.pad_rows, y)
        return y.view(b, longest, n, hd).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, batch: EncoderBatch, mask: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        cfg = self.cfg
        t, hd = x.shape[0], cfg.head_dim
        h = self.input_layernorm(x)
        q = rotate_neox(self.q_norm(self.q_proj(h).view(t, cfg.num_heads, hd)), *rope)
        k = rotate_neox(self.k_norm(self.k_proj(h).view(t, cfg.num_kv_heads, hd)), *rope)
        q, k = (
            self._heads(q.reshape(t, -1), cfg.num_heads, batch),
            self._heads(k.reshape(t, -1), cfg.num_kv_heads, batch),
        )
        v = self._heads(self.v_proj(h), cfg.num_kv_heads, batch)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=cfg.query_pre_attn_scalar**-0.5, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(-1, cfg.num_heads * hd)
        if batch.pad_rows is not None:
            o = o.index_select(0, batch.pad_rows)
        x = x + self.post_attention_layernorm(self.o_proj(o))
        h = self.pre_feedforward_layernorm(x)
        h = self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))
        out: torch.Tensor = x + self.post_feedforward_layernorm(h)
        return out


class GemmaEncoder(nn.Module):
    """Scaled token embeddings, the layers, the final norm: every token's last hidden state."""

    def __init__(self, cfg: GemmaEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaEncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _rope(self, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.cfg.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=positions.device) / hd))
        angles = positions.float()[:, None] * inv[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        cfg = self.cfg
        x = self.embed_tokens(batch.input_ids)
        x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype first, as Gemma does
        longest, dev = batch.max_len, x.device
        pos = torch.arange(longest, device=dev)
        # Sliding layers: half the window either way, as transformers runs bidirectional Gemma 3 (its config
        # turns ``sliding_window`` into ``sliding_window // 2 + 1``, an exclusive bound on the distance).
        reach = cfg.sliding_window // 2
        window = torch.zeros(longest, longest, device=dev).masked_fill(
            (pos[None, :] - pos[:, None]).abs() > reach, float("-inf")
        )
        keys = batch.key_mask
        masks = {False: keys, True: window if keys is None else keys + window}
        if longest <= reach + 1:
            masks[True] = keys  # the window covers every pair
        ropes = {
            True: self._rope(batch.positions, cfg.rope_local_theta),
            False: self._rope(batch.positions, cfg.rope_theta),
        }
        for layer, sliding in zip(self.layers, cfg.sliding):
            x = layer(x, batch, masks[sliding], ropes[sliding])
        return self.norm(x)  # type: ignore[no-any-return]  # (nn.Module calls are untyped)
