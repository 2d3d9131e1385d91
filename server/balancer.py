"""Which engine core takes a new request (``--data-parallel-size``): by each core's load, with prefix-cache
affinity. Plain arithmetic over counters, so it is tested without processes.

A core's load is vLLM's rule, ``4 * waiting + running``, plus its KV pool's use: a waiting request costs
more than a running one because it has still to be admitted, and a nearly full pool will make the next
admission wait or preempt. Waiting counts the requests this API process sent but the core has not yet
acknowledged: the counters the core sends lag by a step, and a burst of adds would otherwise all land
on the core that looked emptiest before it.

Affinity: the hash of a prompt's first full KV blocks (with what else keys the prefix cache: the LoRA
adapter, the cache salt) names a preferred core, so prompts sharing a long prefix meet the blocks an
earlier one left in that core's prefix cache. The preferred core keeps the request unless its load
exceeds the least-loaded core's by more than ``margin``: affinity saves a prefill, an overloaded core
costs every request queued on it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

WAITING_WEIGHT = 4  # vLLM's: a waiting request counts as four running ones
KV_WEIGHT = 16.0  # a full KV pool counts as four more waiting requests
AFFINITY_BLOCKS = 4  # the prefix that names a preferred core: up to this many full blocks
AFFINITY_MARGIN = 8.0  # load (two waiting requests) a preferred core may carry above the least-loaded one


@dataclass(frozen=True)
class CoreLoad:
    """One core's counters as this API process knows them."""

    num_running: int = 0
    num_waiting: int = 0
    num_pending: int = 0  # sent by this API process, not yet acknowledged by the core
    num_used_blocks: int = 0
    num_blocks: int = 0  # the pool's size (0: unknown, the KV term is left out)

    @property
    def score(self) -> float:
        kv = self.num_used_blocks / self.num_blocks if self.num_blocks > 0 else 0.0
        return WAITING_WEIGHT * (self.num_waiting + self.num_pending) + self.num_running + KV_WEIGHT * kv


def prefix_key(prompt: Sequence[int], block_size: int, salt: str | None = None) -> int | None:
    """A hash of ``prompt``'s first full blocks (up to ``AFFINITY_BLOCKS``) and ``salt``; None for a
    prompt shorter than one block (nothing of it would be cached). The same in every API process:
    integers' hashes are not randomised and the salt goes through crc32."""
    if block_size <= 0:
        return None
    full = min(AFFINITY_BLOCKS, len(prompt) // block_size)
    if full == 0:
        return None
    key = hash(tuple(prompt[: full * block_size]))
    if salt:
        key ^= zlib.crc32(salt.encode()) * 0x9E3779B1
    return key


def choose_core(loads: Sequence[CoreLoad], key: int | None, margin: float = AFFINITY_MARGIN, start: int = 0) -> int:
    """The index of the core that takes a request whose prefix hashes to ``key`` (None: no affinity).
    Among equally loaded cores the first from ``start`` wins: a caller turning ``start`` spreads
    requests that come one at a time (each finished before the next) over idle cores."""
    n = len(loads)
    scores = [c.score for c in loads]
    least = _least(scores, start)
    if key is None:
        return least
    preferred = key % n
    return preferred if scores[preferred] <= scores[least] + margin else least


def _least(scores: Sequence[float], start: int) -> int:
    n = len(scores)
    return min(((start + i) % n for i in range(n)), key=scores.__getitem__)
