"""KV-pool sizing and roofline bounds, shared by the engine's start-up and ``servelm plan``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelm.runtime.batch import BatchItem
from servelm.runtime.config import ModelConfig


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.num_params * dtype_bytes(dtype)


def flops_per_token(cfg: ModelConfig, context_len: int = 0) -> float:
    """Forward FLOPs for one token: 2 x matmul params (LM head included) + attention over context."""
    emb = cfg.vocab_size * cfg.hidden_size
    matmul_params = cfg.num_params - emb * (1 if cfg.tie_word_embeddings else 2) + emb
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_len
    return 2.0 * matmul_params + attn


@dataclass(frozen=True)
class DevicePreset:
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float  # datasheet HBM/DRAM bandwidth
    peak_flops: float  # dense bf16 (fp32 for cpu)


DEVICE_PRESETS: dict[str, DevicePreset] = {
    "a100-80g": DevicePreset("a100-80g", 80 * 10**9, 2.039e12, 312e12),
    "h100-80g": DevicePreset("h100-80g", 80 * 10**9, 3.35e12, 989e12),
    "h200": DevicePreset("h200", 141 * 10**9, 4.8e12, 989e12),
    # This repo's reference CPU (2 cores, AVX-512), measured.
    "cpu": DevicePreset("cpu", 24 * 2**30, 26e9, 200e9),
}


@dataclass(frozen=True)
class Capacity:
    """What a KV budget buys: logged at start-up and printed by ``servelm plan``.

    Under tensor parallelism (``tensor_parallel_size`` N > 1) the budget and ``kv_bytes_per_token``
    are one rank's: each rank's pool holds its 1/N of the KV heads for every block, so the blocks and
    tokens are the whole engine's, and the N pools together take N times the budget.
    """

    weight_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    tensor_parallel_size: int = 1

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_max_len_request(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_len_requests(self) -> int:
        """How many requests of ``max_model_len`` tokens fit at once."""
        return self.num_blocks // self.blocks_per_max_len_request

    def describe(self) -> str:
        n = self.tensor_parallel_size
        rank = f" per rank x {n} ranks" if n > 1 else ""
        return (
            f"weights {self.weight_bytes / 2**20:.1f} MiB; KV {self.kv_bytes_per_token / 1024:.1f} KiB/token{rank}; "
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.token_capacity} tokens "
            f"({self.num_blocks * self.block_size * self.kv_bytes_per_token / 2**20:.1f} MiB{rank}); "
            f"{self.max_len_requests} requests of max_model_len={self.max_model_len} fit"
        )


class CapacityError(ValueError):
    """The KV budget cannot hold even one request of ``max_model_len``."""


class StepCostModel:
    """Counted FLOPs and bytes moved by one step, from its token counts only (for MFU / MBU): matmuls
    per token, the LM head per sampled row, attention per (query, context) pair; all weights once plus
    the KV read (whole contexts) and written (new tokens)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, weight_bytes_read: int | None = None) -> None:
        """``weight_bytes_read``: what a step reads of the weights when not parameters x dtype (quantized)."""
        self.head_flops = 2.0 * cfg.vocab_size * cfg.hidden_size
        self.body_flops = flops_per_token(cfg, 0) - self.head_flops
        self.attn_flops = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
        self.weight_bytes = float(weight_bytes(cfg, dtype) if weight_bytes_read is None else weight_bytes_read)
        self.kv_token_bytes = float(kv_bytes_per_token(cfg, dtype))

    def __call__(self, items: Sequence[BatchItem]) -> tuple[float, float]:
        """(FLOPs, bytes) of a step over ``items``, before their ``num_computed_tokens`` move on."""
        if not items:
            return 0.0, 0.0
        tokens = sampled = 0
        pairs = 0.0
        kv_read = 0
        for it in items:
            n, c = it.num_new_tokens, it.seq.num_computed_tokens
            tokens += n
            sampled += it.sample
            pairs += n * c + n * (n + 1) / 2
            kv_read += c + n
        flops = self.body_flops * tokens + self.head_flops * sampled + self.attn_flops * pairs
        moved = self.weight_bytes + self.kv_token_bytes * (kv_read + tokens)
        return flops, moved


def plan_capacity(
    cfg: ModelConfig,
    dtype: torch.dtype,
    kv_budget_bytes: int,
    block_size: int,
    max_model_len: int,
    stored_weight_bytes: int | None = None,
    kv_dtype: torch.dtype | None = None,
    tensor_parallel_size: int = 1,
) -> Capacity:
    """``stored_weight_bytes``: the weights' size where they are not parameters x dtype (a GGUF file);
    ``kv_dtype``: the cache's dtype where it is not ``dtype``; ``tensor_parallel_size`` N: the budget
    is each rank's, whose pool holds 1/N of a token's KV heads (as vLLM's memory settings are per GPU)."""
    per_tok = kv_bytes_per_token(cfg, kv_dtype or dtype) // tensor_parallel_size
    num_blocks = int(kv_budget_bytes // (per_tok * block_size))
    weights = stored_weight_bytes if stored_weight_bytes is not None else weight_bytes(cfg, dtype)
    cap = Capacity(weights, per_tok, block_size, num_blocks, max_model_len, tensor_parallel_size)
    if cap.token_capacity < max_model_len:
        per_rank = " per rank" if tensor_parallel_size > 1 else ""
        raise CapacityError(
            f"max_model_len={max_model_len} does not fit the KV pool: {kv_budget_bytes / 2**20:.1f} MiB{per_rank} holds "
            f"{cap.token_capacity} tokens ({per_tok} bytes/token); raise the KV memory or lower max_model_len"
        )
    return cap
