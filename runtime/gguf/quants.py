"""Dequantizers for GGUF's 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and its float
formats (F32, F16, BF16, one element per block).

Each takes a tensor's raw bytes as uint8 blocks ``[n_blocks, block_bytes]`` and returns float32
``[n_blocks, block_elems]``, whole-tensor torch ops with no Python loop over blocks. The arithmetic
follows ggml's reference (scale from float16, then ``d * q`` or ``d * q + m`` in float32, one rounding
per operation), so results equal gguf-py's and llama.cpp's bit for bit.

Block layouts (little-endian, as ggml writes them on every platform it supports):
  Q4_0  d:f16 | qs[16]         x = d * (q - 8)     q: 4 bits, low nibbles are elements 0..15
  Q4_1  d:f16 m:f16 | qs[16]   x = d * q + m       high nibbles are elements 16..31
  Q5_0  d:f16 | qh[4] qs[16]   x = d * (q - 16)    q: 4 low bits from qs, 5th bit j is bit j of qh
  Q5_1  d:f16 m:f16 | qh qs    x = d * q + m
  Q8_0  d:f16 | qs:int8[32]    x = d * q
"""

from __future__ import annotations

import torch

QK = 32  # elements per block of the formats in this module


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32 ``[n_blocks, 1]``."""
    # A copy of two bytes per block: a strided uint8 slice cannot be reinterpreted as float16 in place.
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` packed bytes -> ``[n, 32]`` 4-bit values, low nibbles first as ggml packs them."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` bytes of a little-endian uint32 -> ``[n, 32]`` bits shifted to 16 (the 5th bit)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    # Byte b holds bits 8b..8b+7, so unpacking bytes in order, low bit first, gives bits 0..31 in order.
    bits = (qh.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(qh.shape[0], QK) << 4


def _check(blocks: torch.Tensor, block_bytes: int, fmt: str) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != block_bytes:
        raise ValueError(f"{fmt} wants uint8 blocks [n, {block_bytes}], got {blocks.dtype} {list(blocks.shape)}")


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks (18 bytes) -> float32 ``[n_blocks, 32]``."""
    _check(blocks, 18, "Q4_0")
    q = _nibbles(blocks[:, 2:18]).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (20 bytes) -> float32 ``[n_blocks, 32]``."""
    _check(blocks, 20, "Q4_1")
    q = _nibbles(blocks[:, 4:20])
    # Multiply then add as two roundings (no fused multiply-add), as the reference does.
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks (22 bytes) -> float32 ``[n_blocks, 32]``."""
    _check(blocks, 22, "Q5_0")
    q = (_nibbles(blocks[:, 6:22]) | _high_bits(blocks[:, 2:6])).to(torch.int8) - 16
    return _f16(blocks, 0) * q.float()


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1 blocks (24 bytes) -> float32 ``[n_blocks, 32]``."""
    _check(blocks, 24, "Q5_1")
    q = _nibbles(blocks[:, 8:24]) | _high_bits(blocks[:, 4:8])
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (34 bytes) -> float32 ``[n_blocks, 32]``."""
    _check(blocks, 34, "Q8_0")
    q = blocks[:, 2:34].view(torch.int8)
    return _f16(blocks, 0) * q.float()


def dequantize_f32(blocks: torch.Tensor) -> torch.Tensor:
    """F32 elements as ``[n, 4]`` bytes -> float32 ``[n, 1]`` (a copy, so the result is writable)."""
    _check(blocks, 4, "F32")
    return blocks.contiguous().view(torch.float32).clone()


def dequantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    """F16 elements as ``[n, 2]`` bytes -> float32 ``[n, 1]``."""
    _check(blocks, 2, "F16")
    return blocks.contiguous().view(torch.float16).float()


def dequantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    """BF16 elements as ``[n, 2]`` bytes -> float32 ``[n, 1]``."""
    _check(blocks, 2, "BF16")
    # bfloat16 is float32's upper half, so widening is exact and keeps every bit, NaN payloads too.
    return blocks.contiguous().view(torch.bfloat16).float()
