"""What a generation request says to the server rather than to the model: the top-level fields it
carries that this server ignores, and the client's id for it.

Ignored fields are logged once per name (a router adds the same ones to every request) and named in
the ``x-servelm-ignored-fields`` response header, so a client can see what it asked for and did not
get. The client's id (the ``X-Request-Id`` header, else vLLM's ``request_id`` body field) is logged
beside the server's own id and echoed in ``X-Request-Id``, as vLLM does; the response ``id`` stays
the server's own (``cmpl-...``): engine ids must be unique, and a client's need not be.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.server.protocol import ServedRequest

log = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-servelm-ignored-fields"
REQUEST_ID_HEADER = "x-request-id"
# Past this many distinct names, ignored fields are no longer logged: a client inventing names must not grow the set.
MAX_LOGGED_NAMES = 1024
# The header names at most this many fields (a body may carry thousands).
MAX_LISTED_NAMES = 32
_PLAIN_NAME = re.compile(r"[!-+\--~]{1,128}")  # printable ASCII without a comma: safe in a header and a log line
_PRINTABLE = re.compile(r"[ -~]+")

# Keys in the request scope's state through which a handler tells ``RequestHeadersMiddleware`` what to add.
_STATE_IGNORED = "servelm_ignored_fields"
_STATE_REQUEST_ID = "servelm_request_id"


def _shown(name: str) -> str:
    """A field name as a header value and a log line can carry it (escaped when it is not plain ASCII)."""
    if _PLAIN_NAME.fullmatch(name):
        return name
    return ascii(name[:128])[1:-1].replace(",", "\\x2c").replace(" ", "\\x20")


def _header_text(text: str) -> str:
    """``text`` as a header value: printable ASCII as it is, anything else escaped."""
    return text if _PRINTABLE.fullmatch(text) else ascii(text)[1:-1]


def ignored_fields_header(names: list[str]) -> str:
    shown = [_shown(n) for n in names[:MAX_LISTED_NAMES]]
    if len(names) > MAX_LISTED_NAMES:
        shown.append(f"+{len(names) - MAX_LISTED_NAMES} more")
    return ", ".join(shown)


class FieldNotices:
    """One server's record of the ignored field names it has logged (each is logged once)."""

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def note(self, raw: Request, req: ServedRequest, request_id: str, surface: str) -> str | None:
        """Log what ``req`` carries that is ignored (new names only) and the client's id next to
        ``request_id``, and hand both to ``RequestHeadersMiddleware``; the client's id, if any."""
        ignored = sorted(req.model_extra or ())
        new = [n for n in ignored if n not in self.logged]
        if new and len(self.logged) < MAX_LOGGED_NAMES:
            self.logged.update(new)
            log.warning(
                "%s: ignoring request field(s) this server does not implement: %s (each name is logged once)",
                surface,
                ", ".join(_shown(n) for n in new),
            )
        client_id = raw.headers.get(REQUEST_ID_HEADER) or req.request_id
        if client_id:
            log.info("%s: request %s has the client's request id %r", surface, request_id, client_id[:512])
        state = raw.scope.setdefault("state", {})
        state[_STATE_IGNORED] = ignored
        state[_STATE_REQUEST_ID] = client_id or request_id
        return client_id


class RequestHeadersMiddleware:
    """Adds ``X-Request-Id`` and ``x-servelm-ignored-fields`` to ``/v1`` responses, streamed ones and
    errors included (pure ASGI: the headers go out with the response start, nothing per chunk)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        # Created here so the handler's scope, a shallow copy made further in, shares this dict.
        state: dict[str, Any] = scope.setdefault("state", {})
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                rid = state.get(_STATE_REQUEST_ID)
                if given is not None:
                    headers.append((REQUEST_ID_HEADER.encode(), given))
                elif rid:
                    headers.append((REQUEST_ID_HEADER.encode(), _header_text(rid).encode()))
                if state.get(_STATE_IGNORED):
                    headers.append(
                        (IGNORED_FIELDS_HEADER.encode(), ignored_fields_header(state[_STATE_IGNORED]).encode())
                    )
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
