"""A projection whose weight stays in its GGUF block format: ``x W^T (+ b)`` over the file's raw blocks.

``GGUFMethod`` is a ``runtime.projection.ProjectionMethod`` that holds a tensor's raw blocks (the
memory-mapped view the reader returns, never a float copy). Steps of a few rows run the compiled
kernel (``cpu.gguf_kernels``, given by the platform), which multiplies straight from the blocks; larger steps, or where the kernel
cannot be built, dequantize a tile of output rows at a time with the registry's dequantizer and
multiply it with ``F.linear`` (oneDNN) into the output, so the float weight exists one tile at a time.
``GGUFShardedMethod`` is a fused projection (q/k/v, gate/up) whose parts are separate GGUF tensors,
and ``GGUFEmbedding`` the token lookup from quantized rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from servelm.runtime.platform import platform_of

from .reader import GGUFTensor
from .registry import BLOCK_LAYOUT, Dequantizer, dequantizer

# Bytes of one dequantized float32 tile: small enough to stay in a core's L2 next to its blocks,
# large enough that the per-tile Python and dispatch overhead is small against the decode itself.
TILE_BYTES = 2 << 20
MIN_TILE_ROWS = 16
# Most rows a step may have for the compiled kernel, which takes them KERNEL_CHUNK rows a call (its
# few-row path); larger steps amortise a dequantized tile over enough rows that the matmul wins (the
# crossover, ~32 rows on the layers' shapes and far beyond on a vocabulary head: docs/gguf.md).
KERNEL_MAX_ROWS = 32
KERNEL_CHUNK = 8
# With int8 activations the kernel's integer tiles outrun the dequantized float tiles at every step
# size measured, with AVX2 alone and with VNNI, up to 2048 rows (docs/gguf.md): no cap.
INT8_KERNEL_MAX_ROWS = 1 << 62


def passes_of(kernel: Any, int8_x: bool) -> int:
    """Rows one call of the compiled kernel takes in one pass over a weight: any number with int8
    activations where the build has the integer tiles (``int8_one_pass``), else its ``pass_rows``."""
    if int8_x and getattr(kernel, "int8_one_pass", False):
        return 1 << 30
    return int(getattr(kernel, "pass_rows", KERNEL_CHUNK))


def tile_rows_for(in_features: int, tile_bytes: int = TILE_BYTES) -> int:
    """Output rows per tile so that one float32 tile takes about ``tile_bytes``."""
    return max(MIN_TILE_ROWS, tile_bytes // (4 * in_features))


def _kernel(qtype: GGMLQuantizationType, device: torch.device) -> Any:
    """The compiled kernel module where it serves ``qtype`` on ``device``, else None (the tile path
    serves all)."""
    return platform_of(device).gguf_kernel(qtype)


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
        self.qtype_id = int(qtype)
        self.out_features = out_features
        self.in_features = in_features
        self.block_bytes = block_bytes
        self.blocks_per_row = blocks_per_row
        # A view of the file's memory map, one row of blocks per output feature: the reader's blocks
        # are contiguous, so reshaping copies nothing.
        self.rows2d = raw.reshape(out_features, blocks_per_row * block_bytes)
        self.decode: Dequantizer = dequantizer(qtype)
        self.tile_rows = tile_rows if tile_rows is not None else tile_rows_for(in_features)
        if self.tile_rows < 1:
            raise ValueError(f"tile_rows must be positive, got {self.tile_rows}")
        self.kernel = _kernel(qtype, raw.device)
        self.kernel_max_rows = KERNEL_MAX_ROWS  # read at every call (benchmarks move it)
        self.int8_x = False  # activations rounded to int8 per block (`use_int8_activations`)
        self.name = f"gguf-{qtype.name}" + ("+kernel" if self.kernel is not None else "")

    @classmethod
    def of(cls, tensor: GGUFTensor, tile_rows: int | None = None) -> GGUFMethod:
        """The method serving ``tensor``, a ``[out, in]`` GGUF weight, from its own blocks."""
        return gguf_method(tensor, tile_rows)

    @property
    def blocks(self) -> torch.Tensor:
        """The weight's blocks ``[out_features, blocks_per_row, block_bytes]`` (a view)."""
        return self.rows2d.view(self.out_features, self.blocks_per_row, self.block_bytes)

    @property
    def nbytes(self) -> int:
        return self.rows2d.numel()

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Output rows ``start:stop`` of the weight as float32 ``[stop - start, in_features]``."""
        if self.kernel is not None:  # the compiled decoder: bit-equal, several times faster than torch ops
            ids = torch.arange(start, stop)
            return self.kernel.gguf_get_rows(self.rows2d, ids, int(self.qtype), self.in_features)
        tile = self.blocks[start:stop].reshape(-1, self.block_bytes)
        return self.decode(tile).reshape(stop - start, self.in_features)

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name} projection takes {self.in_features} features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        out = rows.new_empty((rows.shape[0], self.out_features))
        self.apply_into(rows, out, bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def apply_into(
        self,
        rows: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None,
        rounded: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Write ``rows W^T (+ bias)`` into ``out`` ``[M, out_features]`` (a column slice of a wider
        output is fine: the fused projections write each part into its own columns). ``rounded``: the
        int8 path's x' per activation block, shared by a fused projection's parts (rounded once)."""
        if self.kernel is not None and rows.shape[0] <= self.kernel_max_rows and rows.dtype == torch.float32:
            rows = rows.contiguous()
            chunk = passes_of(self.kernel, self.int8_x)  # rows one pass over W serves
            if rows.shape[0] <= chunk:  # a decode step: no slicing (views cost a few µs, ~70 calls a token)
                self.kernel.gguf_linear(rows, self.rows2d, self.qtype_id, out, bias, self.int8_x)
                return
            for s in range(0, rows.shape[0], chunk):
                self.kernel.gguf_linear(
                    rows[s : s + chunk], self.rows2d, self.qtype_id, out[s : s + chunk], bias, self.int8_x
                )
            return
        if self.int8_x:  # the same W x' as the kernel's
            block = activation_block(self.qtype)
            x = rounded.get(block) if rounded is not None else None
            if x is None:
                if self.kernel is not None and rows.dtype == torch.float32:
                    x = self.kernel.gguf_round_x(rows.contiguous(), block)
                else:
                    x = round_activations(rows, block)
                if rounded is not None:
                    rounded[block] = x
            rows = x
        for start in range(0, self.out_features, self.tile_rows):
            stop = min(start + self.tile_rows, self.out_features)
            tile = self.dequantize_rows(start, stop)
            if tile.dtype != rows.dtype:
                tile = tile.to(rows.dtype)  # a bfloat16 or float16 model multiplies in its own dtype
            tile_bias = bias[start:stop] if bias is not None else None
            out[:, start:stop] = F.linear(rows, tile, tile_bias)


class GGUFShardedMethod:
    """A fused projection (q/k/v or gate/up) whose parts are separate GGUF tensors, possibly of
    different formats: each part writes its own output columns. Where every part has the compiled
    kernel and the parts' columns tile the output in order, steps of a few rows run all parts in one
    kernel call (``gguf_linear_parts``: one parallel region over every part's rows); other steps go
    part by part."""

    def __init__(self, parts: list[tuple[slice, GGUFMethod]]) -> None:
        self.parts = parts
        self.in_features = parts[0][1].in_features
        self.out_features = sum(m.out_features for _, m in parts)
        self.name = "gguf-" + "/".join(m.name.removeprefix("gguf-") for _, m in parts)
        self.fused_kernel: Any = None
        self.int8_x = False  # any part's activations rounded to int8 (`use_int8_activations`)
        ordered = sorted(parts, key=lambda p: p[0].start or 0)
        kernel = parts[0][1].kernel
        if (
            self._tile(ordered, self.out_features)
            and all(m.kernel is kernel for _, m in parts)
            and hasattr(kernel, "gguf_linear_parts")
        ):
            self.fused_kernel = kernel
            self.fused_blocks = [m.rows2d for _, m in ordered]
            self.fused_qtypes = [int(m.qtype) for _, m in ordered]

    @staticmethod
    def _tile(ordered: list[tuple[slice, GGUFMethod]], out_features: int) -> bool:
        """Whether the parts' columns, in order, are contiguous and cover ``[0, out_features)``."""
        edge = 0
        for cols, method in ordered:
            start, stop, step = cols.indices(out_features)
            if start != edge or step != 1 or stop - start != method.out_features:
                return False
            edge = stop
        return edge == out_features

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for _, m in self.parts)

    def apply(
        self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = rows.new_empty((rows.shape[0], self.out_features))
        if (
            self.fused_kernel is not None
            and rows.dtype == torch.float32
            and all(rows.shape[0] <= m.kernel_max_rows for _, m in self.parts)
        ):
            int8_x = self.int8_x
            step = passes_of(self.fused_kernel, int8_x)
            if rows.shape[0] <= step:
                self.fused_kernel.gguf_linear_parts(rows, self.fused_blocks, self.fused_qtypes, out, bias, int8_x)
                return out.reshape(*x.shape[:-1], self.out_features)
            for s in range(0, rows.shape[0], step):
                chunk = slice(s, s + step)
                self.fused_kernel.gguf_linear_parts(
                    rows[chunk], self.fused_blocks, self.fused_qtypes, out[chunk], bias, int8_x
                )
        else:
            rounded: dict[int, torch.Tensor] = {}  # int8: x' per activation block, once for all parts
            for cols, method in self.parts:
                method.apply_into(rows, out[:, cols], bias[cols] if bias is not None else None, rounded)
        return out.reshape(*x.shape[:-1], self.out_features)


class GGUFEmbedding:
    """The token embedding read per token from its quantized rows; also the tied vocabulary head."""

    def __init__(self, tensor: GGUFTensor) -> None:
        self.tensor = tensor
        self.vocab_size, self.hidden_size = tensor.shape
        self.head = GGUFMethod.of(tensor)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[T]`` -> float32 ``[T, hidden]``: only those rows are decoded."""
        head = self.head
        if head.kernel is not None:
            return head.kernel.gguf_get_rows(head.rows2d, ids, int(head.qtype), self.hidden_size)
        rows = head.blocks.index_select(0, ids).reshape(-1, head.block_bytes)
        return head.decode(rows).reshape(ids.shape[0], self.hidden_size)


def gguf_method(tensor: GGUFTensor, tile_rows: int | None = None) -> GGUFMethod:
    """The projection method that serves ``tensor`` (a ``[out, in]`` GGUF weight) from its own blocks."""
    if len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: a projection weight has two dimensions, got {list(tensor.shape)}")
    out_features, in_features = tensor.shape
    return GGUFMethod(tensor.raw, tensor.qtype, (out_features, in_features), tile_rows)


GGUF_ACTIVATIONS = ("float32", "int8")  # what the stored projections multiply by (--gguf-activations)


def activation_block(qtype: GGMLQuantizationType) -> int:
    """Elements per activation scale against weights of ``qtype`` on the int8 path (llama.cpp's
    arithmetic): a weight block's length, 32 or 256 (the K-quants); 0 for float weights, which meet x
    as it is."""
    elems = BLOCK_LAYOUT[qtype][0]
    return 0 if elems == 1 else elems


def round_activations(rows: torch.Tensor, block: int) -> torch.Tensor:
    """``rows`` as the int8 path sees them: per ``block`` elements ``d * round(x / d)``, ``d = max|x| / 127``
    (the compiled ``gguf_quantize_x``'s rounding, half to even). ``block`` 0 returns ``rows``."""
    if block == 0:
        return rows
    x = rows.float().reshape(rows.shape[0], -1, block)
    d = x.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(x * inv).clamp_(-127, 127)
    # A non-finite activation stays visible as NaN in the output (a faulty row), as in the kernel.
    d = torch.where(torch.isfinite(x).all(dim=-1, keepdim=True), d, torch.full_like(d, float("nan")))
    return (d * q).reshape(rows.shape).to(rows.dtype)


def use_int8_activations(methods: list[Any]) -> int:
    """Make each stored projection in ``methods`` (``GGUFMethod`` / ``GGUFShardedMethod``) multiply with
    int8-rounded activations; returns how many projections changed."""
    changed = 0
    for method in methods:
        parts = [m for _, m in method.parts] if isinstance(method, GGUFShardedMethod) else [method]
        for part in parts:
            if isinstance(part, GGUFMethod) and activation_block(part.qtype):
                part.int8_x = method.int8_x = True
                part.kernel_max_rows = INT8_KERNEL_MAX_ROWS
                changed += 1
    return changed
