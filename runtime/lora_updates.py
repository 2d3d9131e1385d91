"""The adapters' updates as a step applies them: one projection's update (``LoRAModule``), the step's
rows per adapter (``LoRAContext``) and a projection's set of updates (``LoRAProjection``).

Apart from ``runtime.lora`` (which reads adapters and attaches them to a model) so that the model's
layers can name these without importing the loader, which imports the layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LoRAModule:
    """One projection's update in our layout: ``y[:, o:o+n] += (x @ A_j^T) @ (s B_j)^T`` per shard j.

    ``a`` ``[R, in]``: every shard's A rows, shard after shard; ``bt``: every shard's ``(s B_j)^T``
    ``[r_j, n_j]``, flattened one after the other; ``shards`` int64 ``[J, 3]``: (first output, n_j,
    r_j) in the same order. No zero blocks: a fused projection's update reads only its shards' bytes.
    """

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, shards: list[tuple[int, int, int]]) -> None:
        self.a = a
        self.bt = bt
        self.shards = torch.tensor(shards, dtype=torch.int64).view(-1, 3)
        # (output slice, rank slice, B^T view) per shard, for the torch path
        self.blocks: list[tuple[slice, slice, torch.Tensor]] = []
        k = off = 0
        for o0, n, r in shards:
            self.blocks.append((slice(o0, o0 + n), slice(k, k + r), bt[off : off + r * n].view(r, n)))
            k += r
            off += r * n
        self._shard_list = list(shards)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.bt.numel() * self.bt.element_size()

    def to(self, device: torch.device, dtype: torch.dtype) -> LoRAModule:
        return LoRAModule(
            self.a.to(device, dtype).contiguous(), self.bt.to(device, dtype).contiguous(), self._shard_list
        )

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += update(x)`` with torch ops (any dtype and device, any number of rows)."""
        h = x.mm(self.a.t())
        for out, ranks, bt in self.blocks:
            y[:, out].addmm_(h[:, ranks], bt)


# Steps of at most this many rows use the compiled kernel (when there is one): it reads an adapter's
# weights once per 8 of its rows, so beyond a decode batch BLAS over the gathered rows does better.
KERNEL_MAX_ROWS = 32

# (x [T, K], y [T, N] in place, a per adapter, bt per adapter, shards per adapter, row_adapter [T] int32)
LoRAKernel = Callable[
    [torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor], None
]


class LoRAContext:
    """The current step's adapter rows, shared by every projection (empty between steps).

    ``plan``: ``(adapter id, rows)`` pairs, ``rows`` None when the adapter owns every row of the step;
    or, with ``row_adapter`` (for ``kernel``, ``runtime.cpu.ops``' ``lora_apply``), each row's index
    into ``plan`` (-1: none), the rows then all None.
    """

    __slots__ = ("kernel", "plan", "row_adapter")

    def __init__(self, kernel: LoRAKernel | None = None) -> None:
        self.plan: list[tuple[int, torch.Tensor | None]] = []
        self.row_adapter: torch.Tensor | None = None
        self.kernel = kernel

    def set(self, plan: list[tuple[int, torch.Tensor | None]], row_adapter: torch.Tensor | None) -> None:
        self.plan, self.row_adapter = plan, row_adapter

    def clear(self) -> None:
        self.plan, self.row_adapter = [], None


_NO_UPDATE = (torch.empty(0), torch.empty(0), torch.empty(0, 3, dtype=torch.int64))


class LoRAProjection:
    """The adapters' updates of one projection (``MethodParts.lora`` of a ``Linear``'s method), applied to its output in place."""

    __slots__ = ("ctx", "updates")

    def __init__(self, ctx: LoRAContext) -> None:
        self.ctx = ctx
        self.updates: dict[int, LoRAModule] = {}

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` (the projection of ``x``) += each planned adapter's update on its rows."""
        ctx = self.ctx
        if ctx.row_adapter is not None and ctx.kernel is not None and x.dtype == torch.float32:
            mods = [self.updates.get(i) for i, _ in ctx.plan]
            if any(mods):
                args = [(m.a, m.bt, m.shards) if m is not None else _NO_UPDATE for m in mods]
                ctx.kernel(
                    x.contiguous(),
                    y,
                    [a for a, _, _ in args],
                    [b for _, b, _ in args],
                    [s for _, _, s in args],
                    ctx.row_adapter,
                )
            return
        for adapter_id, rows in ctx.plan:
            u = self.updates.get(adapter_id)
            if u is None:  # the adapter does not target this projection
                continue
            if rows is None:
                u.add_to(x, y)
            else:
                part = torch.zeros(rows.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
                u.add_to(x.index_select(0, rows), part)
                y.index_add_(0, rows, part)
