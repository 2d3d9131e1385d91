"""The building blocks of our decoder: parameters that the weight loader fills, RMSNorm, the projection
(``Linear``: plain, oneDNN-packed, few-row kernels, quantized, LoRA), and rotary position embeddings.

``runtime.models.llama`` assembles them into the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.runtime import quantization
from servelm.runtime.config import ModelConfig, UnsupportedModelError
from servelm.runtime.model_kernels import FusedRmsNorm, LayerOps, NormKernel
from servelm.runtime.projection import MethodChain, ProjectionMethod


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by the loader, and touching the
    # memory twice would double start-up cost and peak resident memory.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


# (x, residual | None, weight, eps) -> (norm(x [+ residual]) * weight, x + residual written into residual | None)


class TorchNorm:
    """RMSNorm in torch, computed in float32 as Hugging Face's Llama does (matters for bf16)."""

    def __init__(self, upcast_weight: bool) -> None:
        self.upcast_weight = upcast_weight
        self.name = "torch" + ("+upcast" if upcast_weight else "")

    def apply(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op instead of six; the same arithmetic as HF's (x * rsqrt(mean(x^2) + eps)) * w.
            return F.rms_norm(x, weight.shape, weight, eps)
        if self.upcast_weight:
            return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


class CompiledNorm:
    """The compiled CPU op (``cpu.ops.rms_norm``) on contiguous input; ``inner`` on any other."""

    name = "compiled"

    def __init__(self, kernel: NormKernel, inner: TorchNorm) -> None:
        self.kernel = kernel
        self.inner = inner

    def apply(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_contiguous():
            return self.kernel(x, weight, eps)
        return self.inner.apply(x, weight, eps)


class FusedNorm:
    """A fused norm kernel (``cuda.triton_ops.rms_norm``), without a residual."""

    name = "fused"

    def __init__(self, fused: FusedRmsNorm) -> None:
        self.fused = fused

    def apply(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.fused(x, None, weight, eps)[0]


class RMSNorm(nn.Module):
    """RMS normalisation through a norm method (torch, compiled or fused) chosen whenever its kernels
    or its weight's form change (setting ``kernel``, ``fused`` or ``upcast_weight``), never per call."""

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps | None = None,
        per_head: bool = False,
    ) -> None:
        super().__init__()
        self.weight = empty_param((size,), dtype, device)
        self.eps = eps
        self.dtype = dtype  # the model's (a Gemma weight becomes float32 after loading)
        ops = ops or LayerOps()
        self._kernel: NormKernel | None = ops.rms_norm  # the compiled CPU op
        # Residual add + norm in one kernel; not for per-head norms (Qwen3's q/k norms see [tokens, heads,
        # head_dim] views).
        self._fused: FusedRmsNorm | None = None if per_head else ops.add_rms_norm
        # Gemma: the weight is 1 + w in float32 (``CausalLM.after_load``), applied before rounding to
        # the input's dtype, as Gemma3RMSNorm computes it
        self._upcast_weight = False
        self.method: TorchNorm | CompiledNorm | FusedNorm = TorchNorm(False)
        self._choose_method()

    def _choose_method(self) -> None:
        torch_norm = TorchNorm(self._upcast_weight)
        if self._fused is not None:
            self.method = FusedNorm(self._fused)
        elif self._kernel is not None and (self.dtype == torch.float32 or not self._upcast_weight):
            # (Gemma's float32 weights under bfloat16 activations keep the torch path: the op rounds as Llama.)
            self.method = CompiledNorm(self._kernel, torch_norm)
        else:
            self.method = torch_norm

    @property
    def kernel(self) -> NormKernel | None:
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: NormKernel | None) -> None:
        self._kernel = kernel
        self._choose_method()

    @property
    def fused(self) -> FusedRmsNorm | None:
        return self._fused

    @fused.setter
    def fused(self, fused: FusedRmsNorm | None) -> None:
        self._fused = fused
        self._choose_method()

    @property
    def upcast_weight(self) -> bool:
        return self._upcast_weight

    @upcast_weight.setter
    def upcast_weight(self, upcast: bool) -> None:
        self._upcast_weight = upcast
        self._choose_method()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual add that precedes every norm but the first."""
        if self._fused is not None:
            out, r = self._fused(x, residual, self.weight, self.eps)
            return out, r  # type: ignore[return-value]
        r = x + residual
        return self.forward(r), r


class Linear(nn.Module):
    """``y = x W^T (+ b)``, optionally the concatenation of several checkpoint projections.

    ``shards`` lists (checkpoint shard name, output rows) in fused order; the parameter then carries
    ``shard_slices`` so the loader can copy each checkpoint tensor into its rows.
    """

    def __init__(
        self,
        in_features: int,
        shards: list[tuple[str, int]] | int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if isinstance(shards, int):
            shards = [("", shards)]
        self.out_features = sum(n for _, n in shards)
        self.in_features = in_features
        self.weight: nn.Parameter | None = empty_param((self.out_features, in_features), dtype, device)
        self.bias = empty_param((self.out_features,), dtype, device) if bias else None
        # How forward computes, and from what (a packed copy, a quantized one, a file's blocks, LoRA...).
        self.method = MethodChain()
        # checkpoint shard name -> our output rows (kept here too: packing may drop the weight)
        self.shard_rows: dict[str, slice] = {}
        if len(shards) > 1:
            start = 0
            for name, n in shards:
                self.shard_rows[name] = slice(start, start + n)
                start += n
            self.weight.shard_slices = self.shard_rows  # type: ignore[attr-defined]
            if self.bias is not None:
                self.bias.shard_slices = self.shard_rows  # type: ignore[attr-defined]

    def use_parts(self, **changes: Any) -> None:
        """Rebuild the method with these parts changed (``projection.MethodParts``): at load, or when
        LoRA or the ranks' sum is given, never per step."""
        self.method = self.method.with_parts(**changes)

    def use_base(self, make: Callable[[torch.Tensor], ProjectionMethod], keep_weight: bool) -> None:
        """Multiply through the device's own method, made from the weight (``cpu.packed``: a packed
        copy); irreversible. Without ``keep_weight`` the dense weight is dropped."""
        assert self.weight is not None and self.method.parts.base is None, "already given its base method"
        self.use_parts(base=make(self.weight))
        if not keep_weight:
            self.weight = None

    def use_stored(self, method: ProjectionMethod) -> None:
        """Compute from a weight kept in its file's format (``runtime.gguf.projection``): the dense
        parameter is dropped, and packing and quantization leave this projection alone."""
        self.weight = None
        self.use_parts(stored=method)

    @property
    def quant_rows(self) -> int:
        """Most rows the quantized few-row kernel takes (0: not quantized, or no kernel)."""
        quant = self.method.parts.quant
        return quant.max_rows if quant is not None else 0

    def quantize(self, scheme: str, kernels: dict[str, tuple[quantization.QuantizedKernel, int]]) -> None:
        """Quantize the weight (``runtime.quantization``): the parameter becomes its dequantized value,
        and steps of up to the scheme's kernel's rows run that kernel over the quantized copy."""
        assert self.weight is not None and self.method.parts.base is None, "quantize before packing"
        quant = quantization.quantize(self.weight, scheme, kernels)
        with torch.no_grad():
            self.weight.copy_(quant.dequantize(self.weight.dtype))
        self.use_parts(quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The projection, by the method chosen for its present form (LoRA's updates and a shard's
        sum over the ranks included: a model without them pays nothing for them)."""
        return self.method.apply(x, self.weight, self.bias)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for RoPE (float32), with the ``linear`` and ``llama3`` scalings."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "per_frequency":  # a GGUF file's rope_freqs.weight: one divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise UnsupportedModelError(f"{factors.numel()} RoPE frequency factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate in between.
        factor = float(scaling["factor"])
        low_ff = float(scaling["low_freq_factor"])
        high_ff = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low_ff
        high_wavelen = old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, per_frequency")


CosSin = tuple[torch.Tensor, torch.Tensor]  # the step's RoPE rows, [T, 1, head_dim / 2] each


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half, as HF Llama): cos/sin rows computed for each step's positions.

    The rows hold half the head dim (HF's full-width tables repeat the halves), so the rotation
    ``[x1 cos - x2 sin, x2 cos + x1 sin]`` is the same arithmetic as ``x cos + rotate_half(x) sin``.
    They are computed per step rather than looked up in tables of every position: the same float32
    product and cos/sin, without tables that grow with the context (Gemma 3 270M's two for 32k positions
    are 67 MiB).
    """

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device=device, dtype=torch.float32), persistent=False)

    def tables(self, positions: torch.Tensor) -> CosSin:
        """cos and sin rows for ``positions``, ``[T, 1, D/2]`` each: computed once per step, used by every layer."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # float32, as HF computes it
        return freqs.cos().to(self.dtype).unsqueeze(1), freqs.sin().to(self.dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the step's cos/sin rows -> a contiguous copy."""
    cos, sin = cos_sin
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
