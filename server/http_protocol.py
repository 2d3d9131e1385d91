"""uvicorn's h11 protocol with deadlines on each request head and body, and probes answered at the
connection limit.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not one that has sent part of
a request: its keep-alive timer stops at the first byte, and nothing else runs until the request is
complete, so a client can hold a connection (a file descriptor, a slot under ``limit_concurrency``)
for ever by sending half a header, or a whole head and then a body byte every few seconds. Here two
timers watch h11's state:

- the head timer runs from the moment the server waits for a head (the connection opened, or the
  previous response ended) until h11 has parsed a whole one; if it fires, the connection is closed;
- the body timer runs from a complete head until h11 has the whole body; if it fires, the client gets
  a 408 in the API's error shape when no response has started, and the connection is closed.

Neither is reset by incoming bytes, so dripping does not extend them. h11 does the parsing; this only
watches its state.

At ``limit_concurrency`` uvicorn answers every request with a plain 503, so a client holding the
connections would also turn ``/health`` into a 503 and get a healthy pod restarted. Body-less
``GET``/``HEAD`` requests for the probe paths are served there anyway, and their connection is closed
after the answer, so the exemption holds no connection for longer than one request.

The server pins this class (``uvicorn.Config(http=...)``) rather than letting ``http="auto"`` pick
httptools when installed: the timers read h11's connection state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from servelm.server.errors import error_response, request_timeout

# Answered beyond the connection limit: readiness and liveness must report the engine, not who holds
# the sockets, and a scrape is how an operator sees that someone does.
PROBE_PATHS = frozenset({"/health", "/live", "/metrics"})


class GuardedH11Protocol(H11Protocol):
    """``H11Protocol`` that closes a connection whose request head is not complete ``head_timeout_s``
    after the server started waiting for it, or whose body is not complete ``body_timeout_s`` after its
    head, and that serves probes beyond ``limit_concurrency`` (``guarded_protocol`` sets the times)."""

    head_timeout_s: float
    body_timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._limit: int | None = None
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_cycle: RequestResponseCycle | None = None  # the request the body timer is for

    @property
    def limit_concurrency(self) -> int | None:
        """The bound uvicorn's ``handle_events`` checks right after parsing a request head (``self.scope``
        is that request's); none for a probe, whose answer then closes the connection if at the bound."""
        if self._limit is None or not self._is_probe():
            return self._limit
        if len(self.connections) >= self._limit or len(self.tasks) >= self._limit:
            self.headers.append(CLOSE_HEADER)  # (the scope's list: uvicorn echoes it and closes after the answer)
        return None

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._limit = value

    def _is_probe(self) -> bool:
        """A body-less GET or HEAD for a probe path: answered at once, from the process's own state."""
        scope = self.scope
        if scope is None or scope["method"] not in ("GET", "HEAD") or scope["path"] not in PROBE_PATHS:
            return False
        for name, value in scope["headers"]:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
                return False
        return True

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Arm the head timer while h11 waits for a request head (``their_state`` IDLE), the body timer
        while it reads a request's body (SEND_BODY); disarm each once its part is in."""
        open_ = not self.transport.is_closing()
        state = self.conn.their_state
        if state is h11.IDLE and open_:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
        else:
            self._cancel_head_timer()
        if state is h11.SEND_BODY and open_:
            if self._body_cycle is not self.cycle:  # a new request (pipelined ones included): its own clock
                self._cancel_body_timer()
                self._body_cycle = self.cycle
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)
        else:
            self._cancel_body_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body_cycle = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug(
                "closing a connection whose request head did not arrive within %.1f s", self.head_timeout_s
            )
            self._close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle, self._body_cycle = self._body_cycle, None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing() or cycle is not self.cycle:
            return
        self.logger.debug("closing a connection whose request body did not arrive within %.1f s", self.body_timeout_s)
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            self._send_408(cycle)
        if cycle is not None:
            # The app, waiting in ``receive``, gets ``http.disconnect`` and its answer is dropped, as
            # when the client leaves.
            cycle.disconnected = True
            cycle.message_event.set()
        self._close()

    def _send_408(self, cycle: RequestResponseCycle) -> None:
        """The API's error for ``cycle``'s path (OpenAI's shape, Anthropic's on /v1/messages), then close."""
        response = error_response(request_timeout(self.body_timeout_s), cycle.scope["path"])
        headers = [*self.server_state.default_headers, *response.raw_headers, CLOSE_HEADER]
        if cycle.access_log:
            scope = cycle.scope
            cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                     get_path_with_query_string(scope), scope["http_version"], response.status_code)  # fmt: skip
        cycle.response_started = cycle.response_complete = True
        head = h11.Response(status_code=response.status_code, headers=headers, reason=b"Request Timeout")
        for event in (head, h11.Data(data=bytes(response.body)), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))

    def _close(self) -> None:
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # (h11 in its ERROR state refuses it; the transport still closes)
            pass
        self.transport.close()


def guarded_protocol(head_timeout_s: float, body_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with these deadlines (uvicorn builds one per connection)."""
    times = {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), times)
