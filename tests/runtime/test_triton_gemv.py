"""The fused few-row projections (``runtime.cuda.triton_gemv``), run on CPU tensors by Triton's interpreter:
each op against the unfused torch ops, the model with them against the plain model, the autotuner's
wiring, and the device check's parts that use them."""

from __future__ import annotations

import importlib

from triton_interp import (  # first: sets the interpreter
    build_with_triton_ops,
    flash_backend,
    gemv,
    prefill_then_decode,
    torch_rms_norm,
)

# isort: split
import pytest
import torch


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)


# (rows, tile): the untuned default for the row count, and each kind of tile explicitly (element-wise
# takes one row; the dot tiles pad any count to 16); the largest dot tile exceeds N and K here.
# One row: the default element-wise tile, a prefetching one narrow enough to loop many times over
# every K below (tail masked, the last prefetch wholly masked), and a dot tile; then 2-4 rows (dot).
PREFETCH_TILE = gemv.Tile(4, 32, 4, 1, False, prefetch=True)
GEMV_CASES = [
    (1, None),
    (1, PREFETCH_TILE),
    (1, gemv.DEFAULT_DOT),
    (2, None),
    (3, gemv.DOT_TILES[-1]),
    (4, gemv.DEFAULT_DOT),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "tile"), GEMV_CASES)
def test_few_row_linear_equals_f_linear(dtype: torch.dtype, rows: int, tile: tuple[int, ...] | None) -> None:
    gen = torch.Generator().manual_seed(20 + rows)
    # N and K off the tile sizes (masked edges); x a strided view; with and without bias.
    w = (torch.randn(37, 1100, generator=gen) / 8).to(dtype)
    b = torch.randn(37, generator=gen).to(dtype)
    x = torch.randn(rows, 1200, generator=gen)[:, :1100].to(dtype)
    for bias in (None, b):
        want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch.testing.assert_close(gemv.linear(x, w, bias, tile=tile), want.to(dtype), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "tile"), GEMV_CASES)
def test_few_row_norm_linear_equals_norm_then_linear(
    dtype: torch.dtype, rows: int, tile: tuple[int, ...] | None
) -> None:
    gen = torch.Generator().manual_seed(30 + rows)
    k = 96 + 4  # not a power of two: the tiles' tails are masked
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, k, generator=gen).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    w = (torch.randn(70, k, generator=gen) / 4).to(dtype)
    x0, res0 = x.clone(), res.clone()

    def exact(h: torch.Tensor) -> torch.Tensor:
        # The norm in float64 on the rounded sum: the kernel rounds neither the normalised value nor
        # its product with the scale (HF's eager norm does, in 16-bit dtypes; float32 is the same).
        h = h.double()
        normed = nw.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return torch.nn.functional.linear(normed, w.double()).to(dtype)

    y, summed = gemv.rms_norm_linear(x, res, nw, 1e-5, w, tile=tile)
    want_sum = x + res  # rounded to dtype, as the eager add is
    assert torch.equal(summed, want_sum)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched: the sum is a new tensor
    torch.testing.assert_close(y, exact(want_sum), **_tol(dtype))
    if dtype == torch.float32:  # ... where it equals the eager model's norm, then the projection
        want = torch.nn.functional.linear(torch_rms_norm(want_sum, nw, 1e-5).double(), w.double()).to(dtype)
        torch.testing.assert_close(y, want, **_tol(dtype))

    # The first layer: no residual yet; the residual stream is x itself.
    y, summed = gemv.rms_norm_linear(x, None, nw, 1e-5, w, tile=tile)
    assert summed is x
    torch.testing.assert_close(y, exact(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "tile"), GEMV_CASES)
def test_few_row_silu_mul_linear_equals_activation_then_linear(
    dtype: torch.dtype, rows: int, tile: tuple[int, ...] | None
) -> None:
    gen = torch.Generator().manual_seed(40 + rows)
    inter = 700
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    w = (torch.randn(50, inter, generator=gen) / 8).to(dtype)
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]  # rounded as the eager MLP rounds
    want = torch.nn.functional.linear(act.double(), w.double()).to(dtype)
    torch.testing.assert_close(gemv.silu_mul_linear(gu, w, tile=tile), want, **_tol(dtype))


def test_prefetch_is_refused_on_dot_tiles_and_element_wise_tiles_take_one_row() -> None:
    w, x = torch.randn(8, 64), torch.randn(1, 64)
    with pytest.raises(ValueError, match="prefetch"):
        gemv.linear(x, w, tile=gemv.Tile(16, 64, 4, 1, True, prefetch=True))
    with pytest.raises(ValueError, match="one row"):
        gemv.linear(torch.randn(2, 64), w, tile=PREFETCH_TILE)


def test_few_row_kernels_refuse_more_rows_than_they_tile() -> None:
    x = torch.zeros(gemv.MAX_ROWS + 1, 64)
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        gemv.linear(x, torch.zeros(8, 64))
    with pytest.raises(ValueError, match="weight"):
        gemv.linear(x[:2], torch.zeros(8, 65))


def test_model_with_few_row_kernels_equals_the_eager_model(tiny_model_dir, build_runner, rt, monkeypatch) -> None:
    """The CUDA-path model (Triton backend, fused ops) with the few-row projections on decode steps of
    1-4 rows and off for longer steps (prefill), against the plain torch path."""
    tiny_llama_dir = tiny_model_dir("llama_small_vocab")  # the head runs through the interpreter too
    from servelm.runtime.cpu import linear as cpu_linear
    from servelm.runtime.cpu.torch_backend import TorchAttentionBackend
    from servelm.runtime.model_kernels import FewRowKernels

    # Dense weights as on CUDA (oneDNN-packed projections would take the CPU's own path first).
    with monkeypatch.context() as m:
        m.setattr(cpu_linear, "onednn_linear_available", lambda dtype: False)
        fused = build_with_triton_ops(
            build_runner, m, tiny_llama_dir, backend=flash_backend.TritonPagedBackend(16, fused_rope=True)
        )
    assert not fused.packed_linears
    calls = {"linear": [], "rms_norm_linear": [], "silu_mul_linear": []}

    def counted(name):
        def call(x, *a):
            calls[name].append(x.shape[0])
            return getattr(gemv, name)(x, *a)

        return call

    kernels = FewRowKernels(counted("linear"), counted("rms_norm_linear"), counted("silu_mul_linear"), max_rows=4)
    fused.model.use_few_row_kernels(kernels)
    plain = build_runner(tiny_llama_dir, backend=TorchAttentionBackend(16, use_kernel=False))
    # Prefill all but the last two tokens (> 4 rows), then two decode steps: 3 rows, then 1 row.
    outs = [prefill_then_decode(runner, rt, [8, 9, 10], [[0, 1, 2], [1]]) for runner in (fused, plain)]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)
    layers = len(fused.model.model.layers)
    # Decode steps only (3 rows, then 1): q/k/v and gate/up with their norms, o_proj, down with SiLU,
    # and the head (as in a decode graph with the head inside).
    assert calls == {
        "linear": [3] * layers + [3] + [1] * layers + [1],
        "rms_norm_linear": [3] * 2 * layers + [1] * 2 * layers,
        "silu_mul_linear": [3] * layers + [1] * layers,
    }
    # The head alone: a few rows through the kernel, more rows plain.
    hidden = torch.randn(6, fused.model_config.hidden_size)
    for rows in (2, 6):
        calls["linear"].clear()
        torch.testing.assert_close(
            fused.model.compute_logits(hidden[:rows]), plain.model.compute_logits(hidden[:rows]), atol=2e-5, rtol=1e-5
        )
        assert calls["linear"] == ([rows] if rows <= 4 else [])


@pytest.mark.slow  # over 3 s: 4 s
def test_device_check_compares_few_row_and_plain_projections(tiny_llama_dir, build_runner, monkeypatch) -> None:
    """The device check's few-row section, on CPU: it passes on the real kernels, fails on a wrong one,
    and leaves the runner's setting as it found it."""
    from pathlib import Path

    from servelm.runtime.cpu import linear as cpu_linear
    from servelm.runtime.model_kernels import FewRowKernels

    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    monkeypatch.syspath_prepend(scripts)
    from device_checks import correctness
    from device_checks.common import Plan, Report
    from device_checks.correctness import check_few_row_kernels

    # Timing interpreted kernels says nothing and costs two more forwards per case (~2/3 of the time).
    monkeypatch.setattr(correctness, "timed", lambda fn, device, iters: 0.0)
    with monkeypatch.context() as m:
        m.setattr(cpu_linear, "onednn_linear_available", lambda dtype: False)
        runner = build_runner(tiny_llama_dir, backend=flash_backend.TritonPagedBackend(16, fused_rope=True))
    runner.few_rows = FewRowKernels(gemv.linear, gemv.rms_norm_linear, gemv.silu_mul_linear, max_rows=0)
    runner.model.use_few_row_kernels(runner.few_rows)
    plan = Plan.dry()
    report = Report()
    check_few_row_kernels(runner, plan, 2000, 1e-3, report)
    assert [c["ok"] for c in report.checks] == [True, True] and runner.few_rows.max_rows == 0

    def wrong(x, w, b):
        return gemv.linear(x, w, b) * 1.1

    runner.few_rows.linear = wrong
    report = Report()
    check_few_row_kernels(runner, plan, 2000, 1e-3, report)
    assert [c["ok"] for c in report.checks] == [False, False]


def test_the_autotuner_is_wired_to_the_row_count_s_tiles(monkeypatch) -> None:
    """The CUDA path's autotuned launch, run by the interpreter with a stand-in timer: one row tries
    element-wise and dot tiles, more rows only dot tiles, each key is tuned once, and the result is right."""
    tried: list[tuple[int, bool]] = []
    current = {}

    def bench(fn, quantiles=None):
        fn()
        cfg = current["config"]
        tried.append((rows_now, cfg.kwargs["USE_DOT"]))
        return [float(cfg.kwargs["BLOCK_N"])] * 3  # the smallest BLOCK_N "wins"

    orig_bench = gemv._tuned._bench

    def track(*args, config, **meta):
        current["config"] = config
        return orig_bench(*args, config=config, **meta)

    monkeypatch.setattr(gemv, "_autotuned", lambda x: True)
    monkeypatch.setattr(gemv._tuned, "_bench", track)
    monkeypatch.setitem(gemv._tuned.__dict__, "do_bench", bench)
    monkeypatch.setattr(gemv._tuned, "cache", {})
    gen = torch.Generator().manual_seed(50)
    w = torch.randn(24, 80, generator=gen)
    for rows_now in (1, 3, 1):
        x = torch.randn(rows_now, 80, generator=gen)
        torch.testing.assert_close(gemv.linear(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
    ones = [dot for r, dot in tried if r == 1]
    threes = [dot for r, dot in tried if r == 3]
    assert len(ones) == len(gemv._configs(1)) and ones.count(False) == len(gemv.ELEMENTWISE_TILES)  # tuned once
    assert threes == [True] * len(gemv.DOT_TILES)
    assert sorted(k[0] for k in gemv._tuned.cache) == [1, 4]  # keyed by the padded row count (3 -> 4)
    # The log lines name each key's pick (here the smallest BLOCK_N: 2 for one row, 16 for the dot).
    assert gemv.tuned_tiles() == [
        "linear rows<=1 24x80: 2x2048 element-wise, prefetch, 8 warps",
        "linear rows<=4 24x80: 16x256 dot, 4 warps",
    ]


def test_device_check_gemv_probe_compares_like_with_like(monkeypatch) -> None:
    """``scripts/device_checks/gemv_probe.py`` on small shapes, its CUDA-graph timer stood in for: each
    fused op agrees with the unfused ops it is timed against."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    probe = importlib.import_module("device_checks.gemv_probe")
    calls = []

    def fake_graph_ms(fns, device, iters=10):
        calls.append(len(fns))
        for fn in fns:
            fn()
        return 1.0

    monkeypatch.setattr(probe, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(probe, "L2_BYTES", 1 << 10)
    monkeypatch.setattr(probe, "LLAMA3_8B_PROJECTIONS", [
        ("qkv_proj", 48, 64, "rms_norm"), ("o_proj", 64, 64, "none"), ("down_proj", 64, 96, "silu_mul"),
    ])  # fmt: skip
    # float16: the interpreter's bf16 is not torch's (it truncates, and its tl.dot misreads bf16).
    rows = probe.probe(torch.device("cpu"), rows=(1, 3), dtype=torch.float16)
    assert [(r["name"], r["rows"]) for r in rows] == [
        (n, m) for n in ("qkv_proj", "o_proj", "down_proj") for m in (1, 3)
    ]
    assert all(r["rel_diff"] < 2e-3 for r in rows), [r["rel_diff"] for r in rows]
    assert len(calls) == 2 * len(rows) and all(c >= 2 for c in calls)  # fused and plain, several weight copies
    assert all(r["pdl_us"] is None for r in rows)  # no PDL off CUDA

    # Where PDL can run, the fused graph is also timed launched with it (not run here: the
    # interpreter has no grid dependency control).
    from servelm.runtime.cuda import pdl

    launched = []

    def fake_graph_ms_pdl(fns, device, iters=10):
        launched.append(pdl.active())
        if not pdl.active():
            for fn in fns:
                fn()
        return 0.5 if pdl.active() else 1.0

    monkeypatch.setattr(probe, "graph_ms", fake_graph_ms_pdl)
    monkeypatch.setattr(pdl, "unavailable_reason", lambda device: None)
    rows = probe.probe(torch.device("cpu"), dtype=torch.float16)
    assert [r["rows"] for r in rows] == [1, 1, 1] and launched == [False, False, True] * 3
    assert all(r["pdl_us"] == 500.0 and r["fused_us"] == 1000.0 for r in rows)


def test_device_check_gemv_sweep_times_each_tile_on_each_projection(monkeypatch) -> None:
    """The one-row tile sweep on small shapes: every tile it forces computes the fused op (checked
    against the unfused ops), the cuBLAS path is timed as tile None, and results come fastest first."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    probe = importlib.import_module("device_checks.gemv_probe")
    calls: list = []

    def fake_graph_ms(fns, device, iters=10):
        calls.append(fns[0]())
        return 1.0 + 0.01 * len(calls)  # later calls slower

    monkeypatch.setattr(probe, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(probe, "L2_BYTES", 1 << 10)
    monkeypatch.setattr(probe, "SWEEP_TILES", [(8, 512, 4, False), (4, 64, 4, True)])
    monkeypatch.setattr(probe, "LLAMA3_8B_PROJECTIONS", [
        ("qkv_proj", 48, 64, "rms_norm"), ("o_proj", 64, 64, "none"), ("gate_up_proj", 96, 64, "rms_norm"),
        ("down_proj", 64, 48, "silu_mul"), ("lm_head", 8, 64, "none"),
    ])  # fmt: skip
    results = probe.sweep(torch.device("cpu"), budget_s=600, dtype=torch.float16)
    assert list(results) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # the layer's, not the head
    for rows in results.values():
        assert [t for _, t in rows] == [
            None,
            (8, 512, 4, False),
            (4, 64, 4, True),
        ]  # timed in that order: fastest first
    # Tile-major: each tile's output per projection agrees with the unfused ops (tile None, first).
    assert len(calls) == 3 * 4
    for j in range(4):
        for t in (1, 2):
            torch.testing.assert_close(calls[4 * t + j].float(), calls[j].float(), rtol=2e-2, atol=2e-2)


def test_the_rerun_adds_only_sweep_tiles_that_beat_the_autotuner_s(monkeypatch) -> None:
    """``tiles_to_add``: per projection, the sweep's fastest tile when it beats the autotuner's tiles and
    cuBLAS by more than the margin; each added once, as a prefetch-aware element-wise ``Tile``."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    perf = importlib.import_module("device_checks.performance")
    tuned = (8, 512, 4, False)
    new = (2, 1024, 2, True)
    results = {
        "qkv_proj": [(14.0, new), (19.0, tuned), (22.0, None)],  # 26% faster than the autotuner's: added
        "o_proj": [(11.9, new), (12.0, tuned), (14.0, None)],  # within 3%: not worth a rerun
        "gate_up_proj": [(60.0, tuned), (61.0, new)],  # the autotuner's own tile wins
        "down_proj": [(30.0, None), (33.0, new)],  # cuBLAS wins
        "lm_head": [(200.0, new)],  # nothing to compare with: added (once)
    }
    assert perf.tiles_to_add(results) == [gemv.Tile(2, 1024, 2, 3, False, prefetch=True)]
    assert perf.tiles_to_add({"o_proj": results["o_proj"]}, margin=0.0) == [
        gemv.Tile(2, 1024, 2, 3, False, prefetch=True)
    ]
    assert perf.tiles_to_add({"gate_up_proj": results["gate_up_proj"], "down_proj": results["down_proj"]}) == []


def test_the_batch1_rerun_offers_the_tiles_then_restores_the_list(tiny_llama_dir, monkeypatch) -> None:
    """``batch1_with_tiles`` on CPU (plumbing: no graphs, no tuning here): it reports the batch-1 row,
    the autotuner's list holds the added tile while the engine is built, and is restored after."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    perf = importlib.import_module("device_checks.performance")
    from device_checks.common import Plan, Report

    import servelm.scheduler.engine

    added = gemv.Tile(2, 1024, 2, 3, False, prefetch=True)
    seen = []
    real_engine = servelm.scheduler.engine.Engine

    def engine(*a, **kw):
        seen.append(list(gemv.ELEMENTWISE_TILES))
        return real_engine(*a, **kw)

    monkeypatch.setattr(servelm.scheduler.engine, "Engine", engine)
    before = list(gemv.ELEMENTWISE_TILES)
    plan = Plan.dry()
    plan.max_model_len = 256  # the tiny model's positions
    report = Report()
    perf.batch1_with_tiles([added], tiny_llama_dir, plan, "float32", 2000, torch.device("cpu"), report)
    assert seen == [before + [added]] and before == gemv.ELEMENTWISE_TILES
    (row,) = report.throughput
    assert row["name"] == "batch 1 (synchronous) with the sweep's tiles added: ms per output token" and row["value"] > 0
    report = Report()
    perf.batch1_with_tiles([], tiny_llama_dir, plan, "float32", 2000, torch.device("cpu"), report)
    assert report.throughput == []  # nothing to rerun
