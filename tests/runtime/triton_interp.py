"""Triton's interpreter for the CPU tests of the CUDA path's kernels, and what those tests share.

``TRITON_INTERPRET=1`` must be set before triton is first imported (``triton.jit`` reads it when a
kernel is decorated): test modules import this one before anything that imports triton, and take the
kernel modules from here (``load`` re-imports them under the interpreter if they were imported without it).
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from triton.runtime import interpreter as _interpreter

# Triton 3.6's interpreter turns scalar tensors (1-element arrays) into Python ints with int(array),
# which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"); a dynamic loop bound
# (`range(0, kv_end, BLOCK_N)`) needs it. Newer Triton squeezes first; do the same here.
_orig_patch = _interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _orig_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interpreter._patch_lang_tensor = _patch_lang_tensor


def load(name: str):
    mod = importlib.import_module(name)
    # Imported earlier in this process without the interpreter: re-decorate the kernels under it.
    first_kernel = {
        "servelm.runtime.cuda.triton_tiles": "_attend_keys",
        "servelm.runtime.cuda.triton_kernels": "_store_kv_kernel",
        "servelm.runtime.cuda.triton_decode": "_paged_decode_split_kernel",
        "servelm.runtime.cuda.triton_ops": "_rms_norm_kernel",
        "servelm.runtime.cuda.triton_gemv": "_decode_gemv_kernel",
    }
    if type(getattr(mod, first_kernel[name])).__name__ != "InterpretedFunction":
        mod = importlib.reload(mod)
    return mod


load("servelm.runtime.cuda.triton_tiles")  # first: both attention modules import its helpers
td = load("servelm.runtime.cuda.triton_decode")
tk = load("servelm.runtime.cuda.triton_kernels")  # after td: it calls td's split decode
ops = load("servelm.runtime.cuda.triton_ops")
gemv = load("servelm.runtime.cuda.triton_gemv")
flash_backend = importlib.import_module("servelm.runtime.cuda.flash_backend")


def torch_rms_norm(x, w, eps):
    """The eager model's RMSNorm (``runtime.models.layers.RMSNorm`` without kernels)."""
    from servelm.runtime.models.layers import RMSNorm

    norm = RMSNorm(x.shape[-1], eps, x.dtype, torch.device("cpu"))
    norm.weight.data.copy_(w)
    return norm(x)


def prefill_then_decode(runner, rt, lengths: list[int], decode_steps: list[list[int]]) -> torch.Tensor:
    return rt.prefill_then_decode(runner, lengths, decode_steps)


def build_with_triton_ops(build_runner, monkeypatch, *args, **kwargs):
    """``build_runner(*args, **kwargs)`` with the model built from Triton's fused norm and activation
    (as ``CudaPlatform.layer_ops`` gives them), looked up at each call so a test may count them."""
    from servelm.runtime.cpu.platform import CpuPlatform
    from servelm.runtime.model_kernels import LayerOps

    triton_ops = LayerOps(add_rms_norm=lambda *a: ops.rms_norm(*a), silu_mul=lambda x: ops.silu_mul(x))
    with monkeypatch.context() as m:
        m.setattr(CpuPlatform, "layer_ops", lambda self, dtype: triton_ops)
        return build_runner(*args, **kwargs)
