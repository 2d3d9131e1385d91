"""The runner of an encoder: a step's whole sequences in, one pooled vector per sequence out.

It holds no KV pool: nothing of a sequence outlives its forward. ``block_size`` is only the unit the
scheduler's block accounting counts a step's tokens in.
"""

from __future__ import annotations

import logging

import torch

from servelm.runtime.encoder_loader import LoadedEncoder, load_encoder
from servelm.runtime.models.encoder import EncoderBatch

log = logging.getLogger(__name__)


class EncoderRunner:
    """Owns the encoder and its pooling; ``embed`` runs one step."""

    block_size = 16
    kv_pool = None

    def __init__(self, model: str, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.encoder: LoadedEncoder = load_encoder(model, device, dtype)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.encoder.model.parameters())

    @property
    def num_parameters(self) -> int:
        """Parameters a token multiplies through (the embedding tables are looked up, not multiplied)."""
        tables = ("embed.", "embed_tokens.", "position.", "token_type.", "relative.")
        return sum(p.numel() for n, p in self.encoder.model.named_parameters() if not n.startswith(tables))

    @torch.inference_mode()
    def embed(self, sequences: list[list[int]]) -> torch.Tensor:
        """``[len(sequences), dimensions]`` float32 on the host, in order."""
        return self.encoder.embed(EncoderBatch.build(sequences, self.device)).cpu()
