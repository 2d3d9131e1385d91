"""uvicorn's h11 protocol with a deadline on each request head.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not one that has sent part of
a request head: its keep-alive timer stops at the first byte, and nothing else runs until the head is
complete, so a client can hold a connection (a file descriptor, a slot under ``limit_concurrency``)
for ever by sending half a header. Here a timer runs from the moment the server waits for a head (the
connection opened, or the previous response ended) until h11 has parsed a whole one; if it fires, the
connection is closed. It is never reset by incoming bytes, so dripping a header byte by byte does
not extend it. h11 does the parsing; this only watches its state.

The server pins this class (``uvicorn.Config(http=...)``) rather than letting ``http="auto"`` pick
httptools when installed: the timer reads h11's connection state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutH11Protocol(H11Protocol):
    """``H11Protocol`` that closes a connection whose request head is not complete ``head_timeout_s``
    after the server started waiting for it (a subclass from ``head_timeout_protocol`` sets the time)."""

    head_timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Arm the timer while h11 waits for a request head (``their_state`` IDLE); disarm it once one is in."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
        elif not waiting:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("closing a connection whose request head did not arrive within %.1f s", self.head_timeout_s)
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:  # (h11 in its ERROR state refuses it; the transport still closes)
                pass
            self.transport.close()


def head_timeout_protocol(head_timeout_s: float) -> type[HeadTimeoutH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with this head deadline (uvicorn builds one per connection)."""
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,), {"head_timeout_s": head_timeout_s})
