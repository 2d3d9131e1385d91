"""A decoder layer's step of a few rows over GGUF-stored projections in four compiled calls and the
attention's one, instead of ~30 small torch ops and four projection calls.

A decode step of Gemma 3 270M spent ~6 ms a token (of ~19) in the Python around its 18 layers' kernels;
``StoredStep`` moves each norm into the projection after it (``gguf_norm_linear``) and the gated
activation, with Gemma 3's post-feedforward norm, into the down projection (``gguf_act_mul_linear``).
The arithmetic is the layer's own (``DecoderLayer.forward``), within float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .projection import GGUFMethod, GGUFShardedMethod, passes_of


@dataclass(frozen=True)
class StoredProjection:
    """What the compiled kernel takes for one projection: its parts' blocks and formats, in column order."""

    kernel: Any
    blocks: list[torch.Tensor]
    qtypes: list[int]
    out_features: int
    int8_x: bool
    max_rows: int

    @classmethod
    def of(cls, method: Any) -> StoredProjection | None:
        """The kernel's arguments for a stored projection method, or None (no kernel, or not stored)."""
        if isinstance(method, GGUFShardedMethod) and method.fused_kernel is not None:
            kernel = method.fused_kernel
            blocks, qtypes = method.fused_blocks, method.fused_qtypes
            parts = [m for _, m in method.parts]
        elif isinstance(method, GGUFMethod) and method.kernel is not None:
            kernel, blocks, qtypes, parts = method.kernel, [method.rows2d], [method.qtype_id], [method]
        else:
            return None
        if not hasattr(kernel, "gguf_norm_linear"):
            return None
        rows = min(min(m.kernel_max_rows for m in parts), passes_of(kernel, bool(method.int8_x)))
        return cls(kernel, blocks, qtypes, method.out_features, bool(method.int8_x), rows)


def _float32_vector(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 1)


class StoredStep:
    """The step of one ``DecoderLayer`` whose four projections are stored GGUF blocks with the compiled
    kernel (``attach``). ``max_rows``: the most rows a step may have to take this path (one pass of the
    kernel over each weight: a few rows, or with int8 activations a whole prefill step)."""

    def __init__(
        self, layer: Any, qkv: StoredProjection, o: StoredProjection, gate_up: StoredProjection, down: StoredProjection
    ) -> None:
        self.layer = layer
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.kernel = qkv.kernel
        self.max_rows = min(p.max_rows for p in (qkv, o, gate_up, down))
        attn = layer.self_attn
        self.qkv_bias = attn.qkv_proj.bias
        self.o_bias = attn.o_proj.bias
        self.gate_up_bias = layer.mlp.gate_up_proj.bias
        self.down_bias = layer.mlp.down_proj.bias
        self.eps = float(layer.input_layernorm.eps)
        self.gelu = bool(layer.mlp.gelu)  # Gemma: GELU (tanh); else SiLU
        # The norms' weights, resolved once (loaded before attach): Gemma 3 norms the attention's output
        # before its residual add (pre), then the MLP's input (norm), then the MLP's output (post).
        self.input_norm = layer.input_layernorm.weight
        if layer.sandwich:
            self.pre = layer.post_attention_layernorm.weight
            self.norm = layer.pre_feedforward_layernorm.weight
            self.post = layer.post_feedforward_layernorm.weight
        else:
            self.pre, self.norm, self.post = None, layer.post_attention_layernorm.weight, None

    @classmethod
    def attach(cls, layer: Any) -> StoredStep | None:
        """The step for ``layer`` where it applies (every projection stored with the kernel, float32
        norms, no residual multiplier), else None: the layer keeps its own forward."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = [
            StoredProjection.of(lin.method.parts.stored)
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        if any(p is None for p in projections) or len({id(p.kernel) for p in projections if p is not None}) != 1:
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.sandwich:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        biases = [lin.bias for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if (
            layer.residual_multiplier != 1.0
            or not attn.use_rope
            or not all(_float32_vector(n.weight) for n in norms)
            or len({float(n.eps) for n in norms}) != 1
            or not all(_float32_vector(b) for b in biases)
        ):
            return None
        qkv, o, gate_up, down = projections
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        return cls(layer, qkv, o, gate_up, down)

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_rows and x.dtype == torch.float32

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: Any, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DecoderLayer.forward`` for a step it takes (at most ``max_rows`` rows, float32 ``x``)."""
        k, attn = self.kernel, self.layer.self_attn
        t = x.shape[0]
        x = x.contiguous()
        qkv = x.new_empty((t, self.qkv.out_features))
        residual = k.gguf_norm_linear(
            x,
            residual,
            None,
            self.input_norm,
            self.eps,
            self.qkv.blocks,
            self.qkv.qtypes,
            qkv,
            self.qkv_bias,
            self.qkv.int8_x,
        )
        a = attn.attend_heads(qkv, cos_sin, meta).reshape(t, attn.q_size)
        o = x.new_empty((t, self.o.out_features))
        k.gguf_linear_parts(a.contiguous(), self.o.blocks, self.o.qtypes, o, self.o_bias, self.o.int8_x)
        gate_up = x.new_empty((t, self.gate_up.out_features))
        residual = k.gguf_norm_linear(
            o,
            residual,
            self.pre,
            self.norm,
            self.eps,
            self.gate_up.blocks,
            self.gate_up.qtypes,
            gate_up,
            self.gate_up_bias,
            self.gate_up.int8_x,
        )
        out = x.new_empty((t, self.down.out_features))
        k.gguf_act_mul_linear(
            gate_up,
            self.gelu,
            self.down.blocks,
            self.down.qtypes,
            out,
            self.down_bias,
            self.down.int8_x,
            self.post,
            self.eps,
        )
        return out, residual


class DecodeStack:
    """A decode-only step through every layer in one compiled call (``gguf_decode_stack``): each layer
    the calls of ``StoredStep.forward`` in the same order, from C++, where the Python, pybind and torch
    between ~150 calls a token ran while the other thread waited. For models whose every layer has a
    ``StoredStep``, on the CPU attention backend's fused decode path (``forward_from_qkv``)."""

    def __init__(self, model: Any, attention: tuple[int, int]) -> None:
        self.layers = list(model.model.layers)
        self.kernel = self.layers[0].fused_step.kernel
        self.attention = attention  # the fused decode call's address and ABI number
        self.max_rows = min(layer.fused_step.max_rows for layer in self.layers)
        self.bound: list[Any] | None = None  # the C++ layers, once the KV pool is bound (``bind``)

    @classmethod
    def attach(cls, model: Any) -> DecodeStack | None:
        layers = list(model.model.layers)
        steps = [layer.fused_step for layer in layers]
        if not steps or not all(isinstance(s, StoredStep) for s in steps) or len({id(s.kernel) for s in steps}) != 1:
            return None
        attention = getattr(layers[0].self_attn.backend, "rope_decode_address", None)
        if attention is None or not hasattr(steps[0].kernel, "gguf_decode_stack"):
            return None
        return cls(model, attention)

    def bind(self) -> None:
        """Build the C++ layers over the bound KV pool; a layer whose pool or q/k norms the fused
        attention cannot take leaves the stack unbound (the layers' own forwards run)."""
        k, layers = self.kernel, []
        for layer in self.layers:
            step, attn = layer.fused_step, layer.self_attn
            qk = attn.qk_norm
            if attn.k_cache is None or not attn.backend.fused_decode_takes(attn.k_cache, qk):
                self.bound = None
                return
            projections = [
                k.StackProjection(p.blocks, p.qtypes, p.out_features, bias, p.int8_x)
                for p, bias in (
                    (step.qkv, step.qkv_bias),
                    (step.o, step.o_bias),
                    (step.gate_up, step.gate_up_bias),
                    (step.down, step.down_bias),
                )
            ]
            q_w, k_w, qk_eps = qk if qk is not None else (None, None, 0.0)
            layers.append(
                k.StackLayer(
                    *projections,
                    step.input_norm,
                    step.norm,
                    step.pre,
                    step.post,
                    step.eps,
                    step.gelu,
                    attn.k_cache,
                    attn.v_cache,
                    attn.num_heads,
                    float(attn.scale),
                    int(attn.window_kw.get("window", 0)),
                    q_w,
                    k_w,
                    float(qk_eps),
                    bool(layer.local_rope),
                )
            )
        self.bound = layers

    def forward(
        self, x: torch.Tensor, cos_sin: Any, cos_sin_local: Any, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(last MLP output, residual)`` after every layer, or None where this step cannot take the
        stack (not decode-only, too many rows, LoRA in use): the layers run one by one."""
        first = self.layers[0]
        rows = x.shape[0]
        if self.bound is None or rows > self.max_rows or x.dtype != torch.float32:
            return None
        if first.lora_ctx is not None and first.lora_ctx.plan:
            return None
        args = first.self_attn.backend.fused_decode_args(meta)
        if args is None:
            return None
        slots, block_tables, seq_lens, max_seq_len = args
        (cos, sin), (cos_l, sin_l) = cos_sin, cos_sin_local
        out, residual = self.kernel.gguf_decode_stack(
            x, self.bound, cos, sin, cos_l, sin_l, slots, block_tables, seq_lens, int(max_seq_len), *self.attention
        )
        return out, residual


def attach(model: Any) -> int:
    """Give every decoder layer of ``model`` whose projections all qualify its ``StoredStep``, and the
    model a ``DecodeStack`` where every layer has one; returns how many layers got one. Call after the
    int8 choice (``use_int8_activations``): the steps keep it."""
    count = 0
    for layer in model.model.layers:
        layer.fused_step = StoredStep.attach(layer)
        count += layer.fused_step is not None
    model.decode_stack = DecodeStack.attach(model)
    return count
