"""Projection methods: how one projection's ``x W^T (+ b)`` runs, chosen once at load as an object.

A projection (``models.layers.Linear``) and the vocabulary head hold a ``ProjectionMethod`` and call
``method.apply(x, weight, bias)``, as vLLM's layers call ``quant_method.apply``. The base method is
how the dense weight multiplies: plain torch (``DenseMethod``), torch with the head's few-row shape
(``TallSkinnyMethod``), or a device's own, built by its platform and given to the layer
(``cpu.packed.PackedMethod``: oneDNN on a packed copy with the few-row kernel under it). Wrappers take the steps of a few rows where a faster kernel serves them: a
quantized weight format (``QuantizedMethod``, one per ``WEIGHT_FORMATS`` entry) or the fused few-row
projections (``FewRowMethod``), and hand every other step to the method inside. A row-parallel
shard sums its partial products over the ranks around them (``ReducedMethod``), and LoRA adds its
updates around whichever method runs (``LoRAMethod``, ``runtime.lora``). A new weight format is one method class
registered in ``WEIGHT_FORMATS``.

Each method reads its row limits at every call (tests and the CUDA-graph A/B change them in place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class ProjectionMethod(Protocol):
    """Computes one projection; ``name`` says which kernels it runs, for logs and tests."""

    name: str

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor: ...


class DenseMethod:
    """``F.linear`` over the dense weight."""

    name = "dense"

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)  # type: ignore[arg-type]


class TallSkinnyMethod:
    """Dense, but a step of 2..``max_rows`` rows as ``W @ x^T`` (faster for the head's shape on CPU)."""

    name = "dense+tall-skinny"

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None and 1 < x.shape[0] <= self.max_rows:
            return torch.mm(weight, x.t()).t().contiguous()  # type: ignore[arg-type]
        return F.linear(x, weight, bias)  # type: ignore[arg-type]


class QuantizedMethod:
    """A weight-only quantized copy (``quantization.QuantizedWeight``) for steps its kernel takes;
    the dequantized dense weight, through ``inner``, for the rest."""

    def __init__(self, quant: Any, inner: ProjectionMethod) -> None:
        self.quant = quant
        self.inner = inner
        self.name = f"{quant.scheme}+{inner.name}"

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= self.quant.max_rows:
            return self.quant.linear(x, bias)
        return self.inner.apply(x, weight, bias)


class FewRowMethod:
    """The fused few-row projection (``models.layers.FewRowKernels.linear``) while its ``max_rows``
    admits the step; ``inner`` otherwise."""

    def __init__(self, kernels: Any, inner: ProjectionMethod) -> None:
        self.kernels = kernels
        self.inner = inner
        self.name = f"few-row+{inner.name}"

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernels.applies(x.shape[0]):
            return self.kernels.linear(x, weight, bias)
        return self.inner.apply(x, weight, bias)


class ReducedMethod:
    """``inner``'s partial product summed over the tensor-parallel ranks (a row-parallel shard)."""

    def __init__(self, all_reduce: Callable[[torch.Tensor], torch.Tensor], inner: ProjectionMethod) -> None:
        self.all_reduce = all_reduce
        self.inner = inner
        self.name = f"all-reduce+{inner.name}"

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        return self.all_reduce(self.inner.apply(x, weight, bias))


class LoRAMethod:
    """``inner``, then the step's LoRA updates of its rows added to the output in place
    (``lora_updates.LoRAProjection``); nothing while the step has no adapter rows."""

    def __init__(self, lora: Any, inner: ProjectionMethod) -> None:
        self.lora = lora
        self.inner = inner
        self.name = f"lora+{inner.name}"

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.inner.apply(x, weight, bias)
        if self.lora.ctx.plan:
            self.lora.apply(x, y)
        return y


# Weight format (``QuantizedWeight.scheme``) -> the method that serves it around the dense one.
WEIGHT_FORMATS: dict[str, Callable[[Any, ProjectionMethod], ProjectionMethod]] = {
    "int8": QuantizedMethod,
    "int4": QuantizedMethod,
    "int8_groups": QuantizedMethod,
}


@dataclass(frozen=True)
class MethodParts:
    """What a projection's method is built from: a weight kept in its file's format (``stored``), or
    the device's own base method (``base``; else dense, tall-skinny for ``tall_skinny_rows`` > 1), with
    the fused few-row projections and the weight format's quantized copy around it, then the ranks'
    sum and the LoRA updates."""

    stored: ProjectionMethod | None = None
    base: ProjectionMethod | None = None
    quant: Any = None  # quantization.QuantizedWeight
    few_rows: Any = None  # model_kernels.FewRowKernels
    tall_skinny_rows: int = 0
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    lora: Any = None  # lora_updates.LoRAProjection


class MethodChain:
    """A projection's method and the parts it was built from: a projection holds its weight and one of
    these, and a part given at load (or an adapter context) builds a new chain, never a step."""

    def __init__(self, parts: MethodParts | None = None) -> None:
        self.parts = parts or MethodParts()
        top = select_method(**{f.name: getattr(self.parts, f.name) for f in fields(self.parts)})
        self.name = top.name
        # The built method's own apply, bound: the chain adds no call to a projection's step.
        self.apply: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor] = top.apply

    def with_parts(self, **changes: Any) -> MethodChain:
        return MethodChain(replace(self.parts, **changes))


def select_method(
    *,
    stored: ProjectionMethod | None = None,
    base: ProjectionMethod | None = None,
    quant: Any = None,
    few_rows: Any = None,
    tall_skinny_rows: int = 0,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    lora: Any = None,
) -> ProjectionMethod:
    """The method for a projection in this state: the base (a device's, tall-skinny or dense), wrapped
    by the fused few-row projections and by its weight format, if any, then by the ranks' sum and
    the LoRA updates. A weight kept in its file's own format (``stored``: ``runtime.gguf``) is served
    by that method, under the same two."""
    method: ProjectionMethod
    if stored is not None:
        return _around(stored, all_reduce, lora)
    if base is not None:
        method = base
    elif tall_skinny_rows > 1:
        method = TallSkinnyMethod(tall_skinny_rows)
    else:
        method = DenseMethod()
    if few_rows is not None:
        method = FewRowMethod(few_rows, method)
    if quant is not None:
        method = WEIGHT_FORMATS[quant.scheme](quant, method)
    return _around(method, all_reduce, lora)


def _around(
    method: ProjectionMethod, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None, lora: Any
) -> ProjectionMethod:
    if all_reduce is not None:
        method = ReducedMethod(all_reduce, method)
    if lora is not None:
        method = LoRAMethod(lora, method)
    return method
