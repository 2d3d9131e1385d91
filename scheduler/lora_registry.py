"""The LoRA adapters an engine serves by name, which of them are loaded, and which unfinished requests use them.

Ids are handed out once (1, 2, ...): an adapter unloaded and loaded again, under the same name or
read again from its folder, gets a new id, so its requests' prefix-cache hash chains (seeded with the
id) never meet the old copy's. An adapter unloaded by name while requests still use it stays in the
runner until the last of them finishes.

At most ``max_loaded`` adapters (``--max-cpu-loras``) are loaded at once, those unloaded by name but
still computing included. Making room unloads the least recently used adapter that no unfinished
request uses; its name stays served, and a request naming it needs its weights read again from its
folder by the caller (``LoRANotLoadedError``): reading takes seconds for a big adapter, which the
engine thread must not spend. When every loaded adapter is in use there is no room
(``LoRALimitError``).
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from servelm.runtime.lora import LoRAAdapter, LoRAError, load_lora_adapter
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.sampling_params import LoRANotFoundError

log = logging.getLogger(__name__)


class LoRANotLoadedError(Exception):
    """A request names a served adapter whose weights were unloaded to make room: read ``path`` (outside
    the engine thread) and add the request again with the adapter."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(f"the LoRA adapter {name!r} is not loaded; its weights are read from {path}")
        self.name = name
        self.path = path


class LoRALimitError(Exception):
    """No adapter can be loaded: ``limit`` are loaded and every one is in use by an unfinished request."""

    def __init__(self, limit: int, in_use: list[str]) -> None:
        super().__init__(
            f"all {limit} loaded LoRA adapters (--max-cpu-loras {limit}) are in use by unfinished requests "
            f"({', '.join(in_use)}); retry when some have finished"
        )
        self.limit = limit


@dataclass
class _Served:
    path: str
    id: int | None  # while loaded; None once unloaded to make room


class LoRARegistry:
    """Names -> adapter ids over a runner's ``add_lora`` / ``remove_lora``; ``enabled`` False refuses all.

    ``max_loaded`` (``config.max_cpu_loras``, else ``config.max_loras``) bounds the adapters in the runner.
    """

    def __init__(self, runner: Any, config: EngineConfig, *, enabled: bool, base_name: str) -> None:
        self.runner = runner
        self.enabled = enabled
        self.max_rank = config.max_lora_rank
        self.base_name = base_name  # the served model's own name, which no adapter may take
        self.max_loaded: int | None = config.max_cpu_loras or config.max_loras  # None: no bound
        self._by_name: dict[str, _Served] = {}
        self._ids = itertools.count(1)
        # Every id in the runner -> its name (None: unloaded by name, still computing some sequences),
        # least recently used first.
        self._loaded: collections.OrderedDict[int, str | None] = collections.OrderedDict()
        self._users: collections.Counter[int] = collections.Counter()  # unfinished sequences per id

    @property
    def adapters(self) -> dict[str, str]:
        """Served adapters, loaded or not: name -> path."""
        return {name: s.path for name, s in self._by_name.items()}

    @property
    def loaded(self) -> dict[str, int]:
        """Served adapters whose weights are loaded: name -> id, least recently used first."""
        return {name: i for i, name in self._loaded.items() if name is not None}

    def read(self, path: str) -> LoRAAdapter:
        """Read and check an adapter folder against the runner's model; reads the model's structure
        only, so it may run outside the engine thread. Raises ``LoRAError``."""
        self._check_enabled()
        return load_lora_adapter(path, self.runner.model, self.max_rank)

    def add(self, name: str, adapter: str | LoRAAdapter) -> int:
        """Serve an adapter (a folder, or what ``read`` returned) under ``name``; returns its id.
        Raises ``LoRAError``, or ``LoRALimitError`` when no loaded adapter can make room."""
        self._check_enabled()
        if not name:
            raise LoRAError("a LoRA adapter needs a name")
        if name == self.base_name or name in self._by_name:
            raise LoRAError(f"the name {name!r} is already served")
        if isinstance(adapter, str):
            adapter = self.read(adapter)
        served = _Served(adapter.path, None)
        self._install(name, served, adapter)
        self._by_name[name] = served
        log.info(
            "LoRA adapter %r (id %d, rank %d, %d projections, %.1f MB) from %s",
            name, served.id, adapter.rank, len(adapter.modules), adapter.nbytes / 1e6, adapter.path,
        )  # fmt: skip
        return served.id  # type: ignore[return-value]

    def remove(self, name: str) -> None:
        """Stop serving ``name`` (``LoRANotFoundError`` if it is not served); its weights go now, or
        when the last sequence using it finishes."""
        served = self._by_name.pop(name, None)
        if served is None:
            raise LoRANotFoundError(name)
        adapter_id = served.id
        if adapter_id is not None:
            if self._users[adapter_id]:
                self._loaded[adapter_id] = None
            else:
                self._unload(adapter_id)
        log.info("LoRA adapter %r (id %s) removed", name, adapter_id)

    def acquire(self, name: str, sequences: int, adapter: LoRAAdapter | None = None) -> int:
        """The id of ``name`` for ``sequences`` new sequences (each ``release``d when it finishes),
        which keep it loaded until then. An adapter unloaded to make room is loaded again from
        ``adapter`` (what ``read`` returned for its path), else ``LoRANotLoadedError``; with no room,
        ``LoRALimitError``."""
        served = self._by_name.get(name)
        if served is None:
            raise LoRANotFoundError(name)
        if served.id is None:
            if adapter is None or adapter.path != served.path:  # not read, or read for a former adapter of this name
                raise LoRANotLoadedError(name, served.path)
            self._install(name, served, adapter)
            log.info("LoRA adapter %r (id %d) read again from %s", name, served.id, served.path)
        adapter_id: int = served.id  # type: ignore[assignment]
        self._loaded.move_to_end(adapter_id)
        self._users[adapter_id] += sequences
        return adapter_id

    def release(self, adapter_id: int) -> None:
        users = self._users
        users[adapter_id] -= 1
        if users[adapter_id] <= 0:
            del users[adapter_id]
            if adapter_id in self._loaded and self._loaded[adapter_id] is None:  # unloaded by name
                self._unload(adapter_id)

    @property
    def in_use(self) -> dict[int, int]:
        """Unfinished sequences per adapter id."""
        return dict(self._users)

    def request_names(self, running: set[int], waiting: set[int]) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests (metrics)."""
        return self.names(running), self.names(waiting)

    def names(self, ids: set[int]) -> list[str]:
        """Sorted names of ``ids``; an adapter unloaded by name but still computing is ``#<id>``."""
        return sorted(self._loaded.get(i) or f"#{i}" for i in ids)

    def id_of(self, name: str) -> int:
        """The id of a loaded adapter (``LoRANotLoadedError`` if it was unloaded to make room)."""
        served = self._by_name.get(name)
        if served is None:
            raise LoRANotFoundError(name)
        if served.id is None:
            raise LoRANotLoadedError(name, served.path)
        return served.id

    def _install(self, name: str, served: _Served, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` in the runner under a new id for ``served``, unloading another if need be."""
        self._make_room()
        adapter_id = next(self._ids)
        self.runner.add_lora(adapter_id, adapter)
        served.id = adapter_id
        self._loaded[adapter_id] = name

    def _make_room(self) -> None:
        """Unload least recently used adapters no unfinished request uses until one more fits."""
        while self.max_loaded is not None and len(self._loaded) >= self.max_loaded:
            victim = next((i for i in self._loaded if not self._users[i]), None)
            if victim is None:
                raise LoRALimitError(self.max_loaded, self.names(set(self._loaded)))
            name = self._loaded[victim]
            self._unload(victim)
            if name is not None:
                self._by_name[name].id = None
            log.info(
                "LoRA adapter %r (id %d) unloaded to make room (--max-cpu-loras %d)", name, victim, self.max_loaded
            )

    def _unload(self, adapter_id: int) -> None:
        del self._loaded[adapter_id]
        self.runner.remove_lora(adapter_id)

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoRAError("LoRA adapters are not enabled on this server (--enable-lora)")
