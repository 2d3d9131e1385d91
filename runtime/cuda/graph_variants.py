"""The capture-time A/B of a decode graph's variants (plain, fused few-row projections, fused with
PDL): how close fused must stay to plain (``few_row_tolerance``) and which is kept (``choose_variant``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Fused and unfused graphs of one size must give hidden states this close (relative L2 norm of the
# difference) for the fused one to be kept: they differ by the order of float32 sums, then rounding,
# compounded over the layers. Measured on an H200 with the Llama-3-8B shape (32 layers, random
# weights): 2.9e-6 in float32, 3.1e-2 in bfloat16 (4e-2 eager); a wrong kernel gives ~1.
FEW_ROW_TOLERANCE = {torch.float32: 1e-3}
FEW_ROW_TOLERANCE_16BIT = 0.1


def few_row_tolerance(dtype: torch.dtype) -> float:
    return FEW_ROW_TOLERANCE.get(dtype, FEW_ROW_TOLERANCE_16BIT)


@dataclass
class VariantTiming:
    """One batch size's capture-time A/B: median replay times, the relative difference of the fused
    graph's outputs from the plain graph's, and whether the PDL graph's equal the fused graph's."""

    fused_ms: float
    plain_ms: float | None  # None: no plain graph (SERVELM_DECODE_GEMV=on)
    rel_diff: float  # NaN without a plain graph
    tolerance: float
    pdl_ms: float | None = None  # the fused graph launched with PDL (None: not captured)
    pdl_identical: bool = False
    chosen: str = field(init=False)

    def __post_init__(self) -> None:
        self.chosen = choose_variant(
            self.fused_ms, self.plain_ms, self.rel_diff, self.tolerance, self.pdl_ms, self.pdl_identical
        )

    def describe(self) -> str:
        parts = [f"fused few-row projections {self.fused_ms:.3f} ms"]
        if self.pdl_ms is not None:
            parts.append(
                f"with PDL {self.pdl_ms:.3f} ms ({'identical' if self.pdl_identical else 'DIFFERENT'} outputs)"
            )
        if self.plain_ms is not None:
            parts.append(f"plain {self.plain_ms:.3f} ms, fused outputs differ by {self.rel_diff:.1e}")
        return ", ".join(parts) + f" -> {self.chosen}"


def choose_variant(
    fused_ms: float,
    plain_ms: float | None,
    rel_diff: float,
    tolerance: float,
    pdl_ms: float | None = None,
    pdl_identical: bool = False,
) -> str:
    """The fastest graph that may be kept: "plain"; "fused" if it agrees with plain (always, without
    a plain graph); "fused+pdl" if fused may be kept and the PDL graph gave the same bits. Ties: plain."""
    candidates: list[tuple[str, float]] = []
    if plain_ms is not None:
        candidates.append(("plain", plain_ms))
        if not rel_diff <= tolerance:  # NaN included
            return "plain"
    candidates.append(("fused", fused_ms))
    if pdl_ms is not None and pdl_identical:
        candidates.append(("fused+pdl", pdl_ms))
    return min(candidates, key=lambda c: c[1])[0]
