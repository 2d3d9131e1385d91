"""What the engine settles before it serves: dtype, context length, EOS ids, the runner."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from servelm.runtime.config import ModelConfig
from servelm.runtime.platform import default_dtype
from servelm.runtime.runner import ModelRunner
from servelm.scheduler.config import EngineConfig

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
        return default_dtype(device)
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16") from None


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


def resolve_max_model_len(mc: ModelConfig, requested: int | None, sliding_window_supported: bool = True) -> int:
    """The context length served: the request, else the model's (capped), within its positions; and,
    where the attention backend has no sliding windows (CUDA), within the model's window."""
    max_model_len = requested or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's {mc.max_position_embeddings} positions"
        )
    window = mc.sliding_window
    if window is not None and max_model_len > window and not sliding_window_supported:
        # Within the window a windowed layer equals a full one: capped there, the model stays exact.
        if requested is not None:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding window of {window} tokens, and "
                f"sliding-window attention is implemented on CPU only: use --max-model-len {window} or less"
            )
        log.warning("max_model_len capped at the model's sliding window (%d tokens): no sliding windows on this device", window)
        max_model_len = window
    return max_model_len


def new_runner(
    model_dir: Path,
    mc: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    num_blocks: int | None,
    max_batched: int,
    max_model_len: int,
    config: EngineConfig,
) -> ModelRunner:
    return ModelRunner(
        model_dir,
        mc,
        device=device,
        dtype=dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_batched,
        max_num_seqs=config.max_num_seqs,
        seed=config.seed,
        max_model_len=max_model_len,
        enforce_eager=config.enforce_eager,
        quantization=config.quantization,
    )
