"""The int8-activation path of the GGUF kernels (``--gguf-activations int8``, llama.cpp's arithmetic).

What is asserted: the compiled rounding of x (``gguf_quantize_x``) equals the torch statement of it
(``projection.round_activations``: ``d = max|x| / 127`` per block, ``round(x / d)`` half to even); for
every quantized format and 1 to 33 rows, ``linear(..., int8_x=True)`` equals ``F.linear(x', W)`` with
``W`` gguf-py's own dequantization and ``x'`` the rounded x, within the float32 summation bound (so
the integer dot products lose nothing beyond the rounding of x), through the AVX2 tiles, the packed
tiles of 8 rows a vector and, on CPUs with AVX-512 VNNI, of 16; fused parts of mixed formats do the
same; a row with a non-finite activation comes out NaN without touching the others; and a
``GGUFMethod`` gives the same ``W x'`` through the kernel (few rows) and the tile path (many rows).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from servelm.runtime.cpu import gguf_kernels as kernels
from servelm.runtime.cpu.extension import cpu_flags
from servelm.runtime.gguf.projection import (
    INT8_KERNEL_MAX_ROWS,
    GGUFMethod,
    activation_block,
    round_activations,
    use_int8_activations,
)
from servelm.runtime.gguf.registry import BLOCK_LAYOUT

QUANTIZED = sorted(kernels.KERNEL_TYPES - {Q.F32, Q.F16, Q.BF16})
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUM_ORDER_RTOL = 1e-5


def weight(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    """``[n, row_bytes]`` blocks: gguf-py's quantization of rows of several magnitudes (random blocks
    for the K-quants, which gguf-py cannot quantize)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return kernels.random_blocks(qtype, n, k, rng)
    values = rng.standard_normal((n, k), dtype=np.float32) * np.logspace(-3, 1, n, dtype=np.float32)[:, None]
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(values, qtype))).reshape(n, -1)


def gguf_dequantized(blocks: torch.Tensor, qtype: Q, k: int) -> torch.Tensor:
    """gguf-py's own dequantization of ``blocks`` (the reference the kernels answer to)."""
    return torch.from_numpy(
        gguf.quants.dequantize(blocks.numpy(), qtype).reshape(blocks.shape[0], k).astype(np.float32)
    )


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with outliers, as hidden states have: they set each block's scale."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, ::37] *= 20.0
    return x


def assert_within_sum_order(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = F.linear(x.double(), w.double())
    bound = SUM_ORDER_RTOL * F.linear(x.abs().double(), w.abs().double())
    excess = float(((got.double() - want).abs() - bound).max())
    assert excess <= 1e-30, f"max excess over the summation bound {excess:.3g}"


@pytest.fixture(params=("tiles", "packed8", "vnni", "amx"))
def int8_path(request, module) -> str:
    """Steps of any number of rows through the few-row kernels and 8-row tiles, the AVX2 packed tiles (8
    rows a vector), where the CPU has AVX-512 VNNI the packed 16-row tiles, or where it has AMX the
    bfloat16 tiles, whatever their usual row thresholds."""
    if request.param == "vnni" and not module.vnni:
        pytest.skip("this CPU has no AVX-512 VNNI")
    if request.param == "amx" and not module.amx_available():
        pytest.skip("this CPU (or build, or kernel) has no AMX bfloat16 tiles")
    lanes = module.set_packed_lanes({"tiles": 0, "packed8": 8, "vnni": 16, "amx": 0}[request.param])
    rows = module.set_packed_min_rows(1 << 62 if request.param == "tiles" else 1)
    amx_rows = module.set_amx_min_rows(1 if request.param == "amx" else 1 << 62)
    yield request.param
    module.set_amx_min_rows(amx_rows)
    module.set_packed_min_rows(rows)
    module.set_packed_lanes(lanes)


def operands(path: str, x: torch.Tensor, w: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """What a path multiplies: x rounded to int8 per block and W as decoded, or on AMX both rounded to
    bfloat16 (their products are exact in float32, so the sum is as close as any float32 sum)."""
    if path == "amx":
        return x.bfloat16().float(), w.bfloat16().float()
    return round_activations(x, activation_block(qtype)), w


def test_vnni_tiles_are_built_where_the_cpu_has_them(module) -> None:
    flags = cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert module.vnni == {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}.issubset(flags)


@pytest.mark.parametrize("block", (32, 256))
def test_rounding_equals_the_torch_statement(module, block: int) -> None:
    x = activations(5, 512, seed=block)
    x[2, :block] = 0.0  # an all-zero block: scale 0, quants 0
    d, q = module.gguf_quantize_x(x, block)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    rounded = d.repeat_interleave(block, dim=1) * q.float()
    assert torch.equal(rounded, round_activations(x, block))
    assert torch.equal(module.gguf_round_x(x, block), rounded)
    assert torch.equal(rounded[2, :block], torch.zeros(block))
    # the rounding error is at most half a step of each block's scale
    assert bool(((rounded - x).abs() <= d.repeat_interleave(block, dim=1) * 0.5 + 1e-7).all())


@pytest.mark.parametrize("m", (1, 2, 3, 5, 8, 17, 27, 32, 33, 100))  # whole 8-row tiles, and a tail
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_int8_linear_is_w_times_rounded_x(module, int8_path: str, qtype: Q, m: int) -> None:
    """45 output rows: five tiles of 8 weight rows, one of 4 and one alone on the packed path."""
    k, n = 512, 45
    blocks = weight(qtype, n, k, seed=m)
    w = gguf_dequantized(blocks, qtype, k)
    x = activations(m, k, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m))
    got = kernels.linear(x, blocks, qtype, torch.empty(m, n), bias, int8_x=True)
    assert_within_sum_order(got - bias, *operands(int8_path, x, w, qtype))
    # and it is not the float32 path's answer: the rounding of x shows
    exact = kernels.linear(x, blocks, qtype, torch.empty(m, n), bias)
    assert not torch.allclose(got, exact, rtol=1e-5, atol=0)


@pytest.mark.parametrize("qtype", (Q.Q5_0, Q.Q8_0, Q.Q4_K), ids=lambda q: q.name)
def test_a_prefill_step_in_blocks_of_rows(module, int8_path: str, qtype: Q) -> None:
    """A step of many rows goes over x' in blocks of ~128 KB (64 rows of 2048): 150 rows are two whole
    blocks and a third with whole 8-row tiles and a tail of 6."""
    k, n, m = 2048, 40, 150
    blocks = weight(qtype, n, k, seed=5)
    x = activations(m, k, seed=5)
    got = kernels.linear(x, blocks, qtype, torch.empty(m, n), int8_x=True)
    assert_within_sum_order(got, *operands(int8_path, x, gguf_dequantized(blocks, qtype, k), qtype))


THIRTY_TWO = [q for q in QUANTIZED if q not in K_QUANTS]


@pytest.mark.parametrize("k", (96, 544, 640))
@pytest.mark.parametrize("qtype", THIRTY_TWO, ids=lambda q: q.name)
def test_one_row_eight_blocks_at_a_time(module, qtype: Q, k: int) -> None:
    """A decode row against a 32-element format takes a weight row's blocks eight at a time (their scales
    gathered) and the rest one by one: 3 blocks (none whole), 17 (two groups and one), 20 (two and four)
    all come out as F.linear(x', W)."""
    n = 37
    blocks = weight(qtype, n, k, seed=k)
    x = activations(1, k, seed=k)
    got = kernels.linear(x, blocks, qtype, torch.empty(1, n), int8_x=True)
    assert_within_sum_order(got, round_activations(x, activation_block(qtype)), gguf_dequantized(blocks, qtype, k))


@pytest.mark.parametrize("m", (1, 4, 11))
def test_int8_parts_of_mixed_formats(module, int8_path: str, m: int) -> None:
    """A fused projection whose parts round x differently (per 32 and per 256) and a float part,
    which keeps x as it is."""
    k, formats, sizes = 512, (Q.Q5_0, Q.Q4_K, Q.F16, Q.Q6_K, Q.Q8_0), (40, 33, 24, 50, 17)
    blocks = [
        weight(q, s, k, seed=i) if q != Q.F16 else kernels.random_blocks(q, s, k, np.random.default_rng(i))
        for i, (q, s) in enumerate(zip(formats, sizes))
    ]
    x = activations(m, k, seed=7)
    got = kernels.linear_parts(x, blocks, list(formats), torch.empty(m, sum(sizes)), int8_x=True)
    col = 0
    for q, s, b in zip(formats, sizes, blocks):
        w = gguf_dequantized(b, q, k) if q != Q.F16 else torch.from_numpy(b.numpy().view(np.float16).astype(np.float32))
        if q == Q.F16:
            assert_within_sum_order(got[:, col : col + s], x, w)
        else:
            assert_within_sum_order(got[:, col : col + s], *operands(int8_path, x, w, q))
        col += s


@pytest.mark.parametrize("m", (3, 16))  # 16: two 8-row tiles of the 32-element formats
@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_1, Q.Q4_K), ids=lambda q: q.name)
def test_a_non_finite_row_fails_alone(module, int8_path: str, qtype: Q, m: int) -> None:
    k, n = 256, 20
    blocks = weight(qtype, n, k, seed=1)
    x = activations(m, k, seed=1)
    x[1, 5] = float("nan")
    got = kernels.linear(x, blocks, qtype, torch.empty(m, n), int8_x=True)
    assert bool(got[1].isnan().all())
    others = [i for i in range(m) if i != 1]
    assert bool(torch.isfinite(got[others]).all())


@pytest.fixture
def without_amx(module):
    """The int8 kernels at every size, as on CPUs without AMX."""
    rows = module.set_amx_min_rows(1 << 62)
    yield
    module.set_amx_min_rows(rows)


@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q6_K), ids=lambda q: q.name)
def test_method_gives_the_same_product_at_any_batch_size(
    module, without_amx, qtype: Q, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AMX, rows served by the kernel (one pass, or several of pass_rows) and by the dequantized
    tile compute the same ``W x'``: a request's tokens do not depend on how many others share its step.
    With int8 activations the kernel takes steps of any size (a prefill budget past 512 rows too): its
    integer tiles beat dequantizing float32 tiles at every size measured."""
    k, n = 512, 64
    blocks = weight(qtype, n, k, seed=3)
    method = GGUFMethod(blocks.reshape(-1), qtype, (n, k))
    assert use_int8_activations([method]) == 1 and method.int8_x
    x = activations(600, k, seed=3)
    with monkeypatch.context() as m:
        m.setattr(method, "dequantize_rows", lambda *a: pytest.fail("a 600-row step left the kernel"))
        big = method.apply(x)
    method.kernel_max_rows = 0  # (as benchmarks move it) every step to the tiles
    tiled = method.apply(x)
    method.kernel_max_rows = INT8_KERNEL_MAX_ROWS
    passes = method.apply(x[:40])  # the kernel: one pass (int8_one_pass), else passes of pass_rows
    alone = torch.cat([method.apply(x[i : i + 1]) for i in range(4)])  # one row at a time: the kernel
    reference = gguf_dequantized(blocks, qtype, k)
    assert_within_sum_order(big, round_activations(x, activation_block(qtype)), reference)
    assert_within_sum_order(tiled, round_activations(x, activation_block(qtype)), reference)
    tol = 1e-5 * float(alone.abs().max())
    torch.testing.assert_close(tiled, big, rtol=1e-5, atol=tol)
    torch.testing.assert_close(big[:40], passes, rtol=1e-5, atol=tol)
    torch.testing.assert_close(passes[:4], alone, rtol=1e-5, atol=tol)


def test_float_weights_keep_float_activations() -> None:
    assert [activation_block(q) for q in (Q.F32, Q.F16, Q.BF16)] == [0, 0, 0]
    assert {activation_block(q) for q in K_QUANTS} == {256}
    assert {activation_block(q) for q in QUANTIZED if q not in K_QUANTS} == {32}
    assert all(BLOCK_LAYOUT[q][0] % activation_block(q) == 0 for q in QUANTIZED)


@pytest.mark.parametrize("m", (1, 8, 32))
def test_int8_weights_split_over_threads(module, int8_path: str, m: int) -> None:
    """Weights large enough that both threads take rows: the workers read the caller's rounded x (a
    per-thread buffer named inside the parallel region would be each worker's own, empty one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        k, formats, sizes = 1024, (Q.Q8_0, Q.Q4_K, Q.Q5_0), (900, 700, 500)
        blocks = [weight(q, n, k, seed=i) for i, (q, n) in enumerate(zip(formats, sizes))]
        assert sum(b.numel() for b in blocks) > 4 * (64 << 10)  # over the kernel's 64 KB a thread
        x = activations(m, k, seed=m)
        got = kernels.linear_parts(x, blocks, list(formats), torch.empty(m, sum(sizes)), int8_x=True)
        col = 0
        for q, n, b in zip(formats, sizes, blocks):
            assert_within_sum_order(got[:, col : col + n], *operands(int8_path, x, gguf_dequantized(b, q, k), q))
            col += n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_amx_rounds_each_decoded_weight_once_to_bfloat16(module, qtype: Q) -> None:
    """One-hot rows of x read the weights back through the AMX tiles: each is gguf-py's value rounded
    once to bfloat16 (to nearest, ties to even), bit for bit, in every format."""
    if not module.amx_available():
        pytest.skip("this CPU (or build, or kernel) has no AMX bfloat16 tiles")
    k, n = 256, 40
    blocks = weight(qtype, n, k, seed=11)
    w = gguf_dequantized(blocks, qtype, k)
    got = kernels.linear(torch.eye(k), blocks, qtype, torch.empty(k, n), int8_x=True)
    assert torch.equal(got, w.bfloat16().float().T)


def test_steps_of_many_rows_take_amx_and_few_rows_int8(module) -> None:
    """The default threshold: a step of 24 rows or more takes the bfloat16 tiles where the CPU has AMX,
    one of fewer keeps llama.cpp's int8 rounding of x."""
    k, n, qtype = 512, 64, Q.Q4_K
    blocks = weight(qtype, n, k, seed=2)
    w = gguf_dequantized(blocks, qtype, k)
    x = activations(40, k, seed=2)
    many = kernels.linear(x, blocks, qtype, torch.empty(40, n), int8_x=True)
    few = kernels.linear(x[:23], blocks, qtype, torch.empty(23, n), int8_x=True)
    assert_within_sum_order(few, *operands("vnni", x[:23], w, qtype))
    assert_within_sum_order(many, *operands("amx" if module.amx_available() else "vnni", x, w, qtype))
