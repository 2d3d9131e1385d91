"""Fair share between requests: one request's sequences may not crowd out everyone else's.

A request of ``n`` choices (or several prompts) is a *group* of sequences. Without a bound, an
80-byte body asking for ``n=64`` long outputs takes every sequence slot for minutes and a one-line
request queued behind it waits for all of them. While other requests wait, a group may hold at most a
share of the slots and of the KV blocks; beyond it, its further sequences wait, its latest sequences
give way (preempted by recompute) to a waiting request that does not fit, and they are the first to go
when memory is short. A group's first sequence is never over its share, so every request progresses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from servelm.scheduler.request import Request

DEFAULT_MAX_REQUEST_SHARE = 0.5


@dataclass
class GroupUsage:
    """What one group's running sequences hold: the sequences (admission order) and their distinct blocks."""

    seqs: list[Request] = field(default_factory=list)
    _blocks: set[int] | None = None  # built on first need: a lone sequence's count is its table's length

    def add(self, req: Request) -> None:
        self.seqs.append(req)
        if self._blocks is not None:
            self._blocks.update(req.block_table)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held (choices share their prompt's blocks: counted once)."""
        if len(self.seqs) == 1:
            return len(self.seqs[0].block_table)
        if self._blocks is None:
            self._blocks = {b for r in self.seqs for b in r.block_table}
        return len(self._blocks)


class FairShare:
    """The caps of one group: ``share`` of ``max_num_seqs`` slots and of ``num_blocks`` KV blocks (at
    least one of each); ``share`` 1 turns the bound off."""

    def __init__(self, share: float, max_num_seqs: int, num_blocks: int) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"max_request_share must be in (0, 1], got {share}")
        self.share = share
        self.enabled = share < 1.0
        self.max_seqs = max(1, int(share * max_num_seqs))
        self.max_blocks = max(1, int(share * num_blocks))

    @staticmethod
    def anyone_shares(running: list[Request]) -> bool:
        """Whether some group runs two sequences (else none is over its share: a lone one never is)."""
        return len({r.group for r in running}) < len(running)

    @staticmethod
    def usage(running: Iterable[Request]) -> dict[str, GroupUsage]:
        groups: dict[str, GroupUsage] = {}
        for req in running:
            u = groups.get(req.group)
            if u is None:
                u = groups[req.group] = GroupUsage()
            u.add(req)
        return groups

    def over(self, u: GroupUsage) -> bool:
        """Holds more than its share (a lone sequence never does)."""
        n = len(u.seqs)
        return n > self.max_seqs or (n > 1 and u.num_blocks > self.max_blocks)

    def full(self, u: GroupUsage | None) -> bool:
        """One more sequence of this group would take it past its share."""
        return u is not None and bool(u.seqs) and (len(u.seqs) >= self.max_seqs or u.num_blocks >= self.max_blocks)

    def order(self, running: list[Request]) -> list[Request]:
        """``running`` (a copy) with the sequences of groups over their share moved last, in their order:
        they get blocks after everyone else and are the first preempted when memory is short."""
        if not self.anyone_shares(running):
            return list(running)
        usage = self.usage(running)
        over = {g for g, u in usage.items() if self.over(u)}
        if not over:
            return list(running)
        return [r for r in running if r.group not in over] + [r for r in running if r.group in over]

    def victim(self, usage: dict[str, GroupUsage], spare: str) -> Request | None:
        """The latest sequence of the group most over its share (not group ``spare``), or None."""
        worst, most = None, 0.0
        for g, u in usage.items():
            if g != spare and self.over(u):
                excess = max(len(u.seqs) / self.max_seqs, u.num_blocks / self.max_blocks)
                if excess > most:
                    worst, most = u, excess
        return worst.seqs[-1] if worst is not None else None
