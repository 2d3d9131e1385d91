"""The compiled float32 CPU ops (``runtime.cpu.ops``): RMSNorm equals torch's, and the model uses it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from servelm.runtime.batch import BatchItem
from servelm.runtime.cpu import ops as cpu_ops
from servelm.runtime.cpu.extension import cpu_flags
from servelm.runtime.model_kernels import NormKernel
from servelm.runtime.models.layers import RMSNorm


@pytest.fixture(scope="module")
def rms_norm() -> NormKernel:
    kernel = cpu_ops.rms_norm_kernel()
    if kernel is None:
        pytest.skip("servelm.runtime.cpu.ops did not build here (no compiler or no AVX-512; see the logged warning)")
    return kernel


def test_builds_where_it_can() -> None:
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no compiler or ninja here")
    # The norms, SiLU x up and the token mask build on any x86 CPU (an AVX2 host too); the few-row
    # linears and LoRA only with AVX-512.
    assert cpu_ops.load() is not None, "runtime/cpu/csrc/cpu_ops.cpp failed to build; see the logged warning"
    has_avx512 = "avx512f" in (cpu_flags() or set())
    assert (cpu_ops.load_avx512() is not None) == has_avx512
    assert cpu_ops.rms_norm_kernel() is not None and cpu_ops.fused_ops() is not None


@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (70, 576), (5, 40), (2, 7, 16), (1, 17)])
def test_rms_norm_equals_torch(rms_norm: NormKernel, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5), atol=1e-5, rtol=1e-5)


def test_rms_norm_refuses_what_it_cannot_do(rms_norm: NormKernel) -> None:
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        rms_norm(torch.randn(2, 8).half(), torch.randn(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        rms_norm(torch.randn(8, 4).t(), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)


def test_module_uses_the_kernel_only_on_contiguous_input(rms_norm: NormKernel) -> None:
    norm = RMSNorm(16, 1e-6, torch.float32, torch.device("cpu"))
    torch.nn.init.normal_(norm.weight)
    calls: list[tuple[int, ...]] = []
    norm.kernel = lambda x, w, eps: calls.append(tuple(x.shape)) or rms_norm(x, w, eps)
    x = torch.randn(4, 2, 16)
    want = F.rms_norm(x, (16,), norm.weight, 1e-6)
    torch.testing.assert_close(norm(x), want, atol=1e-5, rtol=1e-5)
    strided = x.transpose(0, 1)  # Qwen3's q/k norms see views like this
    torch.testing.assert_close(norm(strided), want.transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert calls == [(4, 2, 16)]


def test_runner_routes_rms_norm_and_env_switches_it_off(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Callable[..., Any],
    rt: SimpleNamespace,
    rms_norm: NormKernel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def logits(runner: Any) -> torch.Tensor:
        blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=2)
        seq = rt.FakeSeq(seq_id=0, token_ids=list(range(9, 40)))
        blocks.grow(seq, len(seq.token_ids))
        return rt.step_logits(runner, [BatchItem(seq, len(seq.token_ids), sample=False)])[0]

    with_ops = build_runner(tiny_model_dir("qwen3"), num_blocks=16)  # q/k norms too
    norms = [m for m in with_ops.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is rms_norm for m in norms)
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "1")
    without = build_runner(tiny_model_dir("qwen3"), num_blocks=16)
    assert all(m.kernel is None for m in without.model.modules() if isinstance(m, RMSNorm))
    assert without.few_row_linear is None  # the same extension
    # float32 on CPU: the hidden-size norms take the fused residual add + norm, the MLP the fused SiLU x up.
    layer = with_ops.model.model.layers[0]
    assert layer.input_layernorm.fused is not None and layer.mlp.act_mul is not None
    assert layer.self_attn.q_norm.fused is None  # per-head q/k norms keep the plain kernel
    assert without.model.model.layers[0].input_layernorm.fused is None
    torch.testing.assert_close(logits(with_ops), logits(without), atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_fused_add_norm_and_silu_mul_equal_the_separate_ops(rms_norm: NormKernel, rows: int) -> None:
    ops = cpu_ops.fused_ops()
    assert ops is not None
    add_rms_norm, silu_mul = ops
    g = torch.Generator().manual_seed(rows)
    x, residual, w = (
        torch.randn(rows, 576, generator=g),
        torch.randn(rows, 576, generator=g),
        torch.randn(576, generator=g),
    )
    want_sum = x + residual
    out, r = add_rms_norm(x, residual, w, 1e-5)
    assert r is residual and torch.equal(residual, want_sum)  # the sum, in place
    assert torch.equal(out, rms_norm(want_sum, w, 1e-5))
    alone, none = add_rms_norm(x, None, w, 1e-5)
    assert none is None and torch.equal(alone, rms_norm(x, w, 1e-5))
    with pytest.raises(RuntimeError, match="residual"):
        add_rms_norm(x, residual[:, :100], w, 1e-5)
    gate_up = torch.randn(rows, 2 * 1536, generator=g)
    assert torch.equal(silu_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:])


@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (70, 576), (2, 7, 17)])
def test_rms_norm_bfloat16_rounds_like_hugging_face(rms_norm: NormKernel, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    w = torch.randn(shape[-1], generator=g).bfloat16()
    # LlamaRMSNorm in bf16: normalise in float32, round to bf16, multiply by the bf16 weight.
    want = w * F.rms_norm(x.float(), (shape[-1],), None, 1e-5).bfloat16()
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    # The sum of squares runs in another order: at most a one-ulp difference on a few elements.
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize(
    "source, march",
    [
        ("runtime/cpu/csrc/cpu_ops.cpp", ["-march=x86-64-v3"]),
        ("runtime/cpu/csrc/paged_attention_cpu.cpp", ["-march=x86-64-v3"]),
        ("runtime/cpu/csrc/gguf_linear.cpp", ["-march=x86-64-v3"]),
        ("runtime/cpu/csrc/gguf_linear.cpp", ["-march=x86-64-v4"]),  # AVX-512 without VNNI
        ("runtime/cpu/csrc/gguf_linear.cpp", ["-march=x86-64-v4", "-mavx512vnni"]),  # the VNNI tiles
        ("runtime/cpu/csrc/gguf_linear.cpp", ["-march=sapphirerapids"]),  # the AMX bfloat16 tiles
    ],
    ids=lambda v: v.rsplit("/", 1)[-1] if isinstance(v, str) else "+".join(v),
)
@pytest.mark.slow  # a C++ compile each
def test_kernel_sources_compile_for_other_cpus(source: str, march: list[str]) -> None:
    """A CPU without AVX-512 (x86-64-v3: AVX2, FMA) must still build every extension: what needs
    AVX-512 is behind its macros, and a build failure would cost every op of the file, not only those.
    The GGUF kernels also build for AVX-512 with and without VNNI, and with AMX, whatever this host has."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    root = Path(__file__).resolve().parents[2]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    cmd = ["g++", "-std=c++20", "-fsyntax-only", *march, "-fopenmp", "-DTORCH_EXTENSION_NAME=check",
           *includes, str(root / source)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20, 32])
def test_lora_apply_equals_the_torch_path(rows: int) -> None:
    """The compiled LoRA update against ``LoRAModule.add_to`` (torch): rows of three adapters and of none,
    a fused projection's shards (one not starting at the first output, widths not multiples of 16, K
    neither), an adapter that does not touch this projection."""
    from servelm.runtime.lora import LoRAModule

    kernel = cpu_ops.lora_kernel()
    if kernel is None:
        pytest.skip("servelm.runtime.cpu.ops did not build here")
    g = torch.Generator().manual_seed(rows)
    K, N = 150, 91
    layouts = [[(0, 40, 4), (40, 30, 8), (70, 21, 2)], [(5, 70, 16)], None]
    mods: list[LoRAModule | None] = []
    for layout in layouts:
        if layout is None:
            mods.append(None)
            continue
        rank = sum(r for _, _, r in layout)
        bt = torch.cat([torch.randn(r * n, generator=g) for _, n, r in layout])
        mods.append(LoRAModule(torch.randn(rank, K, generator=g), bt, layout))
    x = torch.randn(rows, K, generator=g)
    y = torch.randn(rows, N, generator=g)
    which = torch.randint(-1, 3, (rows,), generator=g, dtype=torch.int32)
    before = y.clone()
    want = y.clone()
    for t, s in enumerate(which.tolist()):
        if s >= 0 and mods[s] is not None:
            mods[s].add_to(x[t : t + 1], want[t : t + 1])
    empty = (torch.empty(0), torch.empty(0), torch.empty(0, 3, dtype=torch.int64))
    args = [(m.a, m.bt, m.shards) if m is not None else empty for m in mods]
    kernel(x, y, [a for a, _, _ in args], [b for _, b, _ in args], [s for _, _, s in args], which)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)
    touched = (which >= 0) & (which != 2)
    assert torch.equal(y[~touched], before[~touched])  # rows without an update here are left alone
    assert not touched.any() or (y[touched] - before[touched]).abs().max() > 0.1
    with pytest.raises(RuntimeError, match="adapter 3 of 3"):
        kernel(
            x,
            y,
            [a for a, _, _ in args],
            [b for _, b, _ in args],
            [s for _, _, s in args],
            torch.full((rows,), 3, dtype=torch.int32),
        )
