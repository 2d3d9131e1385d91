"""Model configuration: the subset of a Hugging Face ``config.json`` the runtime needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures our Llama-family implementation serves (HF ``architectures`` names).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",  # Llama with RoPE left out of every few layers (NoPE)
    "GraniteForCausalLM",  # Llama with scalar multipliers on embeddings, attention, residuals and logits
    "Gemma3ForCausalLM",  # Gemma 3 text (270M, 1B): sandwich norms, GELU, local/global RoPE, sliding windows (CPU)
)


class UnsupportedModelError(ValueError):
    """The model folder or file exists but is not something we can serve."""


def _sliding_window(
    arch: str, d: dict[str, Any], num_layers: int, nope_layers: tuple[int, ...]
) -> tuple[int | None, tuple[int, ...]]:
    """The attention window and the layers that use it, as transformers reads them: Mistral applies
    ``sliding_window`` on every layer whenever it is set (v0.1: 4096; later versions: null); Qwen2,
    Qwen3 and SmolLM3 only with ``use_sliding_window``, on the layers ``layer_types`` marks
    ``sliding_attention`` (written by transformers; else the default: SmolLM3's NoPE layers, Qwen's
    layers from ``max_window_layers`` on)."""
    window = d.get("sliding_window")
    if window is None:
        return None, ()
    if arch == "MistralForCausalLM":
        return int(window), tuple(range(num_layers))
    if arch == "Gemma3ForCausalLM":  # always windowed: 5 local layers to 1 global unless layer_types says
        types = d.get("layer_types")
        if not (isinstance(types, list) and len(types) == num_layers):
            pattern = int(d.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (int(window), layers) if layers else (None, ())
    if not d.get("use_sliding_window", False):
        return None, ()
    types = d.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif arch == "SmolLM3ForCausalLM":
        layers = nope_layers
    else:
        first = int(d.get("max_window_layers", num_layers))
        layers = tuple(range(first, num_layers))
    return (int(window), layers) if layers else (None, ())


def _rope_pair(params: dict[str, Any] | None, theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from a transformers-5 per-layer-type ``rope_parameters`` entry."""
    params = params or {}
    scaling = params if params.get("rope_type", "default") != "default" else None
    return float(params.get("rope_theta", theta)), scaling


def _gemma3(d: dict[str, Any], hidden: int) -> dict[str, Any]:
    """Gemma 3's fields beyond Llama's (transformers 4 and 5 config layouts)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key):
            raise UnsupportedModelError(f"Gemma 3 with {key}={d[key]} is not supported")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional Gemma 3 (an embedding model) is not a causal LM")
    rp = d.get("rope_parameters") or {}
    nested = isinstance(rp.get("full_attention"), dict) or isinstance(rp.get("sliding_attention"), dict)
    if nested:
        global_rope = _rope_pair(rp.get("full_attention"), float(d.get("rope_theta", 1_000_000.0)))
        local_rope = _rope_pair(rp.get("sliding_attention"), float(d.get("rope_local_base_freq", 10_000.0)))
    else:  # transformers 4: rope_theta / rope_scaling for global layers, rope_local_base_freq for local ones
        global_rope = (float(d.get("rope_theta", 1_000_000.0)), d.get("rope_scaling"))
        local_rope = (float(d.get("rope_local_base_freq", 10_000.0)), None)
    return {
        "global_rope": global_rope,
        "local_rope": local_rope,
        "qk_norm": True,
        "gemma_norms": True,
        "sandwich_norms": True,
        "embedding_multiplier": float(hidden) ** 0.5,
        "embedding_multiplier_in_dtype": True,
        "attention_multiplier": float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
    }


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None  # the attention window of the layers in ``window_layers``
    window_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # SmolLM3: the layers that apply no RoPE at all (NoPE); empty for every other architecture
    nope_layers: tuple[int, ...] = ()
    # Granite: embeddings x embedding_multiplier, attention scale attention_multiplier (None: head_dim^-0.5),
    # each sublayer's output x residual_multiplier before its residual add, logits / logits_scaling
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the attention score scale (also Gemma's query_pre_attn_scalar^-0.5)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Gemma 3: the embedding multiplier rounded to the weights' dtype first; RMSNorms scale by 1 + w in
    # float32; a norm on each sublayer's output too ("sandwich"); GELU (tanh) in the MLP; the sliding
    # layers' own RoPE (theta, scaling)
    embedding_multiplier_in_dtype: bool = False
    gemma_norms: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    local_rope: tuple[float, dict[str, Any] | None] | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch or '(none given)'!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)
        # transformers 5 folds rope_theta and scaling into ``rope_parameters``; 4.x used ``rope_scaling``.
        rope_params = d.get("rope_parameters") or {}
        rope_scaling = d.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        num_layers = int(d["num_hidden_layers"])
        nope: tuple[int, ...] = ()
        if arch == "SmolLM3ForCausalLM":
            # Per layer 1 = RoPE, 0 = none; absent, a NoPE layer every ``no_rope_layer_interval`` (as transformers).
            flags = d.get("no_rope_layers")
            if flags is None:
                every = int(d.get("no_rope_layer_interval", 4))
                flags = [int((i + 1) % every != 0) for i in range(num_layers)]
            nope = tuple(i for i, f in enumerate(flags) if not f)
        granite = arch == "GraniteForCausalLM"
        window, window_layers = _sliding_window(arch, d, num_layers, nope)
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"unsupported activation {act!r} (silu, gelu_pytorch_tanh)")
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            window_layers=window_layers,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            nope_layers=nope,
            embedding_multiplier=float(d.get("embedding_multiplier", 1.0)) if granite else 1.0,
            attention_multiplier=float(d.get("attention_multiplier", 1.0)) if granite else None,
            residual_multiplier=float(d.get("residual_multiplier", 1.0)) if granite else 1.0,
            logits_scaling=float(d.get("logits_scaling", 1.0)) if granite else 1.0,
            hidden_act="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
        )
        if arch == "Gemma3ForCausalLM":
            gemma = _gemma3(d, hidden)
            fields["rope_theta"], fields["rope_scaling"] = gemma.pop("global_rope")
            fields.update(gemma)
        return cls(**fields)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise UnsupportedModelError(f"{path}: expected a Hugging Face model folder with config.json")
        return cls.from_hf_dict(json.loads(p.read_text()))

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * i
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + mlp + norms
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h
