"""What the API side knows of an engine: facts settled at load, the same whether the engine steps in a
thread of this process or in an engine-core process (which sends them when it is ready)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelm.scheduler.config import EngineConfig


@dataclass(frozen=True)
class EngineInfo:
    served_model_name: str
    config: EngineConfig  # as the engine settled it (max_model_len, dtype... resolved)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_path: str  # where the API process loads its own copy of the tokenizer from
    device: str
    capacity: str  # the KV capacity, described for the log
    is_encoder: bool = False
    dimensions: int | None = None  # an encoder's embedding size
    matryoshka: bool = False  # an encoder trained for shorter embeddings
    enable_lora: bool = False
    lora_adapters: dict[str, str] = field(default_factory=dict)  # served at start: name -> folder
    architecture: str | None = None
    quantization: str | None = None
    emits_text: bool = False  # the engine detokenizes itself; else the API process makes the text
    num_blocks: int = 0  # the KV pool's blocks (0: none, an encoder)

    @property
    def makes_text_here(self) -> bool:
        """Whether the API process detokenizes this engine's outputs and looks for stop strings."""
        return not self.is_encoder and not self.emits_text

    @property
    def max_model_len(self) -> int:
        return int(self.config.max_model_len or 0)

    @property
    def model_path(self) -> str | None:
        return str(self.config.model) if self.config.model else None


def serving_engine(config: EngineConfig, observer: Any) -> Any:
    """The engine a server runs for ``config``: an encoder's (a sentence-transformers folder, an embedding
    GGUF file: embeddings, rerank, score), else a generator that sends token ids only (the API process
    makes the text: ``server.output_text``)."""
    from servelm.scheduler.encoder_engine import EncoderEngine, is_encoder_model
    from servelm.scheduler.engine import Engine

    if is_encoder_model(config.model):
        return EncoderEngine(config, observer=observer)
    return Engine(config, observer=observer, detokenize=False)


def engine_info(engine: Any) -> EngineInfo:
    """The facts of a built ``scheduler.engine.Engine`` or ``scheduler.encoder_engine.EncoderEngine``."""
    mc = getattr(engine, "model_config", None)
    is_encoder = bool(getattr(engine, "is_encoder", False))
    encoder = getattr(engine, "encoder", None)
    cfg = engine.config
    capacity = getattr(engine, "capacity", None)
    loras = getattr(engine, "loras", None)
    model_dir = getattr(engine, "model_dir", None)
    return EngineInfo(
        served_model_name=str(engine.served_model_name),
        config=cfg,
        vocab_size=int(getattr(mc, "vocab_size", 0) or len(engine.tokenizer)),
        eos_token_ids=tuple(getattr(engine, "eos_token_ids", ())),
        tokenizer_path=str(cfg.tokenizer or model_dir or cfg.model or ""),
        device=str(getattr(engine, "device", "cpu")),
        capacity=capacity.describe() if capacity is not None and hasattr(capacity, "describe") else "",
        is_encoder=is_encoder,
        dimensions=int(engine.dimensions) if is_encoder else None,
        matryoshka=bool(encoder.pooling.matryoshka) if encoder is not None else False,
        enable_lora=bool(getattr(engine, "enable_lora", False)),
        lora_adapters=dict(getattr(loras, "adapters", {}) or {}),
        architecture=getattr(mc, "architecture", None),
        quantization=getattr(getattr(engine, "runner", None), "quantization", None) or cfg.quantization,
        emits_text=bool(getattr(engine, "detokenize", False)),
        num_blocks=int(getattr(getattr(engine, "block_manager", None), "num_blocks", 0) or 0),
    )


def load_api_tokenizer(info: EngineInfo) -> Any:
    """The API process's own copy of the engine's tokenizer (tokenizing, templates, detokenizing at the edge)."""
    if info.is_encoder:
        from servelm.runtime.encoder_tokenizer import load_encoder_tokenizer

        return load_encoder_tokenizer(str(info.config.model), None)
    from servelm.runtime.tokenizer import load_tokenizer

    return load_tokenizer(info.tokenizer_path)
