"""The blocks of our Llama-family decoder: attention (fused q/k/v, optional q/k norms, biases, NoPE
layers, sliding windows), the gated MLP, the decoder layer (with its few-row fused path) and the
stack of layers. ``runtime.models.llama.CausalLM`` puts the embedding and the vocabulary head around
them. Submodules are called through ``.forward`` (see ``runtime.models.llama``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata, QKNorm
from servelm.runtime.config import ModelConfig
from servelm.runtime.model_kernels import FewRowKernels, LayerOps
from servelm.runtime.models.layers import (
    CosSin,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    empty_param,
)
from servelm.runtime.platform import platform_of

if TYPE_CHECKING:
    from servelm.runtime.lora_updates import LoRAContext


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
        ops: LayerOps | None = None,
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
            self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, ops, per_head=True)
            self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, ops, per_head=True)
        else:
            self.q_norm = self.k_norm = None
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    @property
    def qk_norm(self) -> QKNorm | None:
        """The q/k norms as a fused backend takes them (float32 weights), or None: no norms."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj.forward(x), cos_sin, meta)

    def attend(self, qkv: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        """Everything after the q/k/v projection: RoPE, the K/V store, attention and o_proj."""
        return self.o_proj.forward(self.attend_heads(qkv, cos_sin, meta).reshape(qkv.shape[0], self.q_size))

    def attend_heads(self, qkv: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        """Between the q/k/v projection and o_proj: the q/k norms, RoPE, the K/V store and attention;
        ``[tokens, num_heads, head_dim]``."""
        t = qkv.shape[0]
        if self.use_rope and self.k_cache is not None and self.v_cache is not None:
            # A backend may do (the q/k norms,) RoPE, the K/V store and attention straight from the
            # fused projection.
            qk_norm = self.qk_norm
            kw = self.window_kw if qk_norm is None else {**self.window_kw, "qk_norm": qk_norm}
            fused = self.backend.forward_from_qkv(
                qkv, cos_sin, self.k_cache, self.v_cache, meta, self.scale, self.num_heads, **kw
            )
            if fused is not None:
                return fused
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                (self.q_norm.forward(qk[:, : self.num_heads]), self.k_norm.forward(qk[:, self.num_heads :])), dim=1
            )
        # One rotation over q and k together: half the element-wise ops of rotating them apart.
        qk = apply_rope(qk, cos_sin) if self.use_rope else qk.contiguous()
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not bound: call CausalLM.bind_kv_cache() first")
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, **self.window_kw)


class MLP(nn.Module):
    """SiLU-gated MLP with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, [("gate", cfg.intermediate_size), ("up", cfg.intermediate_size)], False, dtype, device
        )
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, device)
        self.split_max_rows = platform_of(device).small_batch_splits[0]
        self.gelu = cfg.hidden_act == "gelu_tanh"  # Gemma: GELU (tanh approximation) instead of SiLU
        # silu(gate) * up in one kernel, where the device has one
        self.act_mul: Callable[[torch.Tensor], torch.Tensor] | None = None if self.gelu or ops is None else ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_mul is not None:
            return self.down_proj.forward(self.act_mul(self.gate_up_proj.forward(x)))
        proj = self.gate_up_proj
        if (
            proj.weight is not None
            and proj.method.parts.base is None
            and proj.method.parts.lora is None
            and proj.quant_rows < x.shape[0] <= self.split_max_rows
        ):
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
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.self_attn = Attention(cfg, backend, dtype, device, layer_idx, ops)
        # Granite: each sublayer's output is scaled before its residual add (1.0 elsewhere: no op)
        self.residual_multiplier = cfg.residual_multiplier
        # Gemma 3: the sliding layers' own RoPE tables; and "sandwich" norms: post_attention_layernorm
        # normalises the attention's output, pre_feedforward_layernorm the MLP's input (the role
        # post_attention_layernorm has in Llama), post_feedforward_layernorm the MLP's output
        self.local_rope = cfg.local_rope is not None and layer_idx in cfg.window_layers
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.mlp = MLP(cfg, dtype, device, ops)
        self.lora_ctx: LoRAContext | None = None  # set by runtime.lora.attach
        # The whole layer in a device's fused calls for the steps they take, chosen at load: the CUDA
        # few-row kernels (``FewRowStep``) or the CPU's calls on GGUF blocks (``gguf.layer.StoredStep``).
        self.fused_step: FusedLayerStep | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (the embeddings for the first layer, with no
        residual yet); returns this layer's MLP output and the residual stream before it. The residual
        adds happen inside the norms, so a fused norm does each add and its norm in one pass; the sums
        are the same as ``h = h + attn(norm(h)); h = h + mlp(norm(h))``."""
        step = self.fused_step
        # The fused calls take the weights directly: a step with LoRA rows goes through the projections.
        if step is not None and step.takes(x) and not (self.lora_ctx is not None and self.lora_ctx.plan):
            return step.forward(x, residual, cos_sin, meta)
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


class FusedLayerStep(Protocol):
    """A device's forward of a whole decoder layer for the steps it takes (``DecoderLayer.fused_step``)."""

    def takes(self, x: torch.Tensor) -> bool: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class FewRowStep:
    """The layer with each norm inside the projection after it and SiLU x up inside the down
    projection (``FewRowKernels``, CUDA's Triton kernels): 3 kernels instead of 7 around attention,
    while the kernels' ``max_rows`` admits the step."""

    def __init__(self, layer: DecoderLayer, kernels: FewRowKernels) -> None:
        self.layer = layer
        self.kernels = kernels

    def takes(self, x: torch.Tensor) -> bool:
        return self.kernels.applies(x.shape[0])

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, layer = self.kernels, self.layer
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        qkv, residual = k.rms_norm_linear(x, residual, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
        x = attn.attend(qkv, cos_sin, meta)
        m = layer.residual_multiplier
        if m != 1.0:
            x = x * m
        norm = layer.post_attention_layernorm
        gate_up, residual = k.rms_norm_linear(
            x, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
        )
        out = k.silu_mul_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias)
        return (out * m if m != 1.0 else out), residual


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm: HF's ``model.*`` namespace."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg, dtype, device)
        # Gemma 3: the sliding layers' RoPE (another theta), when the model has one
        self.rotary_emb_local: RotaryEmbedding | None = None
        if cfg.local_rope is not None:
            theta, scaling = cfg.local_rope
            self.rotary_emb_local = RotaryEmbedding(
                dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling), dtype, device
            )
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, dtype, device, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
