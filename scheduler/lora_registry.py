"""The LoRA adapters an engine serves by name, and which of them unfinished requests still use.

Ids are handed out once (1, 2, ...): an adapter unloaded and loaded again under the same name gets a
new id, so its requests' prefix-cache hash chains (seeded with the id) never meet the old one's. An
adapter unloaded while requests still use it stays in the runner until the last of them finishes.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Any

from servelm.runtime.lora import LoRAAdapter, LoRAError, load_lora_adapter
from servelm.scheduler.sampling_params import LoRANotFoundError

log = logging.getLogger(__name__)


class LoRARegistry:
    """Names -> adapter ids over a runner's ``add_lora`` / ``remove_lora``; ``enabled`` False refuses all."""

    def __init__(self, runner: Any, *, enabled: bool, max_rank: int, base_name: str) -> None:
        self.runner = runner
        self.enabled = enabled
        self.max_rank = max_rank
        self.base_name = base_name  # the served model's own name, which no adapter may take
        self._by_name: dict[str, tuple[int, str]] = {}  # name -> (id, path)
        self._ids = itertools.count(1)
        self._users: collections.Counter[int] = collections.Counter()  # unfinished sequences per id
        self._removed: set[int] = set()  # unloaded by name, still computing some sequences

    @property
    def adapters(self) -> dict[str, str]:
        """Served adapters: name -> path."""
        return {name: path for name, (_, path) in self._by_name.items()}

    def read(self, path: str) -> LoRAAdapter:
        """Read and check an adapter folder against the runner's model; reads the model's structure
        only, so it may run outside the engine thread. Raises ``LoRAError``."""
        self._check_enabled()
        return load_lora_adapter(path, self.runner.model, self.max_rank)

    def add(self, name: str, adapter: str | LoRAAdapter) -> int:
        """Serve an adapter (a folder, or what ``read`` returned) under ``name``; returns its id."""
        self._check_enabled()
        if not name:
            raise LoRAError("a LoRA adapter needs a name")
        if name == self.base_name or name in self._by_name:
            raise LoRAError(f"the name {name!r} is already served")
        if isinstance(adapter, str):
            adapter = self.read(adapter)
        adapter_id = next(self._ids)
        self.runner.add_lora(adapter_id, adapter)
        self._by_name[name] = (adapter_id, adapter.path)
        log.info(
            "LoRA adapter %r (id %d, rank %d, %d projections, %.1f MB) from %s",
            name, adapter_id, adapter.rank, len(adapter.modules), adapter.nbytes / 1e6, adapter.path,
        )  # fmt: skip
        return adapter_id

    def remove(self, name: str) -> None:
        """Stop serving ``name`` (``LoRANotFoundError`` if it is not served); its weights go now, or
        when the last sequence using it finishes."""
        entry = self._by_name.pop(name, None)
        if entry is None:
            raise LoRANotFoundError(name)
        adapter_id = entry[0]
        if self._users[adapter_id]:
            self._removed.add(adapter_id)
        else:
            self.runner.remove_lora(adapter_id)
        log.info("LoRA adapter %r (id %d) removed", name, adapter_id)

    def acquire(self, name: str, sequences: int) -> int:
        """The id of ``name`` for ``sequences`` new sequences (each ``release``d when it finishes)."""
        entry = self._by_name.get(name)
        if entry is None:
            raise LoRANotFoundError(name)
        self._users[entry[0]] += sequences
        return entry[0]

    def release(self, adapter_id: int) -> None:
        users = self._users
        users[adapter_id] -= 1
        if users[adapter_id] <= 0:
            del users[adapter_id]
            if adapter_id in self._removed:
                self._removed.discard(adapter_id)
                self.runner.remove_lora(adapter_id)

    @property
    def in_use(self) -> dict[int, int]:
        """Unfinished sequences per adapter id."""
        return dict(self._users)

    def names(self, ids: set[int]) -> list[str]:
        """Sorted names of ``ids``; an adapter unloaded by name but still computing is ``#<id>``."""
        by_id = {i: n for n, (i, _) in self._by_name.items()}
        return sorted(by_id.get(i, f"#{i}") for i in ids)

    def id_of(self, name: str) -> int:
        entry = self._by_name.get(name)
        if entry is None:
            raise LoRANotFoundError(name)
        return entry[0]

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoRAError("LoRA adapters are not enabled on this server (--enable-lora)")
