"""Native CPU kernels that multiply by GGUF weights straight from their quantized blocks.

Compiled from ``runtime/cpu/csrc/gguf_linear.cpp`` (AVX2 + FMA + F16C where the CPU has them, plain
C++ elsewhere), built on first use and cached under ``$SERVELM_CACHE/torch_extensions``
(``runtime.cpu.extension``):

* ``linear``: ``out = x W^T (+ bias)`` with float32 activations and ``W`` the tensor's raw block rows,
  the same values as ``F.linear(x, registry.dequantize(W), bias)`` up to float32 summation order,
  without ever holding a float copy of ``W``; a decode step reads 4-8x fewer bytes than a float32
  projection;
* ``linear_parts``: a fused projection (q/k/v, gate/up) whose parts are separate weights, possibly of
  different formats, in one call and one parallel region;
* ``get_rows``: an embedding lookup, decoding only the rows asked for.

``load()`` is None where the extension cannot be built or fails its self-check, and callers then
keep ``projection.GGUFMethod``; ``SERVELM_DISABLE_GGUF_KERNELS=1`` forces that.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from servelm.runtime.cpu.extension import CompiledExtension
from servelm.runtime.gguf.registry import BLOCK_LAYOUT, dequantize

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "gguf_linear.cpp"
DISABLE_ENV = "SERVELM_DISABLE_GGUF_KERNELS"

KERNEL_TYPES: frozenset[Q] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
# Byte offsets of each quantized format's float16 scales, which random bytes must keep small and finite.
SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_blocks(qtype: Q, rows: int, in_features: int, generator: np.random.Generator) -> torch.Tensor:
    """Random valid ``qtype`` block rows ``[rows, row_bytes]``: random quants, small finite scales."""
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    n_blocks = rows * in_features // block_elems
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = generator.standard_normal(rows * in_features, dtype=np.float32)
        if qtype == Q.F32:
            raw = values.view(np.uint8)
        elif qtype == Q.F16:
            raw = values.astype(np.float16).view(np.uint8)
        else:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = generator.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
        for offset in SCALE_OFFSETS[qtype]:
            scales = (generator.standard_normal(n_blocks, dtype=np.float32) * 0.01).astype(np.float16)
            raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1))


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: Q, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on the registry's float32 dequantization: the values ``linear`` must reproduce."""
    rows, in_features = blocks.shape[0], x.shape[-1]
    weight = dequantize((blocks.reshape(-1), qtype, (rows, in_features)))
    return F.linear(x, weight, bias)


def _self_check(module: ModuleType) -> str | None:
    gen = np.random.default_rng(0)
    tgen = torch.Generator().manual_seed(0)
    for qtype in sorted(KERNEL_TYPES):
        k = 2 * BLOCK_LAYOUT[qtype][0] if BLOCK_LAYOUT[qtype][0] > 1 else 40
        k = max(k, 64) if qtype in (Q.F32, Q.F16, Q.BF16) else k
        blocks = random_blocks(qtype, 13, k, gen)
        for rows, bias in ((1, False), (3, True), (11, True)):
            x = torch.randn(rows, k, generator=tgen)
            b = torch.randn(13, generator=tgen) if bias else None
            out = torch.empty(rows, 13)
            module.gguf_linear(x, blocks, int(qtype), out, b)
            want = reference_linear(x, blocks, qtype, b)
            if not torch.allclose(out, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-6):
                return f"gguf_linear self-check failed ({qtype.name}, rows {rows}, K {k}, bias {bias})"
            if qtype not in (Q.F32, Q.F16, Q.BF16):  # int8 activations: W times x as the kernel rounds it
                block = 256 if BLOCK_LAYOUT[qtype][0] == 256 else 32
                d, q = module.gguf_quantize_x(x, block)
                want = reference_linear(d.repeat_interleave(block, dim=1) * q.float(), blocks, qtype, b)
                module.gguf_linear(x, blocks, int(qtype), out, b, True)
                if not torch.allclose(out, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-6):
                    return f"gguf_linear int8 self-check failed ({qtype.name}, rows {rows}, K {k}, bias {bias})"
        ids = torch.tensor([12, 0, 5, 5])
        want_rows = dequantize((blocks.reshape(-1), qtype, (13, k)))[ids]
        if not torch.equal(module.gguf_get_rows(blocks, ids, int(qtype), k), want_rows):
            return f"gguf_get_rows self-check failed ({qtype.name})"
    return None


_extension = CompiledExtension("GGUF block kernels", "servelm_gguf_linear", lambda: SOURCE, _self_check, log)


def load() -> ModuleType | None:
    """The compiled module (``gguf_linear``, ``gguf_get_rows``), or None. Never raises."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    return _extension.get()


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError(f"the GGUF block kernels are unavailable (disabled by {DISABLE_ENV} or not built)")
    return module


def linear(
    x: torch.Tensor,
    blocks2d: torch.Tensor,
    qtype: Q,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    int8_x: bool = False,
) -> torch.Tensor:
    """``out[:] = x W^T (+ bias)``: x float32 ``[M, K]``, ``blocks2d`` uint8 ``[N, row_bytes]`` (may be a
    read-only map), ``out`` float32 ``[M, N]`` with unit column stride (a column slice is fine). Returns out.
    ``int8_x``: x rounded to int8 per block first and integer dot products (llama.cpp's arithmetic)."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    _module().gguf_linear(x, blocks2d, int(qtype), out, bias, int8_x)
    return out


def linear_parts(
    x: torch.Tensor,
    blocks_list: list[torch.Tensor],
    qtypes: list[Q],
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    int8_x: bool = False,
) -> torch.Tensor:
    """A fused projection whose parts are separate weights (``blocks_list[i]`` ``[N_i, row_bytes_i]`` of
    ``qtypes[i]``): ``out[:, N_0 + ... + N_{i-1} :][:, :N_i] = x W_i^T``, plus ``bias`` ``[sum N_i]``, all
    parts' rows split over the threads in one parallel region. Returns out."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    _module().gguf_linear_parts(x, list(blocks_list), [int(q) for q in qtypes], out, bias, int8_x)
    return out


def get_rows(blocks2d: torch.Tensor, ids: torch.Tensor, qtype: Q, in_features: int) -> torch.Tensor:
    """Rows ``ids`` of the ``[N, in_features]`` weight held in ``blocks2d``, as float32 ``[len(ids), in_features]``."""
    return _module().gguf_get_rows(blocks2d, ids.reshape(-1).long(), int(qtype), int(in_features))
