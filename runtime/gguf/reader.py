"""A GGUF file's tensors as raw blocks, memory-mapped and never copied.

``gguf.GGUFReader`` maps the file read-only; each tensor here is a uint8 torch view of its bytes,
``[n_blocks, block_bytes]``, so the OS pages weights in on use and shares them between processes.
Parsing a file's metadata costs seconds (tens of thousands of token strings), so ``tensor_index``
gives the tensor table as plain values, to keep beside the model, and ``read_indexed_tensors`` maps
the file from that table alone.
GGUF lists a tensor's dimensions innermost first (``ne0`` = input features); ``GGUFTensor.shape`` is
the reverse, the ``[out_features, in_features]`` order of Hugging Face and ``nn.Linear``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader


@dataclass(frozen=True, eq=False)  # identity equality: comparing tensors elementwise has no single truth
class GGUFTensor:
    """One tensor of a GGUF file: its name, its block format, its logical shape and its raw blocks.

    ``raw`` is a read-only view of the file's memory map (writing to it faults); it keeps the map
    alive for as long as it is referenced.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical, outermost first: [out_features, in_features] for a projection
    raw: torch.Tensor  # uint8 [n_blocks, block_bytes]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def read_gguf_tensors(path: str | PathLike[str]) -> dict[str, GGUFTensor]:
    """Every tensor of the GGUF file at ``path``, by name, in file order, as zero-copy views."""
    reader = GGUFReader(path, "r")
    if reader.byte_order != "I":
        # Block bytes are decoded as little-endian; a byte-swapped file would decode to garbage.
        raise ValueError(f"{path}: GGUF file of the other byte order is not supported")
    return {t.name: _tensor(t.name, t.tensor_type, t.shape, t.data) for t in reader.tensors}


def tensor_index(path: str | PathLike[str] | GGUFReader) -> list[list[Any]]:
    """The file's tensor table, JSON-ready: ``[name, format, dims innermost first, byte offset]``."""
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path, "r")
    if reader.byte_order != "I":
        raise ValueError(f"{path}: GGUF file of the other byte order is not supported")
    return [[t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset)] for t in reader.tensors]


def read_indexed_tensors(path: str | PathLike[str], index: list[list[Any]]) -> dict[str, GGUFTensor]:
    """``read_gguf_tensors`` from a table ``tensor_index`` made: one memory map, no metadata parsing."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, GGUFTensor] = {}
    for name, qtype_value, dims, offset in index:
        qtype = GGMLQuantizationType(qtype_value)
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims, dtype=np.int64))
        nbytes = n_elems // block_elems * block_bytes
        if offset + nbytes > data.shape[0]:
            raise ValueError(f"{path}: tensor {name} ends past the end of the file (changed since it was indexed?)")
        tensors[name] = _tensor(name, qtype, np.array(dims), data[offset : offset + nbytes])
    return tensors


def _tensor(name: str, qtype: GGMLQuantizationType, dims: np.ndarray, data: np.ndarray) -> GGUFTensor:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(d) for d in reversed(dims.tolist()))
    n_elems = int(np.prod(shape, dtype=np.int64))
    if n_elems % block_elems:
        raise ValueError(f"{name}: {n_elems} elements is not a whole number of {qtype.name} blocks")
    # gguf-py types float tensors' data (float16, float32...) and quantized ones as uint8 rows;
    # reshape and view of a contiguous array are views either way.
    blocks = data.reshape(-1).view(np.uint8).reshape(n_elems // block_elems, block_bytes)
    with warnings.catch_warnings():
        # torch warns that the array is not writable: the map is read-only on purpose.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(blocks)
    return GGUFTensor(name=name, qtype=qtype, shape=shape, raw=raw)
