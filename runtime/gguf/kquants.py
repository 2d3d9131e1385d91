"""Vectorized torch dequantizers for GGUF's K-quant formats (Q4_K, Q5_K, Q6_K).

Each function takes a GGUF tensor's raw bytes as uint8 ``[n_blocks, block_bytes]``
(one row per 256-element super-block) and returns float32 ``[n_blocks, 256]``,
bit-for-bit what gguf-py's reference (``gguf.quants.dequantize``) computes: the
same fp16 → fp32 conversions and the same float32 multiply/subtract order.

Layouts (little-endian, as in ggml's ``block_q*_K`` structs):

- Q4_K (144 bytes): ``d`` fp16, ``dmin`` fp16, 12 bytes of packed 6-bit scales and
  mins for 8 sub-blocks of 32, then 128 bytes of 4-bit quants.
  ``x = d * scale * q - dmin * min``.
- Q5_K (176 bytes): as Q4_K, then 32 bytes ``qh`` holding each element's 5th bit
  (bit j of ``qh[l]`` belongs to sub-block j, element l), then the 128 bytes of
  low nibbles.
- Q6_K (210 bytes): 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2 bits),
  16 int8 scales for sub-blocks of 16, then ``d`` fp16. ``x = d * scale * (q - 32)``.
"""

from __future__ import annotations

import torch

QK_K = 256
"""Elements per K-quant super-block."""

Q4_K_BLOCK_BYTES = 144
Q5_K_BLOCK_BYTES = 176
Q6_K_BLOCK_BYTES = 210

_K_SCALE_SIZE = 12

__all__ = [
    "Q4_K_BLOCK_BYTES",
    "Q5_K_BLOCK_BYTES",
    "Q6_K_BLOCK_BYTES",
    "QK_K",
    "dequantize_q4_k",
    "dequantize_q5_k",
    "dequantize_q6_k",
]


def _check_blocks(blocks: torch.Tensor, block_bytes: int, name: str) -> None:
    """Reject anything but uint8 ``[n_blocks, block_bytes]``, so a wrong slice fails loudly."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != block_bytes:
        raise ValueError(f"{name} expects uint8 [n_blocks, {block_bytes}], got {blocks.dtype} {list(blocks.shape)}")


def _fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte ``start`` of each block, as float32 ``[n_blocks, 1]``."""
    # contiguous() first: a column slice of a block row cannot be reinterpreted in place.
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _unpack_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K/Q5_K from their 12 packed bytes, as uint8 ``[n, 8]``.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins
    4-7 take their low 4 bits from bytes 8-11 (low / high nibble) and their top 2 bits
    from the spare top bits of bytes 0-3 / 4-7.
    """
    low_sc, low_m, nib = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = torch.cat([low_sc & 0x3F, (nib & 0x0F) | ((low_sc >> 2) & 0x30)], dim=1)
    minimum = torch.cat([low_m & 0x3F, (nib >> 4) | ((low_m >> 2) & 0x30)], dim=1)
    return scale, minimum


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 quant bytes as 8 sub-blocks of 32 low-4-bit values, uint8 ``[n, 8, 32]``.

    Each run of 32 bytes feeds two sub-blocks: its low nibbles the first, its high
    nibbles the next.
    """
    chunks = qs.reshape(-1, 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, 8, 32)


def _scaled_minus_min(
    blocks: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    """``d * scale * q - dmin * min`` per sub-block, in the reference's float32 order."""
    d = _fp16_field(blocks, 0)
    dmin = _fp16_field(blocks, 2)
    # Products are formed exactly as the reference does ((d*scale)*q, then minus dmin*min)
    # so results match bitwise; reassociating would change last-ulp rounding.
    d_scale = (d * scale.to(torch.float32)).unsqueeze(-1)
    d_min = (dmin * minimum.to(torch.float32)).unsqueeze(-1)
    return (d_scale * q.to(torch.float32) - d_min).reshape(-1, QK_K)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Dequantize Q4_K super-blocks: uint8 ``[n_blocks, 144]`` → float32 ``[n_blocks, 256]``."""
    _check_blocks(blocks, Q4_K_BLOCK_BYTES, "dequantize_q4_k")
    scale, minimum = _unpack_scale_min(blocks[:, 4 : 4 + _K_SCALE_SIZE])
    q = _nibbles(blocks[:, 16:144])
    return _scaled_minus_min(blocks, q, scale, minimum)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Dequantize Q5_K super-blocks: uint8 ``[n_blocks, 176]`` → float32 ``[n_blocks, 256]``."""
    _check_blocks(blocks, Q5_K_BLOCK_BYTES, "dequantize_q5_k")
    scale, minimum = _unpack_scale_min(blocks[:, 4 : 4 + _K_SCALE_SIZE])
    qh = blocks[:, 16:48]
    low = _nibbles(blocks[:, 48:176])
    # Bit j of qh[l] is the 5th bit of element l of sub-block j.
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
    high = (qh.unsqueeze(1) >> shifts) & 0x01
    q = low | (high << 4)
    return _scaled_minus_min(blocks, q, scale, minimum)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Dequantize Q6_K super-blocks: uint8 ``[n_blocks, 210]`` → float32 ``[n_blocks, 256]``."""
    _check_blocks(blocks, Q6_K_BLOCK_BYTES, "dequantize_q6_k")
    ql = blocks[:, 0:128]
    qh = blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _fp16_field(blocks, 208)
    # Each 128-element half reads 64 ql bytes (low nibbles give elements 0-63, high
    # nibbles 64-127) and 32 qh bytes (2-bit fields at shifts 0,2,4,6 give elements
    # 0-31, 32-63, 64-95, 96-127).
    ql_half = ql.reshape(-1, 2, 1, 64)
    low = torch.cat([ql_half & 0x0F, ql_half >> 4], dim=2).reshape(-1, 2, 4, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    high = (qh.reshape(-1, 2, 1, 32) >> shifts) & 0x03
    q = (low | (high << 4)).view(torch.int8) - 32
    d_scale = (d * scales).unsqueeze(-1)
    return (d_scale * q.reshape(-1, QK_K // 16, 16).to(torch.float32)).reshape(-1, QK_K)
