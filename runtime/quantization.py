"""Weight-only quantization for the CPU path (``--quantization int8`` / ``int4``).

Why: a decode step of a few rows is a pass over every weight, so on CPU its time is the weight
bytes over the memory bandwidth (538 MB of float32 for the default model: ~20 ms a token here). int8
weights are a quarter of those bytes; ``csrc/cpu_ops.cpp``'s ``linear_few_row_int8`` streams them and
multiplies in float32.

Scheme: symmetric, one float32 scale per output row (``scale = max |w_row| / 127``, ``q = round(w /
scale)`` in [-127, 127]); activations stay float32. Every projection and the vocabulary head are
quantized; the token embedding stays float32 (a lookup reads one row per token, and a tied head gets
its own quantized copy). The float32 weights are then replaced by their dequantized values ``q *
scale``, so the paths for more rows (oneDNN, torch) compute with the same weights as the int8 kernel:
results differ between them only by float32 summation order, as they do unquantized. Tokens do differ
from the float32 model's: this is an approximation the user opts into.

``int4``: every projection in groups of 32 weights along K, 4 bits a weight with an fp16 scale and
minimum a group (``w = d * q + m``, q in 0..15: llama.cpp's Q4_1), and the vocabulary head in int8
groups of 32 with an fp16 scale a group (Q8_0). 5 and 8.5 bits a weight. That is exactly how the
default model ships (its GGUF is Q4_1 with a Q8_0 embedding), so for it the quantized weights equal
the float32 checkpoint's bit for bit (tested) and the tokens are the float32 model's up to summation
order, at a sixth of the bytes. On other checkpoints it is an approximation, as int8 is. The dequantized
weights replace the float32 ones here too, so more rows (oneDNN) compute with the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

QUANTIZATIONS = ("int8", "int4", "auto", "none")
NONE = "none"  # no quantization; for a GGUF file: dequantized into the dtype instead of kept as stored
# "auto": int4 where it is exact for the checkpoint (every projection and the head already on its grid,
# as for a model dequantized from a Q4_1 GGUF with a Q8_0 embedding), else none; CPU float32 only.
AUTO = "auto"
# What the start-up log says of each.
QUANTIZATION_LABELS = {
    "int8": "int8 (per-row scales)",
    "int4": "int4 (groups of 32, fp16 scale and minimum; head int8 in groups of 32)",
}
GROUP = 32  # weights per group along K for the grouped schemes (llama.cpp's Q4_1 / Q8_0 block)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` int8, ``[N]`` float32 scale), symmetric per row.

    A row of zeros gets scale 1 (and zeros): nothing to represent, and no division by zero."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_rows takes a [N, K] weight, got {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale[:, None]`` in ``dtype``: the weight the quantized model computes with."""
    return (q.float() * scale[:, None]).to(dtype)


def _group_view(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(
            f"grouped quantization takes a [N, K] weight with K a multiple of {GROUP}, got {tuple(weight.shape)}"
        )
    w = weight.detach().float()
    return w.view(w.shape[0], w.shape[1] // GROUP, GROUP)


def _to_half(t: torch.Tensor, what: str) -> torch.Tensor:
    h = t.half()
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"grouped quantization: a {what} is beyond float16's range")
    return h.contiguous()


def _codes(w: torch.Tensor, d: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """round(w / d) clamped to [lo, hi] per group; 0 where the scale is 0 (a constant group)."""
    safe = torch.where(d > 0, d, torch.ones_like(d))[..., None]
    return torch.where(d[..., None] > 0, torch.round(w / safe), torch.zeros_like(w)).clamp_(lo, hi)


def quantize_int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (packed uint8 ``[N, K/2]``, fp16 scales ``[N, K/32]``, fp16 minimums ``[N, K/32]``).

    Per group: ``m = min``, ``d = (max - min) / 15`` (both rounded to fp16 first), ``q = round((w - m) / d)``
    in 0..15. Byte j of a group's 16 holds q[j] in its low nibble and q[j + 16] in its high one (the
    kernel's layout)."""
    w = _group_view(weight)
    lo, hi = w.amin(-1), w.amax(-1)
    m16 = _to_half(lo, "group minimum")
    d16 = _to_half((hi - lo) / 15, "group scale")
    q = _codes(w - m16.float()[..., None], d16.float(), 0, 15).to(torch.uint8)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
    return packed.reshape(w.shape[0], -1).contiguous(), d16, m16


def dequantize_int4_groups(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``d * q + m`` in float32 (then ``dtype``): the weight the int4 model computes with."""
    n, groups = scales.shape
    p = packed.view(n, groups, GROUP // 2)
    q = torch.cat((p & 0xF, p >> 4), dim=-1).float()
    return (q * scales.float()[..., None] + mins.float()[..., None]).view(n, groups * GROUP).to(dtype)


def quantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (int8 ``[N, K]``, fp16 scales ``[N, K/32]``): symmetric, ``d = max |w| / 127`` a group."""
    w = _group_view(weight)
    d16 = _to_half(w.abs().amax(-1) / 127, "group scale")
    q = _codes(w, d16.float(), -127, 127).to(torch.int8)
    return q.view(w.shape[0], -1).contiguous(), d16


def dequantize_int8_groups(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, groups = scales.shape
    return (q.view(n, groups, GROUP).float() * scales.float()[..., None]).view(n, groups * GROUP).to(dtype)


# (x [M, K] float32 contiguous, *quantized tensors, bias [N] | None) -> [M, N] float32
QuantizedKernel = Callable[..., torch.Tensor]


@dataclass
class QuantizedWeight:
    """A projection's quantized copy (``tensors``, in the kernel's argument order) and the few-row CPU
    kernel over it; steps of up to ``max_rows`` rows use the kernel (0: no kernel here)."""

    scheme: str  # "int8" (per row), "int4" (groups of 32), "int8_groups" (groups of 32)
    tensors: tuple[torch.Tensor, ...]
    kernel: QuantizedKernel | None = None
    max_rows: int = 0

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.kernel is not None
        return self.kernel(x.contiguous(), *self.tensors, bias)

    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weight reads: codes plus scales (and minimums)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.scheme == "int8":
            q, scale = self.tensors
            return dequantize_rows(q, scale, dtype=dtype)
        if self.scheme == "int4":
            packed, scales, mins = self.tensors
            return dequantize_int4_groups(packed, scales, mins, dtype=dtype)
        q, scales = self.tensors
        return dequantize_int8_groups(q, scales, dtype=dtype)


_QUANTIZERS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "int8": quantize_rows,
    "int4": quantize_int4_groups,
    "int8_groups": quantize_int8_groups,
}


def head_scheme(quantization: str) -> str:
    """The vocabulary head's scheme under ``--quantization``: int4 keeps the head in int8 groups (Q8_0),
    as the default model ships it, so that the head too stays exact there."""
    return "int8_groups" if quantization == "int4" else quantization


def quantize(
    weight: torch.Tensor, scheme: str, kernels: dict[str, tuple[QuantizedKernel, int]] | None = None
) -> QuantizedWeight:
    """Quantize ``weight`` ``[N, K]`` with ``scheme``, with the few-row kernel ``kernels[scheme]`` when given."""
    if scheme not in _QUANTIZERS:
        raise ValueError(f"unknown quantization scheme {scheme!r}")
    kernel, rows = (kernels or {}).get(scheme, (None, 0))
    return QuantizedWeight(scheme, _QUANTIZERS[scheme](weight), kernel, rows)


def check_group_widths(widths: list[int], quantization: str | None) -> None:
    """int4 quantizes in groups of 32 along K: refuse, at start-up, a model with another width."""
    if quantization == "int4":
        odd = sorted({k for k in widths if k % GROUP})
        if odd:
            raise ValueError(
                f"--quantization int4 needs every projection's input width to be a multiple of {GROUP}; this model has {odd}"
            )


def projection_widths(cfg: Any) -> list[int]:
    """The input widths of a Llama-family model's projections (a ``ModelConfig``): hidden (q/k/v,
    gate/up, head), heads x head_dim (o), intermediate (down)."""
    return [cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size]
