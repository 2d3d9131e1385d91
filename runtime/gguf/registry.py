"""Which GGUF formats servelm decodes: each format's block layout and its dequantizer.

``dequantize`` turns a tensor's raw blocks into float32 of its logical shape. The 32-element formats
and the floats decode in ``quants``; the K-quants (256-element super-blocks) in ``kquants``, imported
on first use so that reading a file never pays for formats it does not hold.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from . import quants
from .reader import GGUFTensor

# Every format gguf-py knows: (elements per block, bytes per block).
BLOCK_LAYOUT: dict[Q, tuple[int, int]] = dict(GGML_QUANT_SIZES)

Dequantizer = Callable[[torch.Tensor], torch.Tensor]

_EAGER: dict[Q, Dequantizer] = {
    Q.F32: quants.dequantize_f32,
    Q.F16: quants.dequantize_f16,
    Q.BF16: quants.dequantize_bf16,
    Q.Q4_0: quants.dequantize_q4_0,
    Q.Q4_1: quants.dequantize_q4_1,
    Q.Q5_0: quants.dequantize_q5_0,
    Q.Q5_1: quants.dequantize_q5_1,
    Q.Q8_0: quants.dequantize_q8_0,
}
# Function names in ``kquants``, looked up at the first call.
_LAZY: dict[Q, str] = {
    Q.Q4_K: "dequantize_q4_k",
    Q.Q5_K: "dequantize_q5_k",
    Q.Q6_K: "dequantize_q6_k",
}

SUPPORTED: tuple[Q, ...] = (*_EAGER, *_LAZY)

RawTensor = tuple[torch.Tensor, Q, Sequence[int]]


def dequantizer(qtype: Q) -> Dequantizer:
    """The function that decodes ``qtype`` blocks ``[n, block_bytes]`` to float32 ``[n, block_elems]``."""
    if qtype in _EAGER:
        return _EAGER[qtype]
    if qtype in _LAZY:
        kquants = importlib.import_module(".kquants", __package__)
        return getattr(kquants, _LAZY[qtype])
    name = getattr(qtype, "name", str(qtype))
    supported = ", ".join(q.name for q in SUPPORTED)
    raise ValueError(f"GGUF format {name} has no dequantizer (supported: {supported})")


def dequantize(tensor: GGUFTensor | RawTensor) -> torch.Tensor:
    """A tensor's values as float32 of its logical shape, from a ``GGUFTensor`` or ``(raw, qtype, shape)``."""
    if isinstance(tensor, GGUFTensor):
        raw, qtype, shape = tensor.raw, tensor.qtype, tuple(tensor.shape)
    else:
        raw, qtype, shape = tensor[0], Q(tensor[1]), tuple(int(d) for d in tensor[2])
    decode = dequantizer(qtype)
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    n_elems = 1
    for d in shape:
        n_elems *= d
    if n_elems % block_elems or raw.numel() != n_elems // block_elems * block_bytes:
        raise ValueError(
            f"{qtype.name} tensor of shape {list(shape)} wants {n_elems // block_elems * block_bytes} bytes "
            f"in {block_elems}-element blocks, got {raw.numel()}"
        )
    return decode(raw.reshape(-1, block_bytes)).reshape(shape)
