"""Megatron-style sharding of the Llama-family model over the ranks of a tensor-parallel group.

Each rank builds the ordinary ``CausalLM`` for a *local* config (its share of the query heads, KV
heads, MLP width and vocabulary), so every existing module, projection method and CPU kernel runs
unchanged on smaller weights; the loader hands each parameter its rank's slice of the checkpoint
tensor (``checkpoint_shard``). Column-parallel: ``qkv_proj`` (whole heads, KV heads included, so
each rank's KV pool holds its KV heads only) and ``gate_up_proj``. Row-parallel, followed by one
all-reduce each: ``o_proj`` and ``down_proj``. The vocabulary is split too: the head computes its
slice of the logits, gathered on rank 0 for the sampled rows only, and the embedding is
vocab-parallel (a masked lookup then one all-reduce): a tied head *is* the embedding, so splitting
both keeps one copy of it per rank instead of a full embedding beside a head slice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from servelm.runtime.attention.base import AttentionBackend
from servelm.runtime.config import ModelConfig, UnsupportedModelError
from servelm.runtime.distributed.comm import Communicator
from servelm.runtime.gguf.folder import gguf_source
from servelm.runtime.models.layers import Linear
from servelm.runtime.models.llama import CausalLM
from servelm.runtime.platform import platform_of
from servelm.runtime.quantization import AUTO, NONE
from servelm.runtime.weights import load_weights

# Our parameter's module name -> the dimension its checkpoint tensors are split along.
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")  # output rows: heads, MLP width
ROW_PARALLEL = ("o_proj", "down_proj")  # input columns; their outputs are summed over the ranks
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def check_tensor_parallel(
    cfg: ModelConfig,
    world_size: int,
    *,
    device: torch.device,
    model_dir: Path | None = None,
    quantization: str | None = None,
) -> None:
    """Refuse, by name, what tensor parallelism does not serve yet, before anything is loaded."""
    if world_size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {world_size}")
    for what, n in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP intermediate size", cfg.intermediate_size),
        ("vocabulary size", cfg.vocab_size),
    ):
        if n % world_size:
            raise UnsupportedModelError(
                f"tensor parallel size {world_size}: {cfg.architecture} has {n} {what}, not divisible by {world_size}"
            )
    platform = platform_of(device)
    if not platform.tensor_parallel_proven:
        raise UnsupportedModelError(
            f"tensor parallelism on {platform.name.upper()} (device {device}, {platform.distributed_backend.upper()}) is unproven, "
            "so it is refused: it has only run on CPU over gloo (--device cpu)"
        )
    if quantization not in (None, NONE, AUTO):  # auto: the shards run unquantized
        raise UnsupportedModelError(f"--quantization {quantization} is not supported with tensor parallelism yet")
    if model_dir is not None and gguf_source(model_dir) is not None:
        raise UnsupportedModelError(
            "GGUF weights are not supported with tensor parallelism yet: load a safetensors folder"
        )


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank holds: its heads, KV heads, MLP width and vocabulary slice."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world_size,
        num_kv_heads=cfg.num_kv_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
        vocab_size=cfg.vocab_size // world_size,
    )


def reduce_output(linear: Linear, comm: Communicator) -> None:
    """Make a row-parallel projection sum its partial products over the ranks after whichever
    projection method computes them (``projection.ReducedMethod``)."""
    linear.use_parts(all_reduce=comm.all_reduce)


class TensorParallelCausalLM(CausalLM):
    """One rank's shard of a ``CausalLM``: same modules on the local config, plus the collectives.

    ``compute_logits`` is collective: every rank calls it on the same rows; rank 0 gets ``[R, vocab]``,
    the others their ``[R, vocab / N]`` slice.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        comm: Communicator,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        check_tensor_parallel(cfg, comm.world_size, device=torch.device(device))
        super().__init__(shard_config(cfg, comm.world_size), backend, dtype, device)
        self.full_config = cfg
        self.comm = comm
        self.vocab_start = comm.rank * self.config.vocab_size
        for layer in self.model.layers:
            reduce_output(layer.self_attn.o_proj, comm)
            reduce_output(layer.mlp.down_proj, comm)

    def checkpoint_shard(self, name: str, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        n, r = self.comm.world_size, self.comm.rank
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if module in COLUMN_PARALLEL or name in VOCAB_PARALLEL:
            return tensor.chunk(n, dim=0)[r]
        if module in ROW_PARALLEL:
            if kind == "weight":
                return tensor.chunk(n, dim=1)[r]
            return tensor if r == 0 else torch.zeros_like(tensor)  # summed over the ranks: added once
        return tensor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Each rank looks up the ids in its slice and zeros the rest; the sum has one term per row,
        # so it is exact.
        weight = self.model.embed_tokens.weight
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), weight)
        h = self.comm.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0.0))
        if self.embed_scale != 1.0:  # Granite, Gemma
            h = h * self.embed_scale
        return h

    def _project_head(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.head_method.apply(hidden, self.lm_head_weight, None)
        return self.comm.gather_last_dim(local.contiguous())


def load_tensor_parallel_model(
    model_dir: Path,
    cfg: ModelConfig,
    backend: AttentionBackend,
    comm: Communicator,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> TensorParallelCausalLM:
    """This rank's shard of the folder's safetensors weights (each tensor is read, then sliced)."""
    check_tensor_parallel(cfg, comm.world_size, device=device, model_dir=model_dir)
    model = TensorParallelCausalLM(cfg, backend, comm, dtype, device)
    load_weights(model, model_dir)
    model.after_load()
    model.eval()
    return model
