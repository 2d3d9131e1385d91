"""Which projection method (``runtime.projection``) each projection and the head get, per device and
``--quantization``: chosen once at load, and the same object called by ``Linear`` and the head."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.runtime.cpu import linear as cpu_linear
from servelm.runtime.model_kernels import FewRowKernels
from servelm.runtime.models.layers import Linear
from servelm.runtime.platform import platform_of
from servelm.runtime.projection import DenseMethod, FewRowMethod, QuantizedMethod, select_method


def _methods(runner: Any) -> tuple[set[str], str]:
    """The method names of every projection, and the head's."""
    names = {m.method.name for m in runner.model.modules() if isinstance(m, Linear)}
    return names, runner.model.head_method.name


def _cpu_base(quantized: bool) -> tuple[str, str]:
    """The base method this machine gives (projections, head): oneDNN where torch has it, with the
    few-row dense kernel under it unless a quantized kernel serves the few-row steps."""
    if not cpu_linear.onednn_linear_available(torch.float32):
        return "dense", "dense+tall-skinny"
    kernels = cpu_linear.quantized_kernels() if quantized else {}
    few_row = not kernels and cpu_linear.few_row_kernel(torch.float32) is not None
    name = "onednn+few-row" if few_row else "onednn"
    return name, name


@pytest.mark.parametrize(
    "quantization, projection_format, head_format",
    [(None, None, None), ("int8", "int8", "int8"), ("int4", "int4", "int8_groups")],
)
def test_cpu_methods_per_quantization(
    tiny_llama_dir: Path,
    build_runner: Callable[..., Any],
    quantization: str | None,
    projection_format: str | None,
    head_format: str | None,
) -> None:
    runner = build_runner(tiny_llama_dir, quantization=quantization)
    base, head_base = _cpu_base(quantization is not None)
    projections, head = _methods(runner)
    assert projections == {f"{projection_format}+{base}" if projection_format else base}
    assert head == (f"{head_format}+{head_base}" if head_format else head_base)


def test_without_onednn_the_cpu_head_runs_tall_skinny(
    tiny_llama_dir: Path, build_runner: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_linear, "onednn_linear_available", lambda dtype: False)
    projections, head = _methods(build_runner(tiny_llama_dir))
    assert projections == {"dense"} and head == "dense+tall-skinny"


def test_cuda_selection_without_a_gpu() -> None:
    """On CUDA the model gets no CPU splits, so the registry gives dense methods wrapped by the fused
    few-row projections when they are installed (and never a quantized format: CPU only)."""
    cuda = torch.device("cuda")
    assert platform_of(cuda).small_batch_splits == (0, 0)
    assert not platform_of(cuda).quantization and platform_of(cuda).quantized_kernels() == {}
    kernels = FewRowKernels(lambda x, w, b: x, lambda *a: a, lambda x, w, b: x, max_rows=4)
    method = select_method(few_rows=kernels, tall_skinny_rows=platform_of(cuda).small_batch_splits[1])
    assert isinstance(method, FewRowMethod) and isinstance(method.inner, DenseMethod)
    assert method.name == "few-row+dense"
    assert select_method().name == "dense"


def test_a_weight_format_wraps_any_base_and_hands_larger_steps_on() -> None:
    """A quantized method serves the steps its kernel takes and passes the rest to the method inside."""

    class Quant:
        scheme = "int8"
        max_rows = 2

        def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return torch.full((x.shape[0], 3), 7.0)

    method = select_method(quant=Quant())
    assert isinstance(method, QuantizedMethod) and method.name == "int8+dense"
    w = torch.randn(3, 5)
    assert torch.equal(method.apply(torch.ones(2, 5), w, None), torch.full((2, 3), 7.0))
    x = torch.randn(3, 5)
    assert torch.equal(method.apply(x, w, None), torch.nn.functional.linear(x, w))


def test_norms_get_their_method_the_same_way(tiny_llama_dir: Path, build_runner: Callable[..., Any]) -> None:
    """Every RMSNorm calls one norm method, chosen when its kernels are installed: on CPU float32 the
    compiled fused add + norm where it builds, else the compiled norm, else torch."""
    from servelm.runtime.cpu import ops as cpu_ops
    from servelm.runtime.models.layers import RMSNorm

    runner = build_runner(tiny_llama_dir)
    names = {m.method.name for m in runner.model.modules() if isinstance(m, RMSNorm)}
    if cpu_ops.fused_ops() is not None:
        assert names == {"fused"}
    else:
        assert names == ({"compiled"} if cpu_ops.rms_norm_kernel() is not None else {"torch"})
