"""Our Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, SmolLM3, Granite, Gemma 3 text) over a
flat token batch.

The model sees one step as a flat list of tokens (decodes first, then prefill chunks; no batch
dimension, no padding). Every attention layer hands its q/k/v to the attention backend together with
its own slice of the KV pool and the step's ``AttentionMetadata``; the model never branches on device.

The layers are built from ``runtime.models.layers`` (RMSNorm, the projections, RoPE). Parameters are
fused where the checkpoint is not (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``). Each fused parameter carries ``shard_slices`` (checkpoint shard name -> rows it
fills), which is what the weight loader (``runtime.weights``) uses to map checkpoint tensors onto it.

Inside the model, submodules are called through ``.forward``: ``nn.Module.__call__`` (hooks, tracing
state) costs a couple of microseconds a call, ~300 calls a step. With every call through ``__call__``
an int8 decode step at batch 1 took 12.4 ms against 11.8 ms without (median of 10 interleaved runs of
64 tokens on the project's CPU, 2026-12-01: ~5%). The model registers no hooks; the runner still calls
the top-level module as usual.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from servelm.runtime import platform, quantization
from servelm.runtime.cpu import linear as cpu_linear, ops as cpu_ops
from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata
from servelm.runtime.config import ModelConfig
from servelm.runtime.models.layers import (
    CosSin,
    FewRowKernels,
    FusedRmsNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    empty_param,
    apply_rope,
)

if TYPE_CHECKING:  # (lora imports this module: the layers it attaches to)
    from servelm.runtime.lora import LoRAContext


class Attention(nn.Module):
    """Self-attention with fused q/k/v, optional q/k RMSNorm (Qwen3), q/k/v bias (Qwen2), no RoPE at
    all on SmolLM3's NoPE layers, Granite's attention multiplier as the score scale, and a sliding
    window on the layers the config names."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5 if cfg.attention_multiplier is None else cfg.attention_multiplier
        self.use_rope = layer_idx not in cfg.nope_layers
        # Sliding-window layers hand their window to the backend (others pass nothing: backends and
        # test stand-ins without windows are called exactly as before).
        window = cfg.sliding_window if layer_idx in cfg.window_layers else None
        self.window_kw: dict[str, int] = {} if window is None else {"window": window}
        self.qkv_proj = Linear(
            cfg.hidden_size,
            [("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)],
            cfg.attention_bias,
            dtype,
            device,
        )
        # Llama's ``attention_bias`` also puts a bias on o_proj; Qwen2's q/k/v bias does not.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = Linear(self.q_size, cfg.hidden_size, o_bias, dtype, device)
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj.forward(x), cos_sin, meta)

    def attend(self, qkv: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        """Everything after the q/k/v projection: RoPE, the K/V store, attention and o_proj."""
        t = qkv.shape[0]
        if self.use_rope and self.q_norm is None and self.k_cache is not None and self.v_cache is not None:
            # A backend may do RoPE, the K/V store and attention straight from the fused projection.
            fused = self.backend.forward_from_qkv(
                qkv, cos_sin, self.k_cache, self.v_cache, meta, self.scale, self.num_heads, **self.window_kw
            )
            if fused is not None:
                return self.o_proj.forward(fused.reshape(t, self.q_size))
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm.forward(qk[:, : self.num_heads]), self.k_norm.forward(qk[:, self.num_heads :])), dim=1)
        # One rotation over q and k together: half the element-wise ops of rotating them apart.
        qk = apply_rope(qk, cos_sin) if self.use_rope else qk.contiguous()
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not bound: call CausalLM.bind_kv_cache() first")
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, **self.window_kw)
        return self.o_proj.forward(out.reshape(t, self.q_size))


class MLP(nn.Module):
    """SiLU-gated MLP with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, [("gate", cfg.intermediate_size), ("up", cfg.intermediate_size)], False, dtype, device
        )
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, device)
        self.split_max_rows = platform.small_batch_splits(device)[0]
        self.act_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # silu(gate) * up in one kernel
        self.gelu = cfg.hidden_act == "gelu_tanh"  # Gemma: GELU (tanh approximation) instead of SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_mul is not None:
            return self.down_proj.forward(self.act_mul(self.gate_up_proj.forward(x)))
        proj = self.gate_up_proj
        if proj.packed is None and proj.lora is None and proj.quant_rows < x.shape[0] <= self.split_max_rows:
            w = proj.weight
            gate = F.linear(x, w[: self.intermediate])
            up = F.linear(x, w[self.intermediate :])
        else:
            gate_up = proj.forward(x)
            gate = gate_up[:, : self.intermediate]
            up = gate_up[:, self.intermediate :]
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj.forward(act.mul_(up))  # in place: one [T, intermediate] temporary fewer


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, backend, dtype, device, layer_idx)
        # Granite: each sublayer's output is scaled before its residual add (1.0 elsewhere: no op)
        self.residual_multiplier = cfg.residual_multiplier
        # Gemma 3: the sliding layers' own RoPE tables; and "sandwich" norms: post_attention_layernorm
        # normalises the attention's output, pre_feedforward_layernorm the MLP's input (the role
        # post_attention_layernorm has in Llama), post_feedforward_layernorm the MLP's output
        self.local_rope = cfg.local_rope is not None and layer_idx in cfg.window_layers
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)
        self.few_rows: FewRowKernels | None = None
        self.lora_ctx: LoRAContext | None = None  # set by runtime.lora.attach

    def _few_rows_apply(self, rows: int) -> bool:
        # The fused kernels take the weights directly: a step with LoRA rows goes through the projections.
        lora = self.lora_ctx
        return self.few_rows is not None and self.few_rows.applies(rows) and not (lora is not None and lora.plan)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (the embeddings for the first layer, with no
        residual yet); returns this layer's MLP output and the residual stream before it. The residual
        adds happen inside the norms, so a fused norm does each add and its norm in one pass; the sums
        are the same as ``h = h + attn(norm(h)); h = h + mlp(norm(h))``."""
        if self.few_rows is not None and self._few_rows_apply(x.shape[0]):
            return self._forward_few_rows(self.few_rows, x, residual, cos_sin, meta)
        if residual is None:
            residual = x
            x = self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward_add(x, residual)
        x = self.self_attn.forward(x, cos_sin, meta)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm.forward_add(self.post_attention_layernorm.forward(x), residual)
            return self.post_feedforward_layernorm.forward(self.mlp.forward(x)), residual
        m = self.residual_multiplier
        if m != 1.0:
            x = x * m
        x, residual = self.post_attention_layernorm.forward_add(x, residual)
        out = self.mlp.forward(x)
        return (out * m if m != 1.0 else out), residual

    def _forward_few_rows(
        self,
        k: FewRowKernels,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: CosSin,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with each norm inside the projection after it and SiLU x up inside the down
        projection: 3 kernels instead of 7 around attention."""
        attn, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
        qkv, residual = k.rms_norm_linear(x, residual, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
        x = attn.attend(qkv, cos_sin, meta)
        m = self.residual_multiplier
        if m != 1.0:
            x = x * m
        norm = self.post_attention_layernorm
        gate_up, residual = k.rms_norm_linear(
            x, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
        )
        out = k.silu_mul_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias)
        return (out * m if m != 1.0 else out), residual


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm: HF's ``model.*`` namespace."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg, dtype, device)
        # Gemma 3: the sliding layers' RoPE (another theta), when the model has one
        self.rotary_emb_local: RotaryEmbedding | None = None
        if cfg.local_rope is not None:
            theta, scaling = cfg.local_rope
            self.rotary_emb_local = RotaryEmbedding(dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, dtype, device, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """A Llama-family causal LM: ``forward`` over a flat token batch, ``compute_logits`` on chosen rows.

    Parameter names follow Hugging Face's checkpoints except for the fused projections
    (``self_attn.qkv_proj``, ``mlp.gate_up_proj``); ``CHECKPOINT_SHARDS`` says which checkpoint
    tensors fill them.
    """

    # checkpoint module name -> (our fused module name, shard)
    CHECKPOINT_SHARDS: dict[str, tuple[str, str]] = {
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
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.model = DecoderStack(cfg, backend, dtype, device)
        # Gemma rounds its embedding multiplier to the weights' dtype first (bfloat16: sqrt(1152) -> 34.0)
        scale = cfg.embedding_multiplier
        self.embed_scale = float(torch.tensor(scale, dtype=torch.float32).to(dtype)) if cfg.embedding_multiplier_in_dtype else scale
        self.tall_skinny_head_max_rows = platform.small_batch_splits(device)[1]
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_small_m: cpu_linear.SmallMLinear | None = None
        self.lm_head_small_m_rows = 0
        # --quantization: the head's quantized copy and kernel; and, for a tied head, its dequantized
        # float copy (the embedding itself stays as loaded)
        self.lm_head_quant: quantization.QuantizedWeight | None = None
        self._lm_head_dequantized: torch.Tensor | None = None
        self.few_rows: FewRowKernels | None = None  # the head of a few rows too (CUDA graphs)
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` -> final-normed hidden states ``[T, hidden]``."""
        h = F.embedding(input_ids, self.model.embed_tokens.weight)
        if self.embed_scale != 1.0:  # Granite, Gemma
            h = h * self.embed_scale
        cos_sin = self.model.rotary_emb.tables(positions)
        local = self.model.rotary_emb_local
        cos_sin_local = local.tables(positions) if local is not None else cos_sin
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            h, residual = layer.forward(h, residual, cos_sin_local if layer.local_rope else cos_sin, meta)
        if residual is None:
            return self.model.norm.forward(h)
        return self.model.norm.forward_add(h, residual)[0]

    def pack_cpu_weights(self, small_m: tuple[cpu_linear.SmallMLinear, int] | None = None) -> None:
        """Pack every projection and the vocabulary head for oneDNN (``runtime.cpu.linear``), once,
        after loading. Without ``small_m`` the dense projection weights are dropped; with it they stay
        for few-row steps. The tied embedding stays dense either way (the token lookup reads it), so a
        tied head costs one extra vocab x hidden copy."""
        for module in self.modules():
            if isinstance(module, Linear) and module.packed is None:
                module.pack_for_cpu(small_m)
        self.lm_head_packed = cpu_linear.pack(self.lm_head_weight)
        if small_m is not None:
            self.lm_head_small_m, self.lm_head_small_m_rows = small_m
        elif not self.config.tie_word_embeddings:
            self.lm_head.weight = None

    def quantize(self, quantization_name: str, kernels: dict[str, tuple[quantization.QuantizedKernel, int]]) -> None:
        """Weight-only quantization (``runtime.quantization``: ``int8`` or ``int4``) of every projection
        and the vocabulary head, after loading and before ``pack_cpu_weights``. ``kernels`` maps a scheme
        to its few-row kernel and row limit: steps of that many rows use it, larger ones the dequantized
        weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize(quantization_name, kernels)
        self.lm_head_quant = quantization.quantize(self.lm_head_weight, quantization.head_scheme(quantization_name), kernels)
        head = self.lm_head_quant.dequantize(self.lm_head_weight.dtype)
        if self.config.tie_word_embeddings:
            self._lm_head_dequantized = head
        else:
            with torch.no_grad():
                self.lm_head.weight.copy_(head)

    def quantize_if_exact(self, kernels: dict[str, tuple[quantization.QuantizedKernel, int]]) -> str | None:
        """``--quantization auto``: int4 (``quantize("int4", ...)``) only if it is lossless here, that is
        if every projection and the head dequantize to exactly the loaded weights. Returns None when
        applied, else the first weight that is not on the grid (the model is then left as it was)."""
        plan: list[tuple[Linear, quantization.QuantizedWeight]] = []
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                assert module.weight is not None and module.packed is None, "quantize before packing"
                quant = quantization.quantize(module.weight, "int4", kernels)
                if not torch.equal(quant.dequantize(module.weight.dtype), module.weight):
                    return name
                plan.append((module, quant))
        head = quantization.quantize(self.lm_head_weight, quantization.head_scheme("int4"), kernels)
        if not torch.equal(head.dequantize(self.lm_head_weight.dtype), self.lm_head_weight):
            return "lm_head"
        for module, quant in plan:
            module.quant = quant  # its weight already equals the dequantized values
        self.lm_head_quant = head  # likewise the head (for a tied one, the embedding itself)
        return None

    def weight_bytes_read(self) -> int:
        """Bytes of weight a decode step reads: every parameter once (a tied embedding as the head),
        quantized projections and head as their codes plus scales. Call before ``pack_cpu_weights``
        (which may drop dense weights)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        # (dense weight, its quantized copy) of every projection and the head
        weights: list[tuple[torch.Tensor, quantization.QuantizedWeight | None]] = [
            (m.weight, m.quant) for m in self.modules() if isinstance(m, Linear) and m.weight is not None
        ]
        weights.append((self.lm_head_weight, self.lm_head_quant))
        for dense, quant in weights:
            if quant is not None:
                total += quant.nbytes - dense.numel() * dense.element_size()
        return total

    def use_cpu_rms_norm(self, kernel: cpu_ops.RmsNorm) -> None:
        """Route every RMSNorm through the compiled CPU op (``runtime.cpu.ops``; float32 or bfloat16).
        Gemma's float32 weights under bfloat16 activations keep the torch path (the op rounds as Llama)."""
        float32 = self.model.embed_tokens.weight.dtype == torch.float32
        for module in self.modules():
            if isinstance(module, RMSNorm) and (float32 or not module.upcast_weight):
                module.kernel = kernel

    def use_fused_ops(self, rms_norm: FusedRmsNorm, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Route every RMSNorm (with the residual add before it) and the MLP activation through fused
        kernels (``runtime.cuda.triton_ops`` on CUDA)."""
        # The hidden-size norms only: Qwen3's per-head q/k norms see [tokens, heads, head_dim] views.
        for layer in self.model.layers:
            for module in layer.modules():
                if isinstance(module, RMSNorm) and module is not layer.self_attn.q_norm and module is not layer.self_attn.k_norm:
                    module.fused = rms_norm
            if not layer.mlp.gelu:
                layer.mlp.act_mul = silu_mul
        self.model.norm.fused = rms_norm

    def use_few_row_kernels(self, kernels: FewRowKernels) -> None:
        """Give every layer and projection the fused few-row kernels (one shared ``kernels``: its
        ``max_rows`` switches them for the whole model)."""
        for module in self.modules():
            if isinstance(module, (Linear, DecoderLayer, CausalLM)):
                module.few_rows = kernels

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> ``[R, vocab]``; the runner passes only the rows it samples."""
        logits = self._project_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        return logits

    def _project_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and self.few_rows.applies(hidden.shape[0]):
            return self.few_rows.linear(hidden, self.lm_head_weight, None)
        if self.lm_head_quant is not None and hidden.shape[0] <= self.lm_head_quant.max_rows:
            return self.lm_head_quant.linear(hidden, None)
        if self.lm_head_packed is not None:
            if hidden.shape[0] <= self.lm_head_small_m_rows:
                return self.lm_head_small_m(hidden.contiguous(), self.lm_head_weight, None)  # type: ignore[misc]
            return cpu_linear.linear(hidden, self.lm_head_packed, None)
        if 1 < hidden.shape[0] <= self.tall_skinny_head_max_rows:
            return torch.mm(self.lm_head_weight, hidden.t()).t().contiguous()
        return F.linear(hidden, self.lm_head_weight)

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

    def extra_repr(self) -> str:
        c = self.config
        return f"{c.architecture}: {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}"


def build_model(
    cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str
) -> CausalLM:
    """An unloaded model (parameters uninitialised); fill it with ``runtime.weights.load_weights``."""
    return CausalLM(cfg, backend, dtype, device)


def param_shards(param: nn.Parameter) -> list[str | None]:
    """The checkpoint shards a parameter expects (``[None]`` when it is not fused)."""
    slices: dict[str, Any] | None = getattr(param, "shard_slices", None)
    return list(slices) if slices else [None]
