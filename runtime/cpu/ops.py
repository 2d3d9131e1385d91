"""Small float32 CPU ops of the decode step, compiled from ``csrc/cpu_ops.cpp`` (AVX-512; the norms,
SiLU x up and the token mask on any x86 CPU).

* ``linear_few_row``: projections of one to four rows, streaming the dense weight (see
  ``runtime.cpu.linear``, which decides when to use it);
* ``linear_few_row_int8``: the same over int8 weights with a float32 scale per output row
  (``--quantization int8``, ``runtime.quantization``): a quarter of the bytes;
* ``linear_few_row_int4`` / ``linear_few_row_int8_grouped``: over weights quantized in groups of 32
  (``--quantization int4``: its projections and its head);
* ``add_rms_norm`` / ``silu_mul``: the residual add with the norm after it, and SiLU x up, each one
  call (``CpuPlatform.layer_ops``; the same values as the separate ops);
* ``rms_norm``: one pass per row instead of ``F.rms_norm``'s five ops (~26 us per call at batch 1 on
  this CPU, 61 calls per step: ~1.6 ms of a ~22 ms batch-1 forward);
* ``apply_token_bitmask``: a structured output's mask on the logits (``runtime.logits_processing``);
* ``lora_apply``: LoRA adapters' updates of a decode step's rows, one call per projection (``runtime.lora``).

Built on first use and cached under ``$SERVELM_CACHE/torch_extensions`` (``runtime.cpu.extension``);
``load()`` is None where it cannot be built or the self-check fails (``load_avx512()`` also where the CPU lacks AVX-512), and every
caller then keeps its torch path. ``SERVELM_DISABLE_CPU_OPS=1`` forces that.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from servelm.runtime import quantization
from servelm.runtime.cpu.extension import CompiledExtension
from servelm.runtime.model_kernels import FusedRmsNorm, NormKernel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
DISABLE_ENV = "SERVELM_DISABLE_CPU_OPS"

# (x [M, K] float32, weight [N, K] int8, scale [N] float32, bias [N] | None) -> [M, N] float32
FewRowLinearInt8 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _self_check(module: ModuleType) -> str | None:
    """The portable ops always; the AVX-512 kernels where the module was built with them."""
    gen = torch.Generator().manual_seed(0)
    problem = _check_portable(module, gen)
    if problem is None and module.has_avx512:
        problem = _check_avx512(module, gen)
    return problem


def _check_avx512(module: ModuleType, gen: torch.Generator) -> str | None:
    for rows, k, bias in ((1, 64, False), (3, 40, True), (4, 200, False)):
        w = torch.randn(37, k, generator=gen)
        x = torch.randn(rows, k, generator=gen)
        b = torch.randn(37, generator=gen) if bias else None
        if not torch.allclose(module.linear_few_row(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5):
            return f"linear_few_row self-check failed (rows {rows}, K {k}, bias {bias})"
    for rows, k, bias in ((1, 64, False), (2, 37, True), (4, 200, False), (3, 128 + 16 + 5, True), (8, 150, True)):
        q = torch.randint(-127, 128, (37, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(37, generator=gen) / 64
        x = torch.randn(rows, k, generator=gen)
        b = torch.randn(37, generator=gen) if bias else None
        want = F.linear(x.double(), q.double() * scale.double()[:, None], None if b is None else b.double()).float()
        if not torch.allclose(module.linear_few_row_int8(x, q, scale, b), want, atol=1e-4, rtol=1e-5):
            return f"linear_few_row_int8 self-check failed (rows {rows}, K {k}, bias {bias})"
    for rows, k, bias in ((1, 64, False), (3, 96, True), (8, 160, True)):
        w = torch.randn(37, k, generator=gen)
        x = torch.randn(rows, k, generator=gen)
        b = torch.randn(37, generator=gen) if bias else None
        bd = None if b is None else b.double()
        q4 = quantization.quantize_int4_groups(w)
        want = F.linear(x.double(), quantization.dequantize_int4_groups(*q4).double(), bd).float()
        if not torch.allclose(module.linear_few_row_int4(x, *q4, b), want, atol=1e-4, rtol=1e-5):
            return f"linear_few_row_int4 self-check failed (rows {rows}, K {k}, bias {bias})"
        q8 = quantization.quantize_int8_groups(w)
        want = F.linear(x.double(), quantization.dequantize_int8_groups(*q8).double(), bd).float()
        if not torch.allclose(module.linear_few_row_int8_grouped(x, *q8, b), want, atol=1e-4, rtol=1e-5):
            return f"linear_few_row_int8_grouped self-check failed (rows {rows}, K {k}, bias {bias})"
    if module.has_avx512_bf16:
        for rows, k in ((1, 64), (4, 70)):
            w = torch.randn(37, k, generator=gen).bfloat16()
            x = torch.randn(rows, k, generator=gen).bfloat16()
            want = F.linear(x.float(), w.float())
            if not torch.allclose(module.linear_few_row(x, w, None).float(), want, atol=0.05, rtol=0.02):
                return f"bfloat16 linear_few_row self-check failed (rows {rows}, K {k})"
    # LoRA: rows of two adapters (one with two shards over 21 + 16 outputs, ranks 3 and 5) and none.
    x = torch.randn(5, 40, generator=gen)
    y = torch.randn(5, 37, generator=gen)
    a = [torch.randn(8, 40, generator=gen), torch.randn(4, 40, generator=gen)]
    blocks = [
        [torch.randn(3, 21, generator=gen), torch.randn(5, 16, generator=gen)],
        [torch.randn(4, 37, generator=gen)],
    ]
    shards = [torch.tensor([[0, 21, 3], [21, 16, 5]]), torch.tensor([[0, 37, 4]])]
    row_adapters = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32)
    want = y.double().clone()
    for t, s in enumerate(row_adapters.tolist()):
        if s < 0:
            continue
        h = a[s].double() @ x[t].double()
        k = 0
        for (o0, n, r), bt in zip(shards[s].tolist(), blocks[s]):
            want[t, o0 : o0 + n] += h[k : k + r] @ bt.double()
            k += r
    module.lora_apply(x, y, a, [torch.cat([b.reshape(-1) for b in bl]) for bl in blocks], shards, row_adapters)
    if not torch.allclose(y.double(), want, atol=1e-4, rtol=1e-5):
        return "lora_apply self-check failed"
    return None


def _check_portable(module: ModuleType, gen: torch.Generator) -> str | None:
    x, r, w = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    want_r = x + r
    out, r_out = module.add_rms_norm(x, r, w, 1e-5)
    if (
        r_out is None
        or not torch.equal(r_out, want_r)
        or not torch.equal(r, want_r)
        or not torch.equal(out, module.rms_norm(want_r, w, 1e-5))
    ):
        return "add_rms_norm self-check failed"
    gate_up = torch.randn(3, 80, generator=gen)
    if not torch.equal(module.silu_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:]):
        return "silu_mul self-check failed"
    for rows, h in ((1, 64), (5, 40), (70, 576)):
        x = torch.randn(rows, h, generator=gen)
        w = torch.randn(h, generator=gen)
        if not torch.allclose(module.rms_norm(x, w, 1e-5), F.rms_norm(x, (h,), w, 1e-5), atol=1e-5, rtol=1e-5):
            return f"rms_norm self-check failed (rows {rows}, H {h})"
        xb, wb = x.bfloat16(), w.bfloat16()
        want = wb * F.rms_norm(xb.float(), (h,), None, 1e-5).bfloat16()
        if not torch.allclose(module.rms_norm(xb, wb, 1e-5).float(), want.float(), atol=2e-2, rtol=1e-2):
            return f"bfloat16 rms_norm self-check failed (rows {rows}, H {h})"
    logits = torch.randn(3, 70, generator=gen)
    bitmask = torch.tensor([[-1, 0, 5], [0x0F0F0F0F, -(2**31), 0]], dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(2, -1)[:, :70].bool()
    want = logits.clone()
    want[2] = want[2].masked_fill(~allowed[0], float("-inf"))
    want[0] = want[0].masked_fill(~allowed[1], float("-inf"))
    got = logits.clone()
    module.apply_token_bitmask(got, torch.tensor([2, 0]), bitmask)
    if not torch.equal(got, want):
        return "apply_token_bitmask self-check failed"
    return None


_extension = CompiledExtension(
    "CPU decode ops (few-row linear, int8/int4 linear, RMSNorm)", "servelm_cpu_ops", lambda: SOURCE, _self_check, log
)


def load() -> ModuleType | None:
    """The compiled module, or None. Never raises. Its norms, SiLU x up and token mask are portable;
    the few-row linears and LoRA need ``load_avx512``."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    return _extension.get()


def load_avx512() -> ModuleType | None:
    """The compiled module where it was built with AVX-512 (the few-row, int8/int4 and LoRA kernels), or None."""
    module = load()
    return module if module is not None and module.has_avx512 else None


def fused_ops() -> tuple[FusedRmsNorm, Callable[[torch.Tensor], torch.Tensor]] | None:
    """``(add_rms_norm, silu_mul)`` (float32) for ``CpuPlatform.layer_ops``, or None."""
    module = load()
    return None if module is None else (module.add_rms_norm, module.silu_mul)


def token_bitmask_kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """``apply_token_bitmask(logits, rows, bitmask)`` (float32 CPU logits, in place), or None."""
    module = load()
    return None if module is None else module.apply_token_bitmask


def lora_kernel() -> Callable[..., None] | None:
    """``lora_apply(x, y, a, bt, shards, row_adapter)`` (float32, ``runtime.lora``), or None."""
    module = load_avx512()
    return None if module is None else module.lora_apply


def rms_norm_kernel() -> NormKernel | None:
    module = load()
    return None if module is None else module.rms_norm
