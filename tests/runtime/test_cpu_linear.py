"""oneDNN-packed CPU projections: same products as ``F.linear``, dense weights dropped, switchable."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from runtime import cpu_linear
from runtime.batch import BatchItem
from runtime.models.llama import Linear
from runtime.runner import ModelRunner

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
    lin.pack_for_cpu()
    assert lin.weight is None and lin.packed is not None
    assert "weight" not in dict(lin.named_parameters())
    torch.testing.assert_close(lin(x), expected, atol=1e-5, rtol=1e-5)


def _logits(runner: ModelRunner, rt: SimpleNamespace, ids: list[int]) -> torch.Tensor:
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=1)
    seq = rt.FakeSeq(seq_id=0, token_ids=list(ids))
    blocks.grow(seq, len(ids))
    return rt.step_logits(runner, [BatchItem(seq, len(ids), sample=False)])[0]


def test_runner_packs_by_default_and_env_switches_it_off(
    tiny_model_dir: Callable[[str], Path], build_runner: Callable[..., Any], rt: SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = tiny_model_dir("llama_untied")
    ids = list(range(5, 45))
    packed = build_runner(model_dir, num_blocks=16)
    assert packed.packed_linears
    assert packed.model.lm_head_packed is not None
    layer = packed.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.mlp.down_proj.packed is not None
    assert packed.weight_bytes > 0  # counted before packing

    monkeypatch.setenv("SERVELM_CPU_LINEAR", "torch")
    dense = build_runner(model_dir, num_blocks=16)
    assert not dense.packed_linears and dense.model.lm_head_packed is None
    assert dense.model.model.layers[0].self_attn.qkv_proj.weight is not None
    assert dense.weight_bytes == packed.weight_bytes
    torch.testing.assert_close(_logits(packed, rt, ids), _logits(dense, rt, ids), atol=1e-4, rtol=0)
