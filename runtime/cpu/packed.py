"""The CPU's base projection method: oneDNN on a packed copy of the weight, with the few-row kernel
under it (``cpu.linear``, ``cpu.ops``). ``cpu.setup`` builds one per projection and gives it to the
model, which never names the CPU's kernels itself."""

from __future__ import annotations

from collections.abc import Callable

import torch

from servelm.runtime.cpu import linear
from servelm.runtime.model_kernels import FewRowLinear


class PackedMethod:
    """oneDNN on a packed copy of the weight; steps of up to ``few_row_max_rows`` rows run the few-row
    kernel ``few_row`` over the dense weight instead."""

    def __init__(self, weight: torch.Tensor, few_row: FewRowLinear | None = None, few_row_max_rows: int = 0) -> None:
        self.packed = linear.pack(weight)
        self.linear = linear.linear
        self.few_row = few_row
        self.few_row_max_rows = few_row_max_rows if few_row is not None else 0
        self.name = "onednn" + ("+few-row" if few_row is not None else "")

    def apply(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= self.few_row_max_rows:
            return self.few_row(x.contiguous(), weight, bias)  # type: ignore[misc, arg-type]
        return self.linear(x, self.packed, bias)


def packed_methods(few_row: tuple[FewRowLinear, int] | None) -> Callable[[torch.Tensor], PackedMethod]:
    """What packs each weight: with ``few_row`` (the few-row kernel and its row limit) its steps keep
    the dense weight; without it the model drops the dense weight."""
    kernel, rows = few_row if few_row is not None else (None, 0)
    return lambda weight: PackedMethod(weight, kernel, rows)
