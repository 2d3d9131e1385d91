"""The torch K-quant dequantizers against gguf-py's reference, bit for bit.

gguf-py cannot quantize K-quants (its ``quantize`` raises NotImplementedError for
them), so realistic blocks are packed here by a small round-to-nearest quantizer
written from the block layout; random raw blocks and edge cases cover every bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_files import median_seconds, write_gguf

from servelm.runtime.gguf.kquants import (
    Q4_K_BLOCK_BYTES,
    Q5_K_BLOCK_BYTES,
    Q6_K_BLOCK_BYTES,
    QK_K,
    dequantize_q4_k,
    dequantize_q5_k,
    dequantize_q6_k,
)

Dequantizer = Callable[[torch.Tensor], torch.Tensor]

FORMATS: dict[QType, Dequantizer] = {
    QType.Q4_K: dequantize_q4_k,
    QType.Q5_K: dequantize_q5_k,
    QType.Q6_K: dequantize_q6_k,
}
# Byte offsets of each format's fp16 fields (d, and dmin where there is one).
FP16_FIELDS = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


def block_bytes(qtype: QType) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][1]


def assert_bitwise_equal(qtype: QType, raw: np.ndarray) -> None:
    """Our dequantization of ``raw`` has exactly the reference's float32 bit patterns."""
    expected = gguf.quants.dequantize(raw, qtype).reshape(-1, QK_K)
    got = FORMATS[qtype](torch.from_numpy(raw))
    assert got.dtype == torch.float32
    assert got.shape == (raw.shape[0], QK_K)
    # Bit patterns, not values: == would let -0.0 stand for 0.0.
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


def random_finite_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random fp16 bit patterns over the whole finite range (subnormals, ±0, 65504), as bytes."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    exponent_all_ones = (bits & 0x7C00) == 0x7C00
    bits[exponent_all_ones] &= 0xFBFF  # clear one exponent bit: inf/NaN become large finite values
    return bits.view(np.uint8).reshape(n, 2)


def random_blocks(qtype: QType, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, block_bytes(qtype)), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = random_finite_fp16(rng, n)
    return raw


def test_block_sizes_match_gguf() -> None:
    assert gguf.QK_K == QK_K
    assert block_bytes(QType.Q4_K) == Q4_K_BLOCK_BYTES
    assert block_bytes(QType.Q5_K) == Q5_K_BLOCK_BYTES
    assert block_bytes(QType.Q6_K) == Q6_K_BLOCK_BYTES
    for qtype in FORMATS:
        assert gguf.GGML_QUANT_SIZES[qtype][0] == QK_K


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_random_raw_blocks_match_reference_bitwise(qtype: QType) -> None:
    assert_bitwise_equal(qtype, random_blocks(qtype, 600, seed=int(qtype)))


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_edge_case_blocks_match_reference_bitwise(qtype: QType) -> None:
    size = block_bytes(qtype)
    fields = FP16_FIELDS[qtype]
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    max_half = np.array([65504.0], dtype=np.float16).view(np.uint8)
    neg_tiny = np.array([-(2.0**-24)], dtype=np.float16).view(np.uint8)
    cases = []
    for scale_bytes in (one, max_half, neg_tiny):
        for fill in (0x00, 0xFF, 0x55, 0xAA):
            block = np.full(size, fill, dtype=np.uint8)
            for offset in fields:
                block[offset : offset + 2] = scale_bytes
            cases.append(block)
    zero_scales = np.full(size, 0xFF, dtype=np.uint8)
    for offset in fields:
        zero_scales[offset : offset + 2] = 0
    cases.append(zero_scales)  # d = dmin = 0 with every quant and 6-bit scale at its maximum
    if qtype == QType.Q6_K:
        signed = np.full(size, 0xFF, dtype=np.uint8)
        signed[192:208] = np.array([-128, 127, -1, 0] * 4, dtype=np.int8).view(np.uint8)
        signed[208:210] = one
        cases.append(signed)  # int8 sub-block scales at both extremes
    raw = np.stack(cases)
    assert_bitwise_equal(qtype, raw)

    all_max = FORMATS[qtype](torch.from_numpy(raw[1:2]))  # d = dmin = 1, every byte 0xFF
    if qtype == QType.Q6_K:
        assert torch.all(all_max == -1.0 * 31)  # scale int8 -1, q = 63 - 32
    else:
        q_max = 15 if qtype == QType.Q4_K else 31
        assert torch.all(all_max == 63 * q_max - 63)  # 6-bit scale and min both 63


def test_non_contiguous_and_empty_inputs() -> None:
    raw = random_blocks(QType.Q4_K, 64, seed=7)
    strided = torch.from_numpy(raw)[::2]
    torch.testing.assert_close(dequantize_q4_k(strided), dequantize_q4_k(strided.contiguous()), atol=0, rtol=0)
    for qtype, fn in FORMATS.items():
        empty = fn(torch.empty(0, block_bytes(qtype), dtype=torch.uint8))
        assert empty.shape == (0, QK_K) and empty.dtype == torch.float32


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_rejects_wrong_shape_or_dtype(qtype: QType) -> None:
    fn = FORMATS[qtype]
    with pytest.raises(ValueError):
        fn(torch.zeros(4, block_bytes(qtype) + 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        fn(torch.zeros(4, block_bytes(qtype), dtype=torch.int8))
    with pytest.raises(ValueError):
        fn(torch.zeros(4 * block_bytes(qtype), dtype=torch.uint8))


# --- realistic blocks: a round-to-nearest K-quantizer written from the layout ---


def pack_q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Quantize float rows [n, 256] to Q4_K (bits=4) or Q5_K (bits=5) blocks."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    step = (sub.max(axis=2) - lo) / (2**bits - 1)
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = ((-lo).max(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-lo, dmin32, out=np.zeros_like(lo), where=dmin32 > 0)), 0, 63)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    unit = d32 * sc
    unit = unit[..., None]
    shifted = sub + (dmin32 * m)[..., None]
    q = np.rint(np.divide(shifted, unit, out=np.zeros_like(sub), where=unit > 0))
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint8)

    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)  # pairs of sub-blocks share bytes
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales]
    if bits == 5:
        high = (q >> 4).astype(np.uint8)  # [n, 8, 32]: bit j of qh[l] is sub-block j's
        bit = np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(np.bitwise_or.reduce(high << bit, axis=1))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def pack_q6_k(x: np.ndarray) -> np.ndarray:
    """Quantize float rows [n, 256] to Q6_K blocks."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    unit = np.abs(sub).max(axis=2) / 31
    d = (unit.max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    # Rounding scales up keeps every value inside its sub-block's 6-bit range (no clipping).
    sc = np.clip(np.ceil(np.divide(unit, d32, out=np.zeros_like(unit), where=d32 > 0)), 0, 127)
    unit_q = d32 * sc
    unit_q = unit_q[..., None]
    q = np.rint(np.divide(sub, unit_q, out=np.zeros_like(sub), where=unit_q > 0))
    # [n, halves of 128, groups of 32, 32]
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    low = q & 0x0F
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    shift = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce((q >> 4) << shift, axis=2)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(n, 2)],
        axis=1,
    )


PACKERS: dict[QType, tuple[Callable[[np.ndarray], np.ndarray], float]] = {
    # Relative RMS error each round-to-nearest packing must stay under on Gaussian data.
    QType.Q4_K: (lambda x: pack_q45_k(x, 4), 0.12),
    QType.Q5_K: (lambda x: pack_q45_k(x, 5), 0.06),
    QType.Q6_K: (pack_q6_k, 0.035),
}


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_quantized_float_data_round_trips_and_matches_reference(qtype: QType) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    row_scale = rng.uniform(0.01, 3.0, (384, 1)).astype(np.float32)
    x = rng.standard_normal((384, QK_K)).astype(np.float32) * row_scale
    x[:8] = np.abs(x[:8])  # sub-blocks with no negative values: zero mins
    x[8:10] = 0.0  # all-zero blocks: zero scales
    pack, tolerance = PACKERS[qtype]
    raw = pack(x)
    assert raw.shape == (384, block_bytes(qtype))
    assert_bitwise_equal(qtype, raw)
    got = FORMATS[qtype](torch.from_numpy(raw)).numpy()
    error = np.sqrt(np.mean((got - x) ** 2, axis=1))
    scale = np.sqrt(np.mean(x**2, axis=1))
    assert np.all(error[10:] <= tolerance * scale[10:])
    assert np.all(got[8:10] == 0.0)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_registry_dequantizes_k_quant_tensors(qtype: QType) -> None:
    from servelm.runtime.gguf import registry

    assert registry.dequantizer(qtype) is FORMATS[qtype]
    raw = random_blocks(qtype, 2 * 6, seed=11)  # a [6, 512] weight: two super-blocks a row
    got = registry.dequantize((torch.from_numpy(raw).reshape(-1), qtype, (6, 512)))
    expected = gguf.quants.dequantize(raw, qtype).reshape(6, 512)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


# --- a real Gemma 3 270M Q4_K_M file, when its package is installed ---


def k_quant_tensors_in_file(path: Path, tensors: dict | None = None) -> set[QType]:
    """Check every K-quant tensor of a GGUF file, as the reader maps it, against the reference."""
    from servelm.runtime.gguf.reader import read_gguf_tensors
    from servelm.runtime.gguf.registry import dequantize

    seen: set[QType] = set()
    for tensor in (tensors if tensors is not None else read_gguf_tensors(path)).values():
        if tensor.qtype not in FORMATS:
            continue
        expected = gguf.quants.dequantize(tensor.raw.numpy(), tensor.qtype).reshape(-1, QK_K)
        got = FORMATS[tensor.qtype](tensor.raw)
        np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
        assert dequantize(tensor).shape == tensor.shape
        seen.add(tensor.qtype)
    return seen


def test_k_quant_tensors_read_from_a_written_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "k_quants.gguf"
    # Each a [4, 768] weight, as [4, 3 blocks' bytes] rows.
    write_gguf(
        path, {f"w.{q.name}": (random_blocks(q, 4 * 3, seed=20 + i).reshape(4, -1), q) for i, q in enumerate(FORMATS)}
    )
    assert k_quant_tensors_in_file(path) == set(FORMATS)


def test_real_gemma_q4_k_m_tensors_match_reference(gemma3_gguf: Path) -> None:
    # The file `make model` prepares (servelm.runtime.model_fetch), mapped from the served folder's
    # tensor table: GGUFReader would parse its 262k-token vocabulary again first.
    import json

    from servelm.runtime.gguf.reader import read_indexed_tensors
    from servelm.runtime.model_files import resolve_model_path

    index = json.loads((resolve_model_path(str(gemma3_gguf)) / "gguf.json").read_text())["tensors"]
    tensors = read_indexed_tensors(gemma3_gguf, index)
    assert {QType.Q4_K, QType.Q6_K} <= k_quant_tensors_in_file(gemma3_gguf, tensors)


# --- timing, for the record (run with -s to see it) ---


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_timing_640x2048_weight(qtype: QType) -> None:
    n_blocks = 640 * 2048 // QK_K
    # Packed Gaussian weights, not random bits: random fp16 scales reach float32 subnormals,
    # whose slow arithmetic real checkpoints never hit.
    weights = np.random.default_rng(3).standard_normal((n_blocks, QK_K)).astype(np.float32) * 0.02
    raw = PACKERS[qtype][0](weights)
    blocks = torch.from_numpy(raw)
    ours = median_seconds(lambda: FORMATS[qtype](blocks), runs=15)
    reference = median_seconds(lambda: gguf.quants.dequantize(raw, qtype), runs=3)
    print(
        f"\n{qtype.name} 640x2048 ({n_blocks} blocks, {torch.get_num_threads()} threads): "
        f"torch {ours * 1e3:.2f} ms, gguf-py numpy {reference * 1e3:.2f} ms (medians)"
    )
