"""A GGUF file seen as a Hugging Face checkpoint: its config.json, its tensor names, its q/k row order.

llama.cpp's converter renames every tensor (``blk.N.attn_q.weight`` for
``model.layers.N.self_attn.q_proj.weight``), moves the config into ``<arch>.*`` metadata keys and, for
the ``llama`` architecture, permutes the rows of q_proj and k_proj into the interleaved-RoPE layout.
This module undoes all three without dequantizing anything, so a loader can keep each tensor in its
stored block format: a quantized block covers consecutive elements of one row, so the un-permutation
is a permutation of whole rows (``unpermute_rows``) that applies to raw block rows as well as to floats.
"""

from __future__ import annotations

import re
from os import PathLike
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

# GGUF architecture -> Hugging Face causal-LM class, as ``ModelConfig.from_hf_dict`` expects it.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# Architectures whose converter permuted q/k rows (llama.cpp's LlamaModel.permute; NEOX-RoPE ones did not).
PERMUTED_ARCHITECTURES = frozenset({"llama"})

# Architectures whose converter stored RMSNorm weights as 1 + w (transformers subtracts the 1 back).
NORM_PLUS_ONE_ARCHITECTURES = frozenset({"gemma3"})

# Whole-model tensors: GGUF name -> HF name.
_GLOBAL: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Per-layer tensors shared by every architecture here: GGUF suffix after ``blk.N.`` -> HF suffix.
_LAYER: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma 3 norms its sublayers' outputs too, so ``ffn_norm`` is the norm before the MLP there.
_LAYER_GEMMA3: dict[str, str] = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Tensors llama.cpp adds that a Hugging Face checkpoint does not hold (see ``hf_tensor_names``).
_NOT_IN_HF = frozenset({"rope_freqs.weight"})

# Tokenizer arrays with one entry per token (or merge), read as their lengths only.
_VOCAB_ARRAYS = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
)

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str) -> str:
    """The Hugging Face name of a GGUF tensor of architecture ``arch``; raises ``KeyError`` for an unknown one."""
    if arch not in ARCHITECTURES:
        raise KeyError(f"GGUF architecture {arch!r} is not mapped (known: {', '.join(ARCHITECTURES)})")
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m:
        layer, part, kind = m.groups()
        table = _LAYER_GEMMA3 if arch == "gemma3" else _LAYER
        if part in table:
            return f"model.layers.{layer}.{table[part]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _GLOBAL and kind in ("weight", "bias"):
            return f"{_GLOBAL[stem]}.{kind}"
    raise KeyError(f"GGUF tensor {gguf_name!r} has no Hugging Face name for architecture {arch!r}")


def needs_unpermute(hf_tensor_name: str, arch: str = "llama") -> bool:
    """Whether the converter permuted this tensor's rows (q_proj and k_proj weights and biases of ``llama``)."""
    return arch in PERMUTED_ARCHITECTURES and (
        ".self_attn.q_proj." in hf_tensor_name or ".self_attn.k_proj." in hf_tensor_name
    )


def unpermute_heads(hf_tensor_name: str, config: dict[str, Any]) -> int:
    """The head count the converter permuted a q or k tensor with: attention heads for q, KV heads for k."""
    if ".self_attn.k_proj." in hf_tensor_name:
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return int(config["num_attention_heads"])


def unpermute_rows(n_out: int, n_head: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's q/k permutation: ``hf_rows = stored_rows[unpermute_rows(...)]``.

    The converter stored, per head, the rotary pairs interleaved (row ``2d + j`` holds HF row
    ``j * head_dim/2 + d``); gathering rows by this index restores Hugging Face's half-split order.
    Whole rows move, so the index applies unchanged to raw quantized block rows.
    """
    if n_out % (2 * n_head):
        raise ValueError(f"{n_out} rows do not split into {n_head} heads of rotary pairs")
    half = n_out // n_head // 2
    # HF row (h, j, d) comes from stored row (h, d, j).
    stored = torch.arange(n_out).reshape(n_head, half, 2)
    return stored.transpose(1, 2).reshape(n_out)


def unpermute(weight_rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """A permuted q/k tensor (float rows, raw block rows ``[n_out, ...]``, or a bias) in HF row order."""
    return weight_rows.index_select(0, unpermute_rows(weight_rows.shape[0], n_head).to(weight_rows.device))


def norm_offset(gguf_name: str, arch: str) -> float:
    """What to add to a stored tensor's values for HF's: -1 for Gemma 3's RMSNorm weights, else 0."""
    return -1.0 if arch in NORM_PLUS_ONE_ARCHITECTURES and "norm.weight" in gguf_name else 0.0


def gguf_metadata(path: str | PathLike[str] | GGUFReader) -> tuple[dict[str, Any], list[str]]:
    """The file's metadata as plain Python values, and its tensor names in file order.

    The vocabulary-sized tokenizer arrays are given as their lengths: decoding 150k strings to read a
    config would cost more than the rest of the file's metadata together.
    """
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path, "r")
    meta = {key: len(field.data) if key in _VOCAB_ARRAYS else field.contents() for key, field in reader.fields.items()}
    return meta, [t.name for t in reader.tensors]


def hf_config_from_gguf(path: str | PathLike[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` equivalent of a GGUF file, as transformers' GGUF loader derives it.

    ``rope_theta`` is given both flat (transformers 4) and inside ``rope_parameters`` (transformers 5,
    per layer type for Gemma 3), so ``ModelConfig.from_hf_dict`` reads it either way. ``head_dim`` comes
    from ``attention.key_length`` when the file has it (transformers' table ignores it for qwen3).
    """
    meta, tensor_names = gguf_metadata(path)
    return hf_config_from_metadata(meta, tensor_names)


def hf_config_from_metadata(meta: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """``hf_config_from_gguf`` over metadata as ``gguf_metadata`` gives it (token list as its length)."""
    arch = meta["general.architecture"]
    if arch not in ARCHITECTURES:
        raise KeyError(f"GGUF architecture {arch!r} is not mapped (known: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    # Older files give head dims only as the rotary dimension, which equals the head dim for llama.
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch == "llama" else None)
    vocab = key("vocab_size") or meta.get("tokenizer.ggml.tokens")  # the token list's length
    theta = float(key("rope.freq_base", 10000.0))
    # Linear RoPE scaling (Gemma 3 4B and larger: its global layers), as llama.cpp's converter writes it.
    factor = key("rope.scaling.factor")
    linear_scaling = (
        {"rope_type": "linear", "factor": float(factor)} if key("rope.scaling.type") == "linear" and factor else {}
    )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        # Per-layer KV head counts (hybrid models) are outside the architectures mapped here.
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim) if head_dim else hidden // heads,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu",
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": int(vocab) if vocab is not None else None,
        # The converter drops ``output.weight`` exactly when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _int_or_none(meta.get("tokenizer.ggml.eos_token_id")),
    }
    if linear_scaling:
        config["rope_scaling"] = linear_scaling
        config["rope_parameters"] = {"rope_theta": theta, **linear_scaling}
    if arch == "gemma3":
        config.pop("rope_scaling", None)  # on the global layers only (rope_parameters below)
        config["hidden_activation"] = "gelu_pytorch_tanh"
        # llama.cpp's rule, as the file does not say: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for 62-layer 27B.
        config["query_pre_attn_scalar"] = hidden // heads if config["num_hidden_layers"] == 62 else config["head_dim"]
        # Gemma 3's sliding-window layers rotate with their own base, which llama.cpp fixes at 10000.
        local_theta = float(key("rope.freq_base_swa", 10000.0))
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": theta, **linear_scaling},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        }
        if key("attention.sliding_window") is not None:
            config["sliding_window"] = int(key("attention.sliding_window"))
    return config


def hf_tensor_names(tensor_names: list[str], arch: str) -> dict[str, str]:
    """GGUF name -> HF name for every tensor of a file; raises ``KeyError`` for one we cannot place.

    ``rope_freqs.weight`` (llama.cpp's per-frequency RoPE factors, Llama 3's scaling) has no HF tensor
    and is left out here; ``folder.prepare_folder`` puts it into config.json (``rope_freq_factors``).
    """
    return {name: hf_name(name, arch) for name in tensor_names if name not in _NOT_IN_HF}


def rope_freq_factors(reader: Any) -> list[float] | None:
    """``rope_freqs.weight``: llama.cpp's per-frequency RoPE divisors (how its converter stores Llama 3.1's
    scaling, which transformers then ignores), as a list; None when the file has none."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    return None


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
