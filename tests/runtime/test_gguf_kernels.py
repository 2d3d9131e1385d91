"""The native GGUF block kernels (``runtime.cpu.gguf_kernels``) against dequantize-then-``F.linear``.

What is asserted, for every format the kernels serve, on weights written to a GGUF file and mapped
back read-only: ``linear`` equals ``F.linear(x, registry.dequantize(W), b)`` within a float32
summation-order bound (``1e-5 * (|x| @ |W|^T + |b|)`` elementwise) for 1 to 64 activation rows, with
and without bias, writing only its own column slice of a wider output; ``get_rows`` equals the
registry's rows bit for bit; unsupported formats and mismatched shapes raise.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf

from servelm.runtime.cpu import gguf_kernels as kernels
from servelm.runtime.cpu.extension import cpu_flags
from servelm.runtime.gguf.reader import GGUFTensor, read_gguf_tensors
from servelm.runtime.gguf.registry import BLOCK_LAYOUT, dequantize

OUT = 37  # output rows: not a multiple of anything the kernel splits by
ROWS = (1, 2, 3, 4, 5, 8, 17, 64)
FLOATS = (Q.F32, Q.F16, Q.BF16)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf-py cannot quantize these: random blocks stand in
SUM_ORDER_RTOL = 1e-5


def in_features_for(qtype: Q) -> tuple[int, ...]:
    """Multiples of 256 for every format, of 32 for the 32-element ones, odd counts for the floats."""
    ks = (256, 512, 1024)
    if BLOCK_LAYOUT[qtype][0] == 32:
        ks += (32, 96, 160)
    if qtype in FLOATS:
        ks += (40, 100, 333)
    return ks


CASES = [(q, k) for q in sorted(kernels.KERNEL_TYPES) for k in in_features_for(q)]


def encoded_weight(qtype: Q, shape: tuple[int, int], seed: int) -> np.ndarray:
    """A ``shape`` weight in ``qtype``, as the array ``GGUFWriter.add_tensor`` takes for it."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return kernels.random_blocks(qtype, shape[0], shape[1], rng).numpy()
    # Rows spanning several orders of magnitude, as real layers' rows do.
    scale = np.logspace(-3, 1, shape[0], dtype=np.float32)[:, None]
    values = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(values, qtype))


def test_kernels_build_where_a_compiler_exists() -> None:
    # Otherwise a compile error, or a kernel failing its own self-check, shows up only as skipped tests.
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja on this machine")
    if os.environ.get(kernels.DISABLE_ENV, "").strip() not in ("", "0"):
        pytest.skip(f"{kernels.DISABLE_ENV} is set")
    module = kernels.load()
    assert module is not None, "the GGUF kernels failed to build or their self-check; see the logged warning"
    flags = cpu_flags() or set()
    if {"avx2", "fma", "f16c"} <= flags:
        assert module.vectorized, "built without the AVX2 paths on an AVX2 CPU"


@pytest.fixture(scope="module")
def gguf_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Q, int], GGUFTensor]:
    """One ``[OUT, K]`` weight per case, written to one GGUF file and mapped back read-only."""
    path = tmp_path_factory.mktemp("gguf") / "kernels.gguf"
    write_gguf(path, {f"w.{q.name}.{k}": (encoded_weight(q, (OUT, k), seed=i), q) for i, (q, k) in enumerate(CASES)})
    tensors = read_gguf_tensors(path)
    return {(q, k): tensors[f"w.{q.name}.{k}"] for q, k in CASES}


def rows_of(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's blocks as ``[out_features, row_bytes]``: a view of the map, no copy."""
    return tensor.raw.reshape(tensor.shape[0], -1)


def mapped_read_only(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie in a read-only mapping (Linux; True where that cannot be read)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return True
    address = t.data_ptr()
    for line in lines:
        span, perms = line.split()[:2]
        lo, hi = (int(v, 16) for v in span.split("-"))
        if lo <= address < hi:
            return perms[1] == "-"
    return False


def assert_within_sum_order(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = F.linear(x, w, b)
    bound = SUM_ORDER_RTOL * (F.linear(x.abs().double(), w.abs().double(), None if b is None else b.abs().double()))
    err = (got.double() - want.double()).abs()
    worst = float((err - bound).max())
    assert worst <= 1e-30, f"max excess over the summation bound {worst:.3g}"


@pytest.mark.parametrize("qtype,k", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_linear_matches_dequantize_then_f_linear(module, qtype: Q, k: int, gguf_weights) -> None:
    tensor = gguf_weights[(qtype, k)]
    assert tensor.qtype == qtype and tensor.shape == (OUT, k)
    assert mapped_read_only(tensor.raw)  # the kernel reads the file's read-only map itself
    blocks = rows_of(tensor)
    w = dequantize(tensor)
    assert torch.isfinite(w).all()
    gen = torch.Generator().manual_seed(k + int(qtype))
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        for bias in (None, torch.randn(OUT, generator=gen)):
            wide = torch.full((m, OUT + 7), 12345.0)
            out = wide[:, 3 : 3 + OUT]  # a column slice: row stride OUT + 7
            assert kernels.linear(x, blocks, qtype, out, bias) is out
            assert_within_sum_order(out, x, w, bias)
            assert torch.all(wide[:, :3] == 12345.0) and torch.all(wide[:, 3 + OUT :] == 12345.0)


@pytest.mark.parametrize("qtype", sorted(kernels.KERNEL_TYPES), ids=lambda q: q.name)
def test_linear_at_model_sizes(module, qtype: Q) -> None:
    """Long rows (K = 4096) and enough output rows that both threads get work, against the assert_close form."""
    rows, k = 300, 4096
    blocks = kernels.random_blocks(qtype, rows, k, np.random.default_rng(int(qtype)))
    w = dequantize((blocks.reshape(-1), qtype, (rows, k)))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1))
    got = kernels.linear(x, blocks, qtype, torch.empty(4, rows))
    scale = float(x.abs().max() * w.abs().max())
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5 * math.sqrt(k) * scale)


@pytest.mark.parametrize("qtype", sorted(kernels.KERNEL_TYPES), ids=lambda q: q.name)
def test_get_rows_equals_dequantized_rows(module, qtype: Q, gguf_weights) -> None:
    k = 512
    tensor = gguf_weights[(qtype, k)]
    ids = torch.tensor([OUT - 1, 0, 7, 7, 20])
    got = kernels.get_rows(rows_of(tensor), ids, qtype, k)
    assert got.dtype == torch.float32 and got.shape == (5, k)
    # The kernels decode with the reference's roundings, so the rows are bit-equal.
    np.testing.assert_array_equal(got.numpy().view(np.uint32), dequantize(tensor)[ids].numpy().view(np.uint32))
    assert kernels.get_rows(rows_of(tensor), torch.tensor([], dtype=torch.long), qtype, k).shape == (0, k)


def test_errors(module, gguf_weights) -> None:
    tensor = gguf_weights[(Q.Q4_K, 256)]
    blocks = rows_of(tensor)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="unsupported quantization type"):
        kernels.linear(x, blocks, Q.Q2_K, torch.empty(2, OUT))
    with pytest.raises(RuntimeError, match="unsupported quantization type"):
        kernels.get_rows(blocks, torch.tensor([0]), Q.IQ4_NL, 256)
    with pytest.raises(RuntimeError, match="bytes a row"):
        kernels.linear(torch.randn(2, 512), blocks, Q.Q4_K, torch.empty(2, OUT))
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.linear(torch.randn(2, 100), blocks, Q.Q4_K, torch.empty(2, OUT))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.linear(x, blocks, Q.Q4_K, torch.empty(2, OUT + 1))
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear(x, blocks, Q.Q4_K, torch.empty(2, OUT), torch.zeros(OUT - 1))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.get_rows(blocks, torch.tensor([OUT]), Q.Q4_K, 256)


def test_disable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    assert kernels.load() is None
    with pytest.raises(RuntimeError, match=kernels.DISABLE_ENV):
        kernels.linear(torch.randn(1, 32), torch.zeros(1, 18, dtype=torch.uint8), Q.Q4_0, torch.empty(1, 1))


def test_kernel_types_are_registry_formats() -> None:
    from servelm.runtime.gguf.registry import SUPPORTED

    assert set(SUPPORTED) >= kernels.KERNEL_TYPES
    assert (
        kernels.SOURCE.is_file()
        and kernels.SOURCE.parent == Path(kernels.__file__).resolve().parents[1] / "cpu" / "csrc"
    )


PART_FORMATS = (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q5_K, Q.BF16, Q.F32)


@pytest.mark.parametrize("m", (1, 2, 5, 8, 17))
@pytest.mark.parametrize(
    "formats",
    [(Q.Q4_1, Q.Q4_1, Q.Q4_1), (Q.Q4_K, Q.Q6_K, Q.Q8_0), PART_FORMATS],
    ids=lambda fs: "-".join(q.name for q in fs),
)
def test_linear_parts_matches_each_part(module, formats: tuple[Q, ...], m: int) -> None:
    """One fused call equals each part's reference in its own columns, mixed formats, any row count."""
    k = 512
    rng = np.random.default_rng(m)
    sizes = [37 + 29 * i for i in range(len(formats))]  # uneven parts: the byte split crosses them
    blocks = [kernels.random_blocks(q, n, k, rng) for q, n in zip(formats, sizes)]
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    for bias in (None, torch.randn(sum(sizes), generator=gen)):
        wide = torch.full((m, sum(sizes) + 5), 12345.0)
        out = wide[:, 2 : 2 + sum(sizes)]
        assert kernels.linear_parts(x, blocks, list(formats), out, bias) is out
        col = 0
        for q, n, b in zip(formats, sizes, blocks):
            w = dequantize((b.reshape(-1), q, (n, k)))
            part_bias = None if bias is None else bias[col : col + n]
            assert_within_sum_order(out[:, col : col + n], x, w, part_bias)
            col += n
        assert torch.all(wide[:, :2] == 12345.0) and torch.all(wide[:, 2 + sum(sizes) :] == 12345.0)


def test_linear_parts_threads_split_large_parts(module) -> None:
    """Parts large enough that both threads get work (the split is by bytes, across part edges)."""
    k, sizes, formats = 1024, (700, 300, 900), (Q.Q8_0, Q.Q4_1, Q.Q6_K)
    rng = np.random.default_rng(3)
    blocks = [kernels.random_blocks(q, n, k, rng) for q, n in zip(formats, sizes)]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    got = kernels.linear_parts(x, blocks, list(formats), torch.empty(3, sum(sizes)))
    parts = [kernels.linear(x, b, q, torch.empty(3, n)) for q, n, b in zip(formats, sizes, blocks)]
    torch.testing.assert_close(got, torch.cat(parts, dim=1), rtol=0, atol=0)


def test_linear_parts_errors(module) -> None:
    blocks = kernels.random_blocks(Q.Q4_1, 4, 64, np.random.default_rng(0))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="one qtype per part"):
        kernels.linear_parts(x, [blocks, blocks], [Q.Q4_1], torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.linear_parts(x, [blocks, blocks], [Q.Q4_1, Q.Q4_1], torch.empty(2, 4))
    with pytest.raises(RuntimeError, match="bytes a row"):
        kernels.linear_parts(x, [blocks, blocks], [Q.Q4_1, Q.Q8_0], torch.empty(2, 8))


@pytest.mark.parametrize("m", (1, 5, 8, 17, 33))
def test_sharded_method_fuses_parts(module, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUFShardedMethod runs steps of up to KERNEL_MAX_ROWS rows as gguf_linear_parts calls of
    KERNEL_CHUNK rows each, larger ones part by part."""
    from servelm.runtime.gguf.projection import KERNEL_CHUNK, KERNEL_MAX_ROWS, GGUFMethod, GGUFShardedMethod

    k, formats, sizes = 256, (Q.Q4_1, Q.Q8_0, Q.Q6_K), (64, 32, 48)
    rng = np.random.default_rng(m)
    blocks = [kernels.random_blocks(q, n, k, rng) for q, n in zip(formats, sizes)]
    edges = np.cumsum((0,) + sizes)
    method = GGUFShardedMethod(
        [
            (slice(int(lo), int(hi)), GGUFMethod(b.reshape(-1), q, (n, k)))
            for lo, hi, b, q, n in zip(edges[:-1], edges[1:], blocks, formats, sizes)
        ]
    )
    assert method.fused_kernel is module
    calls = []
    monkeypatch.setattr(
        method,
        "fused_kernel",
        type(
            "Spy", (), {"gguf_linear_parts": staticmethod(lambda *a: (calls.append(1), module.gguf_linear_parts(*a)))}
        )(),
    )
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(m + 1))
    got = method.apply(x, None, bias)
    assert len(calls) == (-(-m // KERNEL_CHUNK) if m <= KERNEL_MAX_ROWS else 0)
    w = torch.cat([dequantize((b.reshape(-1), q, (n, k))) for b, q, n in zip(blocks, formats, sizes)])
    if m <= KERNEL_MAX_ROWS:
        assert_within_sum_order(got, x, w, bias)
    else:
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@pytest.fixture
def two_threads():
    """Two torch threads, so a prefill's rows are split over both (the per-row loops' parallel path)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("m", (1, 3, 8, 70))  # 70: rows over both threads (32 of 512 a chunk)
def test_norm_linear_is_the_norm_then_the_projection(module, two_threads, m: int) -> None:
    """gguf_norm_linear: r = (pre_w ? rms_norm(x) pre_w : x) + residual, out = rms_norm(r) norm_w W^T (+ b),
    each as F.rms_norm and the dequantized projection compute it; without a residual r is x itself."""
    k, sizes, formats, eps = 512, [70, 30], [Q.Q4_K, Q.Q8_0], 1e-6
    rng = np.random.default_rng(m)
    blocks = [kernels.random_blocks(q, n, k, rng) for q, n in zip(formats, sizes)]
    w = torch.cat([dequantize((b.reshape(-1), q, (n, k))) for b, q, n in zip(blocks, formats, sizes)])
    gen = torch.Generator().manual_seed(m)
    x, residual = torch.randn(m, k, generator=gen) * 3, torch.randn(m, k, generator=gen)
    pre_w, norm_w = (1 + 0.1 * torch.randn(k, generator=gen) for _ in range(2))
    bias = torch.randn(sum(sizes), generator=gen)
    for res, pre in ((None, None), (residual, None), (residual, pre_w)):
        out = torch.empty(m, sum(sizes))
        r = module.gguf_norm_linear(x, res, pre, norm_w, eps, blocks, [int(q) for q in formats], out, bias, False)
        want_r = x if res is None else (F.rms_norm(x, (k,), pre, eps) if pre is not None else x) + res
        if res is None:
            assert r is x or r.data_ptr() == x.data_ptr()
        torch.testing.assert_close(r, want_r, rtol=1e-6, atol=1e-6)
        assert_within_sum_order(out, F.rms_norm(want_r, (k,), norm_w, eps), w, bias)
    with pytest.raises(RuntimeError, match="pre_w needs a residual"):
        module.gguf_norm_linear(
            x, None, pre_w, norm_w, eps, blocks, [int(q) for q in formats], torch.empty(m, sum(sizes)), None, False
        )


@pytest.mark.parametrize("gelu", (True, False), ids=("gelu_tanh", "silu"))
@pytest.mark.parametrize("m", (1, 4, 200))  # 200: rows over both threads
@pytest.mark.parametrize("q,inter", [(Q.Q8_0, 256), (Q.F32, 267)], ids=("Q8_0", "F32-tail"))
def test_act_mul_linear_is_the_gated_activation_then_the_projection(
    module, two_threads, m: int, gelu: bool, q: Q, inter: int
) -> None:
    """gguf_act_mul_linear: (act(gate) * up) W^T, act GELU (tanh) or SiLU as torch computes them (the
    compiled one to a few ulp; 267 leaves 3 elements to the scalar loop), then optionally Gemma 3's
    norm of the output."""
    n, eps = 96, 1e-6
    blocks = kernels.random_blocks(q, n, inter, np.random.default_rng(inter))
    w = dequantize((blocks.reshape(-1), q, (n, inter)))
    gen = torch.Generator().manual_seed(m)
    gate_up = torch.randn(m, 2 * inter, generator=gen) * 4
    gate_up[:, :8] = torch.tensor([-30.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 30.0, 80.0])  # the curves' tails
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    act = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    for post in (None, 1 + 0.1 * torch.randn(n, generator=gen)):
        out = torch.empty(m, n)
        module.gguf_act_mul_linear(gate_up, gelu, [blocks], [int(q)], out, None, False, post, eps)
        want = F.linear(act.double(), w.double()).float()
        if post is not None:
            want = F.rms_norm(want, (n,), post, eps)
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))
