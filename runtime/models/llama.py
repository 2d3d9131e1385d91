"""Our Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, SmolLM3, Granite, Gemma 3 text) over a
flat token batch.

The model sees one step as a flat list of tokens (decodes first, then prefill chunks; no batch
dimension, no padding). Every attention layer hands its q/k/v to the attention backend together with
its own slice of the KV pool and the step's ``AttentionMetadata``; the model never branches on device.

The layers are built from ``runtime.models.layers`` (RMSNorm, the projections, RoPE). Parameters are
fused where the checkpoint is not (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``). Each fused parameter carries ``shard_slices`` (checkpoint shard name -> rows it
fills), which is what the weight loader (``runtime.weights``) uses to map checkpoint tensors onto it.

Inside the model, submodules are called through ``.forward``: ``nn.Module.__call__`` (hooks, tracing
state) costs a couple of microseconds a call, ~300 calls a step: ~5% of a small model's int8 decode
step (docs/benchmarks.md). The model registers no hooks; the runner still calls the top-level module
as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from servelm.runtime import quantization
from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata
from servelm.runtime.config import ModelConfig
from servelm.runtime.model_kernels import FewRowKernels, LayerOps
from servelm.runtime.models.decoder import DecoderLayer, DecoderStack, FewRowStep
from servelm.runtime.models.layers import (
    Linear,
    RMSNorm,
    empty_param,
)
from servelm.runtime.platform import platform_of
from servelm.runtime.projection import MethodChain, MethodParts, ProjectionMethod


class CausalLM(nn.Module):
    """A Llama-family causal LM: ``forward`` over a flat token batch, ``compute_logits`` on chosen rows.

    Parameter names follow Hugging Face's checkpoints except for the fused projections
    (``self_attn.qkv_proj``, ``mlp.gate_up_proj``); ``CHECKPOINT_SHARDS`` says which checkpoint
    tensors fill them.
    """

    # checkpoint module name -> (our fused module name, shard)
    CHECKPOINT_SHARDS: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ops: LayerOps | None = None,
    ) -> None:
        """``ops``: the norm and activation kernels the device builds the layers with (``Platform.layer_ops``)."""
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.model = DecoderStack(cfg, backend, dtype, device, ops)
        # Gemma rounds its embedding multiplier to the weights' dtype first (bfloat16: sqrt(1152) -> 34.0)
        scale = cfg.embedding_multiplier
        self.embed_scale = (
            float(torch.tensor(scale, dtype=torch.float32).to(dtype)) if cfg.embedding_multiplier_in_dtype else scale
        )
        # --quantization: a tied head's dequantized float copy (the embedding itself stays as loaded)
        self._lm_head_dequantized: torch.Tensor | None = None
        # The token lookup kept in its GGUF blocks (``runtime.gguf.loader``)
        self.stored_embedding: Any = None  # gguf.projection.GGUFEmbedding
        self.decode_stack: Any = None  # gguf.layer.DecodeStack: a decode step's layers in one compiled call
        # The vocabulary head's method and its parts (the device's, a quantized copy, a file's blocks).
        self.head_method = MethodChain(MethodParts(tall_skinny_rows=platform_of(device).small_batch_splits[1]))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = empty_param((cfg.vocab_size, cfg.hidden_size), dtype, device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        # A property, not an attribute: assigning the tied Parameter would register it a second time.
        if self._lm_head_dequantized is not None:
            return self._lm_head_dequantized
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def after_load(self) -> None:
        """Model-specific changes to the loaded weights: Gemma's norms scale by 1 + w, in float32."""
        if not self.config.gemma_norms:
            return
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight = nn.Parameter(1.0 + module.weight.float(), requires_grad=False)
                    module.upcast_weight = True

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """Give each attention layer its slice of the KV pool."""
        if len(k_caches) != len(self.model.layers) or len(v_caches) != len(self.model.layers):
            raise ValueError(f"KV pool has {len(k_caches)} layers, model has {len(self.model.layers)}")
        for layer, k, v in zip(self.model.layers, k_caches, v_caches):
            layer.self_attn.k_cache = k
            layer.self_attn.v_cache = v
        if self.decode_stack is not None:
            self.decode_stack.bind()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` -> final-normed hidden states ``[T, hidden]``."""
        h = self.embed(input_ids)
        cos_sin = self.model.rotary_emb.tables(positions)
        local = self.model.rotary_emb_local
        cos_sin_local = local.tables(positions) if local is not None else cos_sin
        residual: torch.Tensor | None = None
        stacked = self.decode_stack.forward(h, cos_sin, cos_sin_local, meta) if self.decode_stack is not None else None
        if stacked is not None:
            h, residual = stacked
        else:
            for layer in self.model.layers:
                h, residual = layer.forward(h, residual, cos_sin_local if layer.local_rope else cos_sin, meta)
        if residual is None:
            return self.model.norm.forward(h)
        return self.model.norm.forward_add(h, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings ``[T, hidden]`` (a vocab-parallel model overrides the lookup)."""
        if self.stored_embedding is not None:
            h = self.stored_embedding.lookup(input_ids)
        else:
            h = F.embedding(input_ids, self.model.embed_tokens.weight)
        if self.embed_scale != 1.0:  # Granite, Gemma
            h = h * self.embed_scale
        return h

    def use_base_methods(self, make: Callable[[torch.Tensor], ProjectionMethod], keep_weights: bool) -> None:
        """Every projection and the vocabulary head through the device's own method made from its
        weight (``cpu.packed``: oneDNN on a packed copy), once, after loading. Without ``keep_weights``
        the dense projection weights are dropped. The tied embedding stays dense either way (the token
        lookup reads it), so a tied head costs one extra vocab x hidden copy."""
        for module in self.modules():
            if isinstance(module, Linear) and module.method.parts.base is None and module.method.parts.stored is None:
                module.use_base(make, keep_weights)
        if self.head_method.parts.stored is not None:
            return  # the head stays in its file's blocks
        self.head_method = self.head_method.with_parts(base=make(self.lm_head_weight))
        if not keep_weights and not self.config.tie_word_embeddings:
            self.lm_head.weight = None

    def use_stored_embedding(self, embedding: Any) -> None:
        """Read tokens from the embedding's GGUF blocks (``gguf.projection.GGUFEmbedding``); a tied head
        then multiplies by those blocks too. The dense parameter is dropped (kept empty for its dtype)."""
        weight = self.model.embed_tokens.weight
        self.model.embed_tokens.weight = empty_param((0, weight.shape[1]), weight.dtype, weight.device)
        self.stored_embedding = embedding
        if self.config.tie_word_embeddings:
            self.use_stored_head(embedding.head)

    def use_stored_head(self, method: ProjectionMethod) -> None:
        """Compute the vocabulary head from a weight kept in its file's blocks; its dense copy is dropped."""
        if not self.config.tie_word_embeddings:
            self.lm_head.weight = None
        self.head_method = self.head_method.with_parts(stored=method)

    def quantize(self, quantization_name: str, kernels: dict[str, tuple[quantization.QuantizedKernel, int]]) -> None:
        """Weight-only quantization (``runtime.quantization``: ``int8`` or ``int4``) of every projection
        and the vocabulary head, after loading and before ``use_base_methods``. ``kernels`` maps a scheme
        to its few-row kernel and row limit: steps of that many rows use it, larger ones the dequantized
        weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize(quantization_name, kernels)
        quant = quantization.quantize(self.lm_head_weight, quantization.head_scheme(quantization_name), kernels)
        head = quant.dequantize(self.lm_head_weight.dtype)
        if self.config.tie_word_embeddings:
            self._lm_head_dequantized = head
        else:
            with torch.no_grad():
                self.lm_head.weight.copy_(head)
        self.head_method = self.head_method.with_parts(quant=quant)

    def quantize_if_exact(self, kernels: dict[str, tuple[quantization.QuantizedKernel, int]]) -> str | None:
        """``--quantization auto``: int4 (``quantize("int4", ...)``) only if it is lossless here, that is
        if every projection and the head dequantize to exactly the loaded weights. Returns None when
        applied, else the first weight that is not on the grid (the model is then left as it was)."""
        plan: list[tuple[Linear, quantization.QuantizedWeight]] = []
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                assert module.weight is not None and module.method.parts.base is None, "quantize before packing"
                quant = quantization.quantize(module.weight, "int4", kernels)
                if not torch.equal(quant.dequantize(module.weight.dtype), module.weight):
                    return name
                plan.append((module, quant))
        head = quantization.quantize(self.lm_head_weight, quantization.head_scheme("int4"), kernels)
        if not torch.equal(head.dequantize(self.lm_head_weight.dtype), self.lm_head_weight):
            return "lm_head"
        for module, quant in plan:
            module.use_parts(quant=quant)  # its weight already equals the dequantized values
        self.head_method = self.head_method.with_parts(quant=head)  # likewise the head (a tied one: the embedding)
        return None

    def stored_methods(self) -> list[ProjectionMethod]:
        """Every projection computed from a file's stored blocks (``use_stored``), the head included."""
        chains = [m.method for m in self.modules() if isinstance(m, Linear)] + [self.head_method]
        return [c.parts.stored for c in chains if c.parts.stored is not None]

    def weight_bytes_read(self) -> int:
        """Bytes of weight a decode step reads: every parameter once (a tied embedding as the head),
        quantized projections and head as their codes plus scales. Call before ``use_base_methods``
        (which may drop dense weights)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        # Weights kept in their file's blocks: their bytes (a tied head reads the embedding's).
        total += sum(int(getattr(s, "nbytes", 0)) for s in self.stored_methods())
        # (dense weight, its quantized copy) of every projection and the head
        weights: list[tuple[torch.Tensor, quantization.QuantizedWeight | None]] = [
            (m.weight, m.method.parts.quant) for m in self.modules() if isinstance(m, Linear) and m.weight is not None
        ]
        weights.append((self.lm_head_weight, self.head_method.parts.quant))
        for dense, quant in weights:
            if quant is not None:
                total += quant.nbytes - dense.numel() * dense.element_size()
        return total

    def use_few_row_kernels(self, kernels: FewRowKernels) -> None:
        """Give every layer and projection the fused few-row kernels (one shared ``kernels``: its
        ``max_rows`` switches them for the whole model)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_parts(few_rows=kernels)
            if isinstance(module, DecoderLayer):
                module.fused_step = FewRowStep(module, kernels)
        self.head_method = self.head_method.with_parts(few_rows=kernels)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> ``[R, vocab]``; the runner passes only the rows it samples."""
        logits = self._project_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        return logits

    def _project_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_method.apply(hidden, self.lm_head_weight, None)

    def checkpoint_target(self, name: str) -> tuple[str, str | None] | None:
        """Map a checkpoint tensor name to (our parameter name, shard) or None if we have no use for it."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.CHECKPOINT_SHARDS:
            fused, shard = self.CHECKPOINT_SHARDS[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embedding is the head (HF ignores a stored copy too)
        if name.endswith("rotary_emb.inv_freq"):
            return None  # old checkpoints store the RoPE buffer; we derive it from the config
        return name, None

    def checkpoint_shard(self, name: str, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a checkpoint tensor that parameter ``name`` holds: all of it here; a
        tensor-parallel model (``runtime.distributed``) takes its rank's slice."""
        return tensor

    def extra_repr(self) -> str:
        c = self.config
        return f"{c.architecture}: {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}"


def build_model(
    cfg: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: LayerOps | None = None,
) -> CausalLM:
    """An unloaded model (parameters uninitialised); fill it with ``runtime.weights.load_weights``."""
    return CausalLM(cfg, backend, dtype, device, ops)


def param_shards(param: nn.Parameter) -> list[str | None]:
    """The checkpoint shards a parameter expects (``[None]`` when it is not fused)."""
    slices: dict[str, Any] | None = getattr(param, "shard_slices", None)
    return list(slices) if slices else [None]
