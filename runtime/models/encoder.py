"""Bidirectional text encoders (BERT, MPNet, nomic-bert) over a flat batch of whole sequences.

The projections run on the step's tokens laid end to end (no padding); only attention pads, to the
longest sequence of the step, because every token attends to every other token of its own sequence.
No K/V outlives the forward: an encoder step computes each sequence whole and pools it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("bert", "mpnet", "nomic-bert")


@dataclass(frozen=True)
class EncoderConfig:
    """The shape of an encoder, from a Hugging Face config.json or a GGUF file's metadata."""

    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    type_vocab_size: int = 0  # token-type embeddings (BERT, nomic-bert): every token is type 0 here
    position_offset: int = 0  # MPNet numbers positions from pad_token_id + 1, as RoBERTa does
    rope_theta: float | None = None  # rotary positions (nomic-bert) instead of learned ones
    relative_buckets: int = 0  # MPNet's relative-position bias buckets (max distance 128)
    gated: bool = False  # SwiGLU feed-forward (nomic-bert) instead of GELU

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table (or the trained context) covers."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, cfg: dict[str, object]) -> EncoderConfig:
        kind = str(cfg.get("model_type"))
        if kind not in ("bert", "mpnet"):
            raise ValueError(f"model_type {kind!r} is not an encoder servelm serves ({', '.join(ARCHITECTURES)})")
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"{kind} with hidden_act {act!r}: only gelu is implemented")
        if kind == "bert" and cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT with relative position embeddings is not implemented")
        pad = int(cfg.get("pad_token_id", 1) or 0)  # type: ignore[call-overload]
        return cls(
            architecture=kind,
            vocab_size=int(cfg["vocab_size"]),  # type: ignore[call-overload]
            hidden_size=int(cfg["hidden_size"]),  # type: ignore[call-overload]
            num_layers=int(cfg["num_hidden_layers"]),  # type: ignore[call-overload]
            num_heads=int(cfg["num_attention_heads"]),  # type: ignore[call-overload]
            intermediate_size=int(cfg["intermediate_size"]),  # type: ignore[call-overload]
            max_position_embeddings=int(cfg["max_position_embeddings"]),  # type: ignore[call-overload]
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),  # type: ignore[arg-type]
            type_vocab_size=int(cfg.get("type_vocab_size", 0) or 0) if kind == "bert" else 0,  # type: ignore[call-overload]
            position_offset=pad + 1 if kind == "mpnet" else 0,
            relative_buckets=int(cfg.get("relative_attention_num_buckets", 32)) if kind == "mpnet" else 0,  # type: ignore[call-overload]
        )


@dataclass
class EncoderBatch:
    """One step's sequences laid end to end, and how attention pads them (built once per step)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], from 0 within each sequence
    seq_lens: list[int]
    starts: torch.Tensor  # [B] first row of each sequence
    pad_rows: torch.Tensor | None  # [T] row of each token in the padded [B * L] layout (None: no padding)
    key_mask: torch.Tensor | None  # [B, 1, 1, L] additive: -inf on padded keys

    @property
    def max_len(self) -> int:
        return max(self.seq_lens)

    @classmethod
    def build(cls, sequences: list[list[int]], device: torch.device) -> EncoderBatch:
        lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        starts = torch.tensor([0, *lens[:-1]], device=device).cumsum(0)
        if len(set(lens)) == 1:  # nothing to pad (one sequence, or all of one length)
            return cls(ids, positions, lens, starts, None, None)
        longest = max(lens)
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        pad_rows = seq * longest + positions
        valid = torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = torch.zeros(len(lens), 1, 1, longest, device=device).masked_fill(~valid[:, None, None, :], float("-inf"))
        return cls(ids, positions, lens, starts, pad_rows, mask)


def relative_position_bucket(relative: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """MPNet's (T5's bidirectional) bucketing of key minus query positions."""
    n = -relative
    half = num_buckets // 2
    ret = (n < 0).to(torch.long) * half
    n = n.abs()
    max_exact = half // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)).to(
        torch.long
    )
    large = torch.clamp(large, max=half - 1)
    return ret + torch.where(n < max_exact, n, large)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on halves (GPT-NeoX order, as llama.cpp applies it to nomic-bert)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Linear(nn.Linear):
    """A projection whose weight may be stored narrower than the activations (a GGUF file's float16),
    widened for each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class EncoderLayer(nn.Module):
    """Post-norm transformer layer: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, cfg: EncoderConfig, bias: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.qkv = Linear(h, 3 * h, bias=bias)
        self.out = Linear(h, h, bias=bias)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        up = 2 * cfg.intermediate_size if cfg.gated else cfg.intermediate_size
        self.up = Linear(h, up, bias=bias)  # gated: [gate; up]
        self.down = Linear(cfg.intermediate_size, h, bias=bias)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def attention(
        self,
        x: torch.Tensor,
        batch: EncoderBatch,
        bias: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        cfg = self.cfg
        t, nh, hd = x.shape[0], cfg.num_heads, cfg.head_dim
        q, k, v = self.qkv(x).view(t, 3, nh, hd).unbind(1)
        if rope is not None:
            q, k = rotate_neox(q, *rope), rotate_neox(k, *rope)
        b, longest = len(batch.seq_lens), batch.max_len
        if batch.pad_rows is None:
            q, k, v = (y.view(b, longest, nh, hd).transpose(1, 2) for y in (q, k, v))
        else:
            padded = []
            for y in (q, k, v):
                p = y.new_zeros(b * longest, nh, hd).index_copy_(0, batch.pad_rows, y)
                padded.append(p.view(b, longest, nh, hd).transpose(1, 2))
            q, k, v = padded
        mask = batch.key_mask
        if bias is not None:
            mask = bias if mask is None else mask + bias
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nh, L, hd]
        o = o.transpose(1, 2).reshape(b * longest, nh * hd)
        if batch.pad_rows is not None:
            o = o.index_select(0, batch.pad_rows)
        out: torch.Tensor = self.out(o)
        return out

    def forward(
        self,
        x: torch.Tensor,
        batch: EncoderBatch,
        bias: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        x = self.attn_norm(x + self.attention(x, batch, bias, rope))
        h = self.up(x)
        if self.cfg.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        out: torch.Tensor = self.ffn_norm(x + self.down(h))
        return out


class Encoder(nn.Module):
    """Token, position and type embeddings, then the layers; ``forward`` gives every token's last hidden state."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        bias = not cfg.gated  # nomic-bert has no biases
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = None if cfg.rope_theta else nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size else None
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.relative = nn.Embedding(cfg.relative_buckets, cfg.num_heads) if cfg.relative_buckets else None
        self.layers = nn.ModuleList(EncoderLayer(cfg, bias) for _ in range(cfg.num_layers))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.cfg.rope_theta:
            return None
        hd = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=positions.device) / hd))
        angles = positions.float()[:, None] * inv[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, hd/2], broadcast over heads

    def _relative_bias(self, longest: int, device: torch.device) -> torch.Tensor | None:
        if self.relative is None:
            return None
        pos = torch.arange(longest, device=device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.cfg.relative_buckets)
        bias: torch.Tensor = self.relative(buckets)
        return bias.permute(2, 0, 1)[None]  # [1, heads, L, L]

    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        dtype = self.embed_norm.weight.dtype  # the activations' (a table may be stored narrower)
        x = self.embed(batch.input_ids).to(dtype)
        if self.position is not None:
            x = x + self.position(batch.positions + self.cfg.position_offset).to(dtype)
        if self.token_type is not None:
            x = x + self.token_type.weight[0].to(dtype)
        x = self.embed_norm(x)
        bias = self._relative_bias(batch.max_len, x.device)
        if bias is not None:
            bias = bias.to(x.dtype)
        rope = self._rope(batch.positions)
        for layer in self.layers:
            x = layer(x, batch, bias, rope)
        return x  # type: ignore[no-any-return]  # (nn.Module calls are untyped)
