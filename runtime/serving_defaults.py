"""The runtime's defaults for a served model, settled at start-up from the flags and the model: the
weights' and the KV cache's dtypes, the GGUF activations, the context length and the EOS ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from servelm.runtime.config import ModelConfig
from servelm.runtime.platform import platform_of

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

DEFAULT_MAX_MODEL_LEN_CAP = 8192


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype name, or ``auto``: the device's default."""
    if name == "auto":
        return platform_of(device).default_dtype
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16") from None


def resolve_gguf_activations(name: str, as_stored: bool) -> str:
    """``auto``: ``int8`` (llama.cpp's arithmetic, the fast one) for a GGUF file served as stored, else
    ``float32`` (the exact one, which ``--gguf-activations float32`` keeps for a GGUF file)."""
    if name != "auto":
        return name
    return "int8" if as_stored else "float32"


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device, like_llama_cpp: bool = False) -> torch.dtype:
    """The KV cache's dtype: ``auto`` is the model's, or float16 where the model runs llama.cpp's
    arithmetic (its default cache); a 16-bit cache under float32 weights on CPU."""
    if name == "auto":
        kv_dtype = torch.float16 if like_llama_cpp else dtype
    else:
        kv_dtype = resolve_dtype(name, device)
    if not platform_of(device).kv_dtype_supported(dtype, kv_dtype):
        raise ValueError(
            f"--kv-cache-dtype {name} with --dtype {DTYPE_NAMES.get(dtype, dtype)} on {device}: a cache "
            "unlike the weights is served on CPU under float32 weights only (use --kv-cache-dtype auto)"
        )
    return kv_dtype


def eos_ids(model_dir: Path, model_config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json (Llama 3 lists several) and the tokenizer."""
    ids: list[int] = list(model_config.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            ids.extend(int(e) for e in eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.append(tok_eos)
    return tuple(dict.fromkeys(ids))


def resolve_max_model_len(
    mc: ModelConfig, requested: int | None, sliding_window_supported: bool = True, pool_tokens: int | None = None
) -> int:
    """The context length served: the request; else the model's positions as far as the KV pool holds
    them (``pool_tokens``, where the pool's size is known first), at least DEFAULT_MAX_MODEL_LEN_CAP
    (a pool that holds less is then refused by ``plan_capacity``), or with no pool size that cap; and,
    where the attention backend has no sliding windows (CUDA), within the model's window."""
    default = DEFAULT_MAX_MODEL_LEN_CAP if pool_tokens is None else max(DEFAULT_MAX_MODEL_LEN_CAP, pool_tokens)
    max_model_len = requested or min(mc.max_position_embeddings, default)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {mc.max_position_embeddings} positions")
    window = mc.sliding_window
    if window is not None and max_model_len > window and not sliding_window_supported:
        # Within the window a windowed layer equals a full one: capped there, the model stays exact.
        if requested is not None:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding window of {window} tokens, and "
                f"sliding-window attention is implemented on CPU only: use --max-model-len {window} or less"
            )
        log.warning(
            "max_model_len capped at the model's sliding window (%d tokens): no sliding windows on this device", window
        )
        max_model_len = window
    return max_model_len
