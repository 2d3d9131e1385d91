"""GGUF's block formats decode in torch exactly as gguf-py (llama.cpp's Python reference) decodes
them, and a GGUF file's tensors read as zero-copy views of its memory map (issue 22)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf

from servelm.runtime.gguf import quants, registry
from servelm.runtime.gguf.reader import GGUFTensor, read_gguf_tensors
from servelm.runtime.gguf.registry import BLOCK_LAYOUT, SUPPORTED, dequantize

FORMATS = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_FORMATS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of each block's float16 scales, which random bytes must not make inf or NaN.
SCALE_OFFSETS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip
DEQUANTIZERS = {
    Q.F32: quants.dequantize_f32, Q.F16: quants.dequantize_f16, Q.BF16: quants.dequantize_bf16,
    Q.Q4_0: quants.dequantize_q4_0, Q.Q4_1: quants.dequantize_q4_1, Q.Q5_0: quants.dequantize_q5_0,
    Q.Q5_1: quants.dequantize_q5_1, Q.Q8_0: quants.dequantize_q8_0,
}  # fmt: skip


def _weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random weights whose rows span several orders of magnitude, as real layers' rows do."""
    rng = np.random.default_rng(seed)
    scale = np.logspace(-3, 1, shape[0], dtype=np.float32).reshape(-1, *([1] * (len(shape) - 1)))
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


def _raw_bytes(data: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf-py's encoding of ``data`` as uint8 rows (it returns F16 and F32 typed, the rest as bytes)."""
    encoded = np.ascontiguousarray(gguf.quants.quantize(data, qtype))
    return encoded.view(np.uint8).reshape(data.shape[0], -1)


def _random_blocks(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes in ``qtype`` blocks (every bit pattern of the quants), with finite float16 scales."""
    rng = np.random.default_rng(seed)
    _, block_bytes = BLOCK_LAYOUT[qtype]
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        # NaN payloads are outside the contract: converters may quiet signalling NaNs differently.
        floats = rng.standard_normal(n_blocks, dtype=np.float32) * 10 ** rng.uniform(-8, 4, n_blocks).astype(np.float32)
        dtype = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.float32}[qtype]
        encoded = floats.astype(dtype).view(np.uint8).reshape(n_blocks, -1)
        return encoded[:, 2:].copy() if qtype == Q.BF16 else encoded  # bf16 = float32's upper half
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(n_blocks, dtype=np.float32) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def _assert_bitwise_equal(ours: torch.Tensor, reference: np.ndarray) -> None:
    expected = torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32))
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    # Bit patterns, so that -0.0 against 0.0 would count as a difference too.
    mismatched = (ours.view(torch.int32) != expected.view(torch.int32)).sum().item()
    assert mismatched == 0, f"{mismatched} of {ours.numel()} values differ"


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_quantized_weights_decode_as_gguf_py_decodes_them(qtype: Q) -> None:
    data = _weights((16, 256), seed=int(qtype))
    raw = _raw_bytes(data, qtype)
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    ours = DEQUANTIZERS[qtype](torch.from_numpy(raw).reshape(-1, block_bytes))
    assert ours.shape == (data.size // block_elems, block_elems)
    _assert_bitwise_equal(ours.reshape(data.shape), gguf.quants.dequantize(raw, qtype))
    # And the format is what it says: close to the weights it encodes.
    rel = np.abs(ours.reshape(data.shape).numpy() - data).max(axis=1) / np.abs(data).max(axis=1)
    assert rel.max() < 0.2


@pytest.mark.parametrize("qtype", FORMATS + K_FORMATS, ids=lambda q: q.name)
def test_random_blocks_decode_as_gguf_py_decodes_them(qtype: Q) -> None:
    if qtype in K_FORMATS:
        pytest.importorskip("servelm.runtime.gguf.kquants")
    blocks = _random_blocks(qtype, n_blocks=512, seed=100 + int(qtype))
    ours = dequantize((torch.from_numpy(blocks), qtype, (blocks.shape[0] * BLOCK_LAYOUT[qtype][0],)))
    _assert_bitwise_equal(ours, gguf.quants.dequantize(blocks, qtype).reshape(-1))


def test_the_registry_names_what_it_cannot_decode() -> None:
    assert set(FORMATS + K_FORMATS) == set(SUPPORTED)
    assert BLOCK_LAYOUT[Q.Q8_0] == (32, 34) and BLOCK_LAYOUT[Q.Q6_K] == (256, 210)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        registry.dequantizer(Q.IQ2_XXS)
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize((torch.zeros(84, dtype=torch.uint8), Q.Q2_K, (256,)))
    with pytest.raises(ValueError, match="Q8_0 tensor of shape"):
        dequantize((torch.zeros(33, dtype=torch.uint8), Q.Q8_0, (32,)))
    with pytest.raises(ValueError, match="uint8 blocks"):
        quants.dequantize_q4_0(torch.zeros(3, 17, dtype=torch.uint8))


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory mapped from ``path`` (Linux's /proc/self/maps)."""
    ranges = []
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def test_a_gguf_file_reads_as_zero_copy_blocks_of_every_format(tmp_path: Path) -> None:
    weights: dict[str, tuple[np.ndarray, Q]] = {}
    for i, qtype in enumerate(FORMATS):
        weights[f"blk.{i}.{qtype.name.lower()}.weight"] = (_weights((24, 96), seed=i), qtype)
    weights["output_norm.weight"] = (np.linspace(0.5, 1.5, 96, dtype=np.float32), Q.F32)  # one dimension
    encoded = {name: (gguf.quants.quantize(data, qtype), qtype) for name, (data, qtype) in weights.items()}
    path = tmp_path / "tiny.gguf"
    write_gguf(path, encoded)

    tensors = read_gguf_tensors(path)

    assert list(tensors) == list(weights)
    mapped = _file_mappings(path)
    assert mapped, "the file is not memory-mapped"
    for name, (data, qtype) in weights.items():
        t = tensors[name]
        assert isinstance(t, GGUFTensor) and t.name == name and t.qtype == qtype
        assert t.shape == data.shape and t.numel == data.size  # [out, in], not GGUF's [ne0, ne1]
        block_elems, block_bytes = BLOCK_LAYOUT[qtype]
        assert t.raw.dtype == torch.uint8 and t.raw.shape == (data.size // block_elems, block_bytes)
        start, end = t.raw.data_ptr(), t.raw.data_ptr() + t.raw.numel()
        assert any(lo <= start and end <= hi for lo, hi in mapped), f"{name} was copied out of the map"
        raw = np.ascontiguousarray(encoded[name][0]).view(np.uint8).reshape(data.shape[0], -1)
        _assert_bitwise_equal(dequantize(t), gguf.quants.dequantize(raw, qtype).reshape(data.shape))


def test_dequantize_timings_for_the_record() -> None:
    data = _weights((576, 1536), seed=7)
    threads = torch.get_num_threads()
    try:
        # One thread too: torch's threads wait on each other at every op when the cores are shared.
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            for qtype in (Q.Q8_0, Q.Q4_0):
                raw = torch.from_numpy(_raw_bytes(data, qtype))
                dequantize((raw, qtype, data.shape))  # warm-up
                runs = []
                for _ in range(9):
                    start = time.perf_counter()
                    dequantize((raw, qtype, data.shape))
                    runs.append(time.perf_counter() - start)
                median_ms = statistics.median(runs) * 1e3
                print(f"dequantize {qtype.name} 576x1536: median {median_ms:.2f} ms of 9, {n_threads} thread(s)")
    finally:
        torch.set_num_threads(threads)
