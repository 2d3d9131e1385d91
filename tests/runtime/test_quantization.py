"""Weight-only int8 (``--quantization int8``): the row quantizer, the CPU kernel over int8 weights, and a
quantized model whose few-row steps (int8 kernel) and larger steps (dequantized weights) agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from runtime import cpu_linear, cpu_ops
from runtime.capacity import StepCostModel
from runtime.config import ModelConfig
from runtime.models.llama import Linear
from runtime.quantization import check_quantization, dequantize_rows, quantize_rows


def test_rows_are_quantized_symmetrically_to_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 300, generator=gen) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different ranges
    w[7] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (40,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127  # the full symmetric range, never -128
    assert scale[7] == 1.0 and not q[7].any()  # a zero row: no division by zero
    err = (dequantize_rows(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7 * w.abs()).all())
    torch.testing.assert_close(scale[:7], w[:7].abs().amax(1) / 127)
    with pytest.raises(ValueError, match="N, K"):
        quantize_rows(torch.zeros(3, 4, 5))


def test_only_cpu_float32_int8_is_accepted() -> None:
    check_quantization(None, torch.device("cuda"), torch.bfloat16)  # nothing asked, nothing checked
    check_quantization("int8", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="CPU path only"):
        check_quantization("int8", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="float32"):
        check_quantization("int8", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="unknown quantization"):
        check_quantization("int4", torch.device("cpu"), torch.float32)


def _int8_kernel() -> Any:
    kernel = cpu_linear.small_m_int8_kernel()
    if kernel is None:
        pytest.skip("the CPU ops cannot be built here (no AVX-512 or no compiler)")
    return kernel[0]


@pytest.mark.parametrize("k", [5, 64 + 16 + 3, 576, 1536 + 7])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_int8_kernel_equals_the_dequantized_product(k: int, rows: int) -> None:
    # K: only the masked tail; all three loops (64-wide, 16-wide, tail); the default model's widths.
    kernel = _int8_kernel()
    gen = torch.Generator().manual_seed(k + rows)
    q, scale = quantize_rows(torch.randn(37, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(37, generator=gen)
    for b in (None, bias):
        want = F.linear(x.double(), dequantize_rows(q, scale).double(), None if b is None else b.double())
        torch.testing.assert_close(kernel(x, q, scale, b), want.float(), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="rows"):
        kernel(torch.randn(cpu_ops.load().int8_max_rows + 1, k), q, scale, None)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="int8"):
        kernel(x, q.float(), scale, None)


def _count_int8_calls(runner: Any) -> list[int]:
    """Wrap every int8 kernel the model holds; returns the list the calls' row counts go to."""
    calls: list[int] = []
    model = runner.model

    def counted(fn: Any) -> Any:
        def call(x: torch.Tensor, *a: Any) -> torch.Tensor:
            calls.append(x.shape[0])
            return fn(x, *a)

        return call

    for m in model.modules():
        if isinstance(m, Linear) and m.q8_linear is not None:
            m.q8_linear = counted(m.q8_linear)
    if model.lm_head_q8_linear is not None:
        model.lm_head_q8_linear = counted(model.lm_head_q8_linear)
    return calls


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "untied-head"])
def test_int8_steps_of_few_rows_agree_with_the_dequantized_model(
    tied: bool, tiny_llama_dir: Path, tiny_llama_untied_dir: Path, build_runner: Any, rt: Any
) -> None:
    """Decode steps of 1 and 3 rows go through the int8 kernel, the prefill step (more rows) through
    oneDNN over the dequantized weights: the same logits either way, and not the float32 model's."""
    _int8_kernel()
    model_dir = tiny_llama_dir if tied else tiny_llama_untied_dir
    q8 = build_runner(model_dir, quantization="int8")
    calls = _count_int8_calls(q8)
    steps = [[0, 1, 2], [1]]
    got = rt.prefill_then_decode(q8, [8, 9, 10], steps)
    cfg = ModelConfig.from_dir(model_dir)
    per_step = 4 * cfg.num_layers + 1  # q/k/v, o, gate/up, down per layer, then the head
    assert sorted(set(calls)) == [1, 3] and len(calls) == 2 * per_step  # the decode steps only
    # The same weights, no int8 kernel: every step through the dequantized weights.
    plain = build_runner(model_dir, quantization="int8")
    for m in plain.model.modules():
        if isinstance(m, Linear):
            m.q8_rows = 0
    plain.model.lm_head_q8_rows = 0
    torch.testing.assert_close(got, rt.prefill_then_decode(plain, [8, 9, 10], steps), atol=1e-4, rtol=1e-4)
    # The float32 model is a different (nearby) function.
    f32 = rt.prefill_then_decode(build_runner(model_dir), [8, 9, 10], steps)
    assert not torch.allclose(got, f32, atol=1e-5, rtol=1e-5)
    assert (got.argmax(-1) == f32.argmax(-1)).float().mean() > 0.8
    # A tied head is quantized on its own: the token lookup still reads the float32 embedding.
    if tied:
        emb = q8.model.model.embed_tokens.weight
        assert not torch.equal(q8.model.lm_head_weight, emb)
        torch.testing.assert_close(q8.model.lm_head_weight, emb, atol=float(emb.abs().max()) / 127, rtol=0)


def test_a_quantized_step_reads_a_quarter_of_the_projection_bytes(tiny_llama_dir: Path, build_runner: Any) -> None:
    f32 = build_runner(tiny_llama_dir)
    q8 = build_runner(tiny_llama_dir, quantization="int8")
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    emb = cfg.vocab_size * cfg.hidden_size
    projections = sum(m.q8.numel() for m in q8.model.modules() if isinstance(m, Linear))
    rows = sum(m.q8.shape[0] for m in q8.model.modules() if isinstance(m, Linear)) + cfg.vocab_size
    # float32: every parameter once (the tied embedding as the head); int8: the projections and the
    # head at one byte a weight plus a float32 scale a row, the rest (norms) unchanged.
    norms = f32.weight_bytes - 4 * (projections + emb)
    assert q8.weight_bytes == norms + projections + emb + 4 * rows
    cost = StepCostModel(cfg, torch.float32, q8.weight_bytes)
    assert cost.weight_bytes == q8.weight_bytes and StepCostModel(cfg, torch.float32).weight_bytes == 4 * cfg.num_params


def test_without_onednn_the_int8_kernel_still_serves_every_few_row_projection(
    tiny_llama_dir: Path, build_runner: Any, rt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The torch path splits gate/up into two matmuls for small steps; an int8 model must not take it.
    _int8_kernel()
    with monkeypatch.context() as m:
        m.setattr(cpu_linear, "onednn_linear_available", lambda dtype: False)
        q8 = build_runner(tiny_llama_dir, quantization="int8")
    assert not q8.packed_linears
    calls = _count_int8_calls(q8)
    got = rt.prefill_then_decode(q8, [8, 9], [[0, 1]])
    per_step = 4 * ModelConfig.from_dir(tiny_llama_dir).num_layers + 1
    assert calls == [2] * per_step  # the decode step only, every projection and the head
    with_onednn = rt.prefill_then_decode(build_runner(tiny_llama_dir, quantization="int8"), [8, 9], [[0, 1]])
    torch.testing.assert_close(got, with_onednn, atol=1e-4, rtol=1e-4)
