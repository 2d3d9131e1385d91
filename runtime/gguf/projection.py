"""A projection whose weight stays in its GGUF block format: ``x W^T (+ b)`` over the file's raw blocks.

``GGUFMethod`` is a ``runtime.projection.ProjectionMethod`` that holds a tensor's raw blocks (the
memory-mapped view the reader returns, never a float copy) and, at every call, dequantizes a tile of
output rows at a time with the registry's dequantizer and multiplies it with ``F.linear`` into a
preallocated output. The float weight therefore exists only one tile at a time, so serving a GGUF
file costs its quantized size in memory plus one tile; native kernels that never materialise floats
are the next step and will replace this method behind the same protocol.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from .reader import GGUFTensor
from .registry import BLOCK_LAYOUT, Dequantizer, dequantizer

# Bytes of one dequantized float32 tile: small enough to stay in a core's L2 next to its blocks,
# large enough that the per-tile Python and dispatch overhead is small against the decode itself.
TILE_BYTES = 2 << 20
MIN_TILE_ROWS = 16


def tile_rows_for(in_features: int, tile_bytes: int = TILE_BYTES) -> int:
    """Output rows per tile so that one float32 tile takes about ``tile_bytes``."""
    return max(MIN_TILE_ROWS, tile_bytes // (4 * in_features))


class GGUFMethod:
    """``x W^T (+ b)`` with ``W`` kept as GGUF blocks ``[out, in / block_elems, block_bytes]``.

    Each call dequantizes ``tile_rows`` output rows at a time (float32, at most
    ``tile_rows * in_features * 4`` bytes per tile plus the dequantizer's own temporaries for those
    rows) and writes that tile's ``F.linear`` into its columns of the output, so the working set does
    not grow with ``out_features``. The ``weight`` argument of ``apply`` is ignored: the blocks are
    the weight, and a ``Linear`` serving them holds no dense one.
    """

    def __init__(
        self,
        raw: torch.Tensor,
        qtype: GGMLQuantizationType,
        shape: tuple[int, int],
        tile_rows: int | None = None,
    ) -> None:
        if len(shape) != 2:
            raise ValueError(f"a projection weight is [out_features, in_features], got shape {list(shape)}")
        out_features, in_features = (int(d) for d in shape)
        block_elems, block_bytes = BLOCK_LAYOUT[qtype]
        # A block may not straddle two rows, or a tile of rows would not be a whole number of blocks.
        if in_features % block_elems:
            raise ValueError(
                f"{qtype.name} packs {block_elems} elements a block; in_features {in_features} is not a multiple"
            )
        blocks_per_row = in_features // block_elems
        if raw.dtype != torch.uint8 or raw.numel() != out_features * blocks_per_row * block_bytes:
            raise ValueError(
                f"{qtype.name} weight [{out_features}, {in_features}] wants "
                f"{out_features * blocks_per_row * block_bytes} uint8 bytes, got {raw.dtype} {raw.numel()}"
            )
        self.qtype = qtype
        self.out_features = out_features
        self.in_features = in_features
        self.block_bytes = block_bytes
        # A view of the file's memory map: the reader's blocks are contiguous, so reshaping copies nothing.
        self.blocks = raw.reshape(out_features, blocks_per_row, block_bytes)
        self.decode: Dequantizer = dequantizer(qtype)
        self.tile_rows = tile_rows if tile_rows is not None else tile_rows_for(in_features)
        if self.tile_rows < 1:
            raise ValueError(f"tile_rows must be positive, got {self.tile_rows}")
        self.name = f"gguf-{qtype.name}"

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Output rows ``start:stop`` of the weight as float32 ``[stop - start, in_features]``."""
        tile = self.blocks[start:stop].reshape(-1, self.block_bytes)
        return self.decode(tile).reshape(stop - start, self.in_features)

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name} projection takes {self.in_features} features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        out = rows.new_empty((rows.shape[0], self.out_features))
        for start in range(0, self.out_features, self.tile_rows):
            stop = min(start + self.tile_rows, self.out_features)
            tile = self.dequantize_rows(start, stop)
            if tile.dtype != rows.dtype:
                tile = tile.to(rows.dtype)  # a bfloat16 or float16 model multiplies in its own dtype
            tile_bias = bias[start:stop] if bias is not None else None
            out[:, start:stop] = F.linear(rows, tile, tile_bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def gguf_method(tensor: GGUFTensor, tile_rows: int | None = None) -> GGUFMethod:
    """The projection method that serves ``tensor`` (a ``[out, in]`` GGUF weight) from its own blocks."""
    if len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: a projection weight has two dimensions, got {list(tensor.shape)}")
    out_features, in_features = tensor.shape
    return GGUFMethod(tensor.raw, tensor.qtype, (out_features, in_features), tile_rows)
