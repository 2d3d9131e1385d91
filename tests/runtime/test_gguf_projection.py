"""``GGUFMethod`` multiplies by a GGUF weight kept in its own blocks as ``F.linear`` multiplies by
gguf-py's dequantization of it, for every supported format, one bounded tile of rows at a time and
without holding a float copy of the weight (issue 22).

What is asserted: with one tile covering the weight, the output equals ``F.linear`` on gguf-py's
float32 weight bit for bit (same values, same single call); with several tiles, every element lies
within ``1e-5 * (|x| @ |W|^T + |b|)`` of it, a float32 summation-order bound (K = 256 terms).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf_files import median_seconds, write_gguf

from servelm.runtime.cpu.gguf_kernels import DISABLE_ENV
from servelm.runtime.gguf.projection import GGUFMethod, gguf_method, tile_rows_for
from servelm.runtime.gguf.reader import GGUFTensor, read_gguf_tensors
from servelm.runtime.gguf.registry import BLOCK_LAYOUT, SUPPORTED


@pytest.fixture(autouse=True)
def _tile_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are the tile path's (what serves where the compiled kernels cannot be built, and
    every large step); the kernels are test_gguf_kernels'."""
    monkeypatch.setenv(DISABLE_ENV, "1")


OUT, IN = 96, 256  # in_features one K-quant super-block, eight 32-element blocks
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf-py cannot quantize these: random blocks stand in
# Byte offsets of each K-quant block's float16 scales, which random bytes must not make inf or NaN.
SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SUM_ORDER_RTOL = 1e-5  # ~84 float32 epsilons: loose for sqrt(256)-scale rounding, tight for any real bug


def weights(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random weights whose rows span several orders of magnitude, as real layers' rows do."""
    rng = np.random.default_rng(seed)
    scale = np.logspace(-3, 1, shape[0], dtype=np.float32)[:, None]
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


def random_k_blocks(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes in ``qtype`` super-blocks, with small finite float16 scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, BLOCK_LAYOUT[qtype][1]), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(n_blocks, dtype=np.float32) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def encoded_weight(qtype: Q, shape: tuple[int, int], seed: int) -> np.ndarray:
    """A ``shape`` weight in ``qtype``, as the array ``GGUFWriter.add_tensor`` takes for it."""
    if qtype in K_QUANTS:
        return random_k_blocks(qtype, shape[0] * shape[1] // gguf.QK_K, seed).reshape(shape[0], -1)
    return np.ascontiguousarray(gguf.quants.quantize(weights(shape, seed), qtype))


@pytest.fixture(scope="module")
def gguf_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[Q, GGUFTensor]:
    """One ``[OUT, IN]`` weight of every supported format, written to a GGUF file and mapped back."""
    path = tmp_path_factory.mktemp("gguf") / "projections.gguf"
    write_gguf(path, {f"w.{q.name}": (encoded_weight(q, (OUT, IN), seed=i), q) for i, q in enumerate(SUPPORTED)})
    tensors = read_gguf_tensors(path)
    return {q: tensors[f"w.{q.name}"] for q in SUPPORTED}


def reference_weight(tensor: GGUFTensor) -> torch.Tensor:
    """gguf-py's float32 dequantization of the tensor's blocks, ``[out, in]``."""
    values = gguf.quants.dequantize(tensor.raw.numpy(), tensor.qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tensor.shape)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_matches_f_linear_on_gguf_py_weights(qtype: Q, gguf_weights: dict[Q, GGUFTensor]) -> None:
    tensor = gguf_weights[qtype]
    assert tensor.shape == (OUT, IN)
    w = reference_weight(tensor)
    assert torch.isfinite(w).all()
    gen = torch.Generator().manual_seed(int(qtype))
    bias = torch.randn(OUT, generator=gen)
    whole, tiled = gguf_method(tensor), gguf_method(tensor, tile_rows=40)  # tiles of 40, 40, 16 rows
    assert whole.tile_rows >= OUT and tiled.tile_rows == 40
    for rows in (1, 3, 17):
        x = torch.randn(rows, IN, generator=gen)
        for b in (None, bias):
            expected = F.linear(x, w, b)
            got_whole = whole.apply(x, None, b)
            assert got_whole.dtype == torch.float32 and got_whole.shape == (rows, OUT)
            torch.testing.assert_close(got_whole, expected, atol=0, rtol=0)
            got_tiled = tiled.apply(x, None, b)
            magnitude = F.linear(x.abs(), w.abs(), None if b is None else b.abs())
            error = (got_tiled - expected).abs()
            assert bool((error <= SUM_ORDER_RTOL * magnitude).all()), (
                f"{qtype.name} rows={rows} bias={b is not None}: worst relative error "
                f"{(error / magnitude.clamp_min(1e-30)).max().item():.3g}"
            )


def test_leading_dimensions_and_lower_precision_inputs(gguf_weights: dict[Q, GGUFTensor]) -> None:
    tensor = gguf_weights[Q.Q4_K]
    method = gguf_method(tensor, tile_rows=32)
    w = reference_weight(tensor)
    x = torch.randn(2, 5, IN, generator=torch.Generator().manual_seed(1))
    got = method.apply(x, None, None)
    assert got.shape == (2, 5, OUT)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # A bfloat16 model multiplies its own dtype: the tile is rounded to bfloat16 as a dense copy would be.
    xb = x.bfloat16()
    got_bf16 = method.apply(xb, None, None)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16, F.linear(xb, w.bfloat16()), rtol=0.02, atol=0.02)


def test_a_linear_layer_serves_its_projection_through_the_method(gguf_weights: dict[Q, GGUFTensor]) -> None:
    from servelm.runtime.models.layers import Linear
    from servelm.runtime.projection import ProjectionMethod

    tensor = gguf_weights[Q.Q6_K]
    linear = Linear(IN, OUT, bias=True, dtype=torch.float32, device=torch.device("cpu"))
    linear.weight = None  # the blocks are the weight: no dense parameter stays behind
    with torch.no_grad():
        linear.bias.copy_(torch.linspace(-1, 1, OUT))
    method: ProjectionMethod = gguf_method(tensor)
    linear.method = method
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(linear(x), F.linear(x, reference_weight(tensor), linear.bias), atol=0, rtol=0)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_holds_the_mapped_blocks_and_no_float_copy(qtype: Q, gguf_weights: dict[Q, GGUFTensor]) -> None:
    tensor = gguf_weights[qtype]
    method = gguf_method(tensor)
    assert method.name == f"gguf-{qtype.name}"
    held = [v for v in vars(method).values() if isinstance(v, torch.Tensor)]
    raw_bytes = tensor.raw.numel() * tensor.raw.element_size()
    assert sum(t.numel() * t.element_size() for t in held) == raw_bytes
    assert all(t.dtype == torch.uint8 for t in held)
    # The very bytes of the file's memory map, not a copy of them.
    assert method.blocks.data_ptr() == tensor.raw.data_ptr()
    assert method.blocks.untyped_storage().data_ptr() == tensor.raw.untyped_storage().data_ptr()


class RecordingDequantizer:
    """The registry's dequantizer for a format, recording the float32 bytes of each tile it returns."""

    def __init__(self, decode: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.decode = decode
        self.tile_bytes: list[int] = []

    def __call__(self, blocks: torch.Tensor) -> torch.Tensor:
        values = self.decode(blocks)
        self.tile_bytes.append(values.numel() * values.element_size())
        return values


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_tiles_bound_the_float_working_set(qtype: Q, tmp_path: Path) -> None:
    out, tile_rows = 960, 64
    path = tmp_path / "tall.gguf"
    write_gguf(path, {"w": (encoded_weight(qtype, (out, IN), seed=5), qtype)})
    tensor = read_gguf_tensors(path)["w"]
    method = gguf_method(tensor, tile_rows=tile_rows)
    recorder = RecordingDequantizer(method.decode)
    method.decode = recorder
    x = torch.randn(3, IN)
    torch.testing.assert_close(method.apply(x, None, None), F.linear(x, reference_weight(tensor)), rtol=1e-5, atol=1e-5)
    # Every decoded tile is at most tile_rows x in x 4 bytes, and together they are the weight once.
    assert len(recorder.tile_bytes) == -(-out // tile_rows)
    assert max(recorder.tile_bytes) <= tile_rows * IN * 4
    assert sum(recorder.tile_bytes) == out * IN * 4


def peak_temporary_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """The most bytes torch's CPU allocator held at once during ``fn``, less what ``fn`` returns."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = getattr(getattr(prof.profiler, "kineto_results", None), "events", None)
    if events is None:
        pytest.skip("this torch's profiler does not expose allocation events")
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in allocations:
        held += nbytes
        peak = max(peak, held)
    return peak - result.numel() * result.element_size()


def test_peak_memory_does_not_grow_with_out_features(tmp_path: Path) -> None:
    tile_rows = 64
    path = tmp_path / "sizes.gguf"
    write_gguf(path, {f"w{out}": (encoded_weight(Q.Q4_K, (out, IN), seed=out), Q.Q4_K) for out in (128, 1280)})
    tensors = read_gguf_tensors(path)
    x = torch.randn(3, IN)
    peaks = {}
    for out in (128, 1280):
        method = gguf_method(tensors[f"w{out}"], tile_rows=tile_rows)
        method.apply(x, None, None)  # warm-up: first calls allocate one-off buffers
        peaks[out] = peak_temporary_bytes(lambda: method.apply(x, None, None))
    tile = tile_rows * IN * 4
    print(
        f"\npeak temporaries over one apply, Q4_K tiles of {tile_rows}x{IN} ({tile} B float): "
        + ", ".join(f"{out} rows {p} B ({p / tile:.2f} tiles)" for out, p in peaks.items())
    )
    # Ten times the rows, the same peak: the dequantizer's temporaries are per tile, freed before the next.
    assert peaks[1280] <= peaks[128] + 4096
    assert peaks[1280] <= 8 * tile  # the float tile plus the dequantizer's unpacked intermediates


def test_rejects_what_it_cannot_serve() -> None:
    q4k_row = torch.zeros(BLOCK_LAYOUT[Q.Q4_K][1], dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple"):
        GGUFMethod(torch.zeros(2 * 144, dtype=torch.uint8), Q.Q4_K, (2, 128))  # half a super-block a row
    with pytest.raises(ValueError, match="bytes"):
        GGUFMethod(q4k_row, Q.Q4_K, (2, 256))  # one row's blocks for two rows
    with pytest.raises(ValueError, match="no dequantizer"):
        GGUFMethod(torch.zeros(84, dtype=torch.uint8), Q.Q2_K, (1, 256))
    method = GGUFMethod(q4k_row, Q.Q4_K, (1, 256))
    with pytest.raises(ValueError, match="features"):
        method.apply(torch.zeros(1, 255), None, None)
    assert tile_rows_for(2048) == 256 and tile_rows_for(1 << 20) >= 1


# --- timing, for the record (run with -s to see it) ---


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_timing_one_decode_row_2048x2048(qtype: Q, tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    write_gguf(path, {"w": (encoded_weight(qtype, (2048, 2048), seed=9), qtype)})
    tensor = read_gguf_tensors(path)["w"]
    dense = reference_weight(tensor)
    x = torch.randn(1, 2048)
    lines = [f"\n1x2048 @ {qtype.name} 2048x2048 (medians):"]
    threads = torch.get_num_threads()
    try:
        # One thread too: torch's threads wait on each other at every op when the cores are shared.
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            dense_ms = median_seconds(lambda: F.linear(x, dense), 31) * 1e3
            lines.append(f"  {n_threads} thread(s): dense float32 F.linear {dense_ms:.3f} ms")
            for tile_rows in (None, 128, 1024):
                method = gguf_method(tensor, tile_rows=tile_rows)
                ms = median_seconds(lambda: method.apply(x, None, None), 15) * 1e3
                lines.append(f"  {n_threads} thread(s): {method.name}, tiles of {method.tile_rows} rows {ms:.3f} ms")
    finally:
        torch.set_num_threads(threads)
    print("\n".join(lines))
