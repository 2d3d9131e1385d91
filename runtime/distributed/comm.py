"""The collectives tensor parallelism uses, over one ``torch.distributed`` process group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Communicator:
    """This process's rank in a tensor-parallel group of ``world_size`` ranks (rank 0 samples).

    ``idle_group`` carries the broadcasts the other ranks wait in between steps (the next step, a
    control message): an idle server may send nothing for hours, so it has no useful timeout, while
    ``group``'s short one bounds a collective inside a step that a rank never joins.
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None  # None: the default group
    idle_group: dist.ProcessGroup | None = None  # None: ``group``

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same sum)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' ``x`` concatenated along the last dimension; other ranks: ``x`` itself."""
        if not self.is_driver:
            dist.gather(x, None, dst=0, group=self.group)
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere); ``idle``: one the
        other ranks may wait in for as long as rank 0 has nothing to send."""
        dist.broadcast(x, src=0, group=self._waiting(idle))
        return x

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's picklable ``obj`` to every rank (control messages only: pickling is slow)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._waiting(True))
        return box[0]

    def _waiting(self, idle: bool) -> dist.ProcessGroup | None:
        return self.idle_group if idle and self.idle_group is not None else self.group
