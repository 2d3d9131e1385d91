"""Finished ``/v1/responses`` results kept in memory, for ``previous_response_id`` and
``GET /v1/responses/{id}``: a bounded LRU (the oldest unused entry goes first), lost on restart."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from servelm.server.protocol_chat import ChatMessage

# ~32 kB of text for an 8k-token conversation: ~32 MB when full of such.
DEFAULT_CAPACITY = 1000


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    # The conversation that the next turn continues: the input messages (earlier turns included, the
    # request's own ``instructions`` not: they do not carry over) and the output as assistant messages.
    history: list[ChatMessage]


class ResponseStore:
    """Responses by id, at most ``capacity`` of them (event-loop use only)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
