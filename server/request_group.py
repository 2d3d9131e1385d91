"""One HTTP request's engine requests, read by its handler as one stream of outputs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from servelm.scheduler.outputs import RequestOutput
from servelm.server.output_text import RequestText


class GroupOwner(Protocol):
    """What a group needs from the bridge that made it: to abort its requests and to let it go."""

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def release(self, group: RequestGroup) -> None: ...

    def stop_choices(self, request_id: str, stopped: list[tuple[int, str]]) -> None: ...


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), read as one stream of outputs.

    Iterate it to get ``RequestOutput``s in engine order until every request has finished; an error
    delivered by the engine thread is raised from the iteration. ``close()`` (sync, safe in
    ``finally`` blocks during cancellation) aborts whatever has not finished.
    """

    def __init__(self, owner: GroupOwner) -> None:
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.request_ids: list[str] = []
        self._unfinished: set[str] = set()
        self._closed = False
        # By request id, where this process makes the text (the engine sends token ids only).
        self.texts: dict[str, RequestText] = {}

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self.texts and isinstance(item, RequestOutput):
            text = self.texts.get(item.request_id)
            if text is not None:
                if text.finished:  # the core's news of a choice a stop string ended here
                    return
                stopped = text.apply(item)
                if stopped:
                    self._owner.stop_choices(item.request_id, stopped)
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            self.close()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
            if not self._unfinished:
                self.close()
        return item

    def fail(self, exc: BaseException) -> None:
        """End the group with ``exc`` after what was already delivered, aborting its unfinished requests."""
        if self._closed or not self._unfinished:
            return
        self._owner.abort(sorted(self._unfinished))  # (the reader clears _unfinished when it meets exc)
        self._put(exc)

    def close(self) -> None:
        """Abort the unfinished requests (if any) and release the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._owner.abort(sorted(self._unfinished))
            self._unfinished.clear()
        self._owner.release(self)
