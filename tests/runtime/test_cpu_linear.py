"""oneDNN-packed CPU projections: same products as ``F.linear``, dense weights dropped, switchable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from servelm.runtime.batch import BatchItem
from servelm.runtime.cpu import linear as cpu_linear
from servelm.runtime.cpu.packed import packed_methods
from servelm.runtime.models.layers import Linear
from servelm.runtime.runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not cpu_linear.onednn_linear_available(torch.float32), reason="this torch build has no oneDNN linear"
)


@pytest.mark.parametrize("rows", [1, 3, 8, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 80, generator=g)
    got = cpu_linear.linear(x, cpu_linear.pack(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_packed_linear_takes_strided_input() -> None:
    w = torch.randn(40, 32)
    x = torch.randn(32, 10).t()  # [10, 32], not contiguous
    assert not x.is_contiguous()
    torch.testing.assert_close(cpu_linear.linear(x, cpu_linear.pack(w), None), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_packed_linear_bfloat16() -> None:
    w = torch.randn(64, 48).bfloat16()
    x = torch.randn(5, 48).bfloat16()
    got = cpu_linear.linear(x, cpu_linear.pack(w), None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


def test_linear_module_packs_and_drops_dense_weight() -> None:
    lin = Linear(16, [("a", 8), ("b", 4)], True, torch.float32, torch.device("cpu"))
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(7, 16)
    expected = F.linear(x, lin.weight, lin.bias)
    lin.use_base(packed_methods(None), keep_weight=False)
    assert lin.weight is None and lin.method.parts.base is not None and lin.method.name == "onednn"
    assert "weight" not in dict(lin.named_parameters())
    torch.testing.assert_close(lin(x), expected, atol=1e-5, rtol=1e-5)


def _logits(runner: ModelRunner, rt: SimpleNamespace, ids: list[int]) -> torch.Tensor:
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=1)
    seq = rt.FakeSeq(seq_id=0, token_ids=list(ids))
    blocks.grow(seq, len(ids))
    return rt.step_logits(runner, [BatchItem(seq, len(ids), sample=False)])[0]


def _float64_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def test_runner_packs_by_default_and_env_switches_it_off(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Callable[..., Any],
    rt: SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = tiny_model_dir("llama_untied")
    ids = list(range(5, 45))
    packed = build_runner(model_dir, num_blocks=16)
    assert packed.packed_linears
    assert packed.model.head_method.parts.base is not None
    assert packed.model.model.layers[0].mlp.down_proj.method.parts.base is not None
    assert packed.weight_bytes > 0  # counted before packing

    monkeypatch.setenv("SERVELM_CPU_LINEAR", "onednn")  # packed only: dense weights dropped
    onednn = build_runner(model_dir, num_blocks=16)
    assert onednn.few_row_linear is None
    assert onednn.model.model.layers[0].self_attn.qkv_proj.weight is None
    assert onednn.model.lm_head.weight is None

    monkeypatch.setenv("SERVELM_CPU_LINEAR", "torch")
    dense = build_runner(model_dir, num_blocks=16)
    assert not dense.packed_linears and dense.model.head_method.parts.base is None
    assert dense.model.model.layers[0].self_attn.qkv_proj.weight is not None
    assert dense.weight_bytes == packed.weight_bytes
    got = {name: _logits(r, rt, ids) for name, r in (("packed", packed), ("onednn", onednn), ("torch", dense))}
    # Same products in another summation order. Here (Intel, AVX-512/AMX) the three agree bit for bit;
    # one CI host gave 5e-4 between oneDNN and F.linear on logits of magnitude ~4 (std ~0.9), more
    # than summation order alone moves them here (~3e-6 for 1e-7 relative noise on every
    # projection), so a failure says how far each path is from float64.
    exact = _float64_logits(model_dir, ids)
    err = {name: float((v.double() - exact).abs().max()) for name, v in got.items()}

    def why(msg: str) -> str:
        return f"{msg}\nmax |logit - float64| by path: {err}; CPU: {_cpu_name()}"

    for name in ("packed", "onednn"):
        torch.testing.assert_close(got[name], got["torch"], atol=2e-3, rtol=0, msg=why)
    assert max(err.values()) < 2e-3, why("a path is far from float64")


@pytest.fixture(scope="module")
def few_row() -> tuple[cpu_linear.FewRowLinear, int]:
    kernel = cpu_linear.few_row_kernel()
    if kernel is None:
        pytest.skip("the few-row kernel did not build here (no compiler or no AVX-512; see the logged warning)")
    return kernel


def test_few_row_kernel_builds_on_avx512() -> None:
    # Otherwise a compile error in the .cpp would only show up as skipped tests.
    import shutil

    from servelm.runtime.cpu.extension import cpu_flags

    if shutil.which("c++") is None or shutil.which("ninja") is None or "avx512f" not in (cpu_flags() or set()):
        pytest.skip("no compiler, ninja or AVX-512 here")
    assert cpu_linear.few_row_kernel() is not None, "the few-row kernel failed to build; see the logged warning"


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 40), (8, 16), (3, 1536), (1001, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_kernel_equals_f_linear(
    few_row: tuple[cpu_linear.FewRowLinear, int], rows: int, n: int, k: int, bias: bool
) -> None:
    fn, max_rows = few_row
    assert max_rows == 4
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    torch.testing.assert_close(fn(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_few_row_kernel_refuses_what_it_cannot_do(few_row: tuple[cpu_linear.FewRowLinear, int]) -> None:
    fn, _ = few_row
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="rows"):
        fn(torch.randn(5, 16), w, None)
    with pytest.raises(RuntimeError, match="columns"):
        fn(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fn(torch.randn(1, 16).half(), w.half(), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fn(torch.randn(1, 16).bfloat16(), w, None)  # mixed


def test_runner_uses_few_row_kernel_for_few_rows(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Callable[..., Any],
    rt: SimpleNamespace,
    few_row: tuple[cpu_linear.FewRowLinear, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = build_runner(tiny_model_dir("qwen2"), num_blocks=16)  # q/k/v bias too
    assert runner.few_row_linear is not None
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is not None and qkv.method.parts.base is not None and qkv.method.parts.base.few_row_max_rows == 4
    calls: list[int] = []
    base = qkv.method.parts.base
    inner = base.few_row  # the kernel lives in the projection's base method (runtime.cpu.packed)

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return inner(x, w, b)

    monkeypatch.setattr(base, "few_row", spy)
    few = _logits(runner, rt, list(range(5, 9)))  # 4 rows: the kernel
    many = _logits(runner, rt, list(range(5, 15)))  # 10 rows: oneDNN
    assert calls == [4]
    monkeypatch.setenv("SERVELM_CPU_LINEAR", "torch")
    dense = build_runner(tiny_model_dir("qwen2"), num_blocks=16)
    torch.testing.assert_close(few, _logits(dense, rt, list(range(5, 9))), atol=1e-4, rtol=0)
    torch.testing.assert_close(many, _logits(dense, rt, list(range(5, 15))), atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 40), (5, 70)])
def test_few_row_kernel_bfloat16(rows: int, n: int, k: int) -> None:
    kernel = cpu_linear.few_row_kernel(torch.bfloat16)
    if kernel is None:
        pytest.skip("no AVX512-BF16 few-row kernel here")
    fn, _ = kernel
    g = torch.Generator().manual_seed(rows + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = fn(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 accumulation of exact bf16 products, one rounding at the end: within one bf16 ulp of
    # the float32 result.
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-7)


def test_bfloat16_runner_uses_the_kernels_and_tracks_float32(
    tiny_model_dir: Callable[[str], Path], build_runner: Callable[..., Any], rt: SimpleNamespace
) -> None:
    if cpu_linear.few_row_kernel(torch.bfloat16) is None:
        pytest.skip("no AVX512-BF16 few-row kernel here")
    model_dir = tiny_model_dir("llama")
    bf16 = build_runner(model_dir, num_blocks=16, dtype=torch.bfloat16)
    assert bf16.few_row_linear is not None and bf16.packed_linears
    fp32 = build_runner(model_dir, num_blocks=16)
    ids = list(range(5, 9))  # 4 rows: the few-row kernel
    a, b = _logits(bf16, rt, ids), _logits(fp32, rt, ids)
    assert (a - b).abs().max() < 0.1 * b.abs().max()  # bf16-level agreement
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
