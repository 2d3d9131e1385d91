"""The playground: a chat page for people, served at ``/`` and ``/playground`` from static files
shipped in the package (``server/playground/``). The page only calls the public API (``/v1/*`` with
the key the user types, ``/metrics``); it adds no endpoint of its own beyond its files."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

PLAYGROUND_DIR = Path(__file__).with_name("playground")
# Each file the page is made of, with its type: a fixed list, so no request path ever reaches the
# file system.
ASSET_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "metrics.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "store.js": "text/javascript; charset=utf-8",
}
# Scripts and styles only from the page's own files (nothing inline, so injected markup cannot run),
# requests only to this server, no framing, no plugins, no forms posting elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def wants_json(request: Request) -> bool:
    """A client that asks for JSON and not HTML (an API client probing ``/``) keeps the JSON answer
    ``/`` gave before the page existed."""
    accept = request.headers.get("accept", "").lower()
    return "application/json" in accept and "text/html" not in accept


def install_playground(app: FastAPI) -> None:
    """Serve the page at ``/`` and ``/playground``, and its files at ``/playground/NAME``."""
    assets = {name: (PLAYGROUND_DIR / name).read_bytes() for name in ASSET_TYPES}  # a missing file fails at start-up

    def asset(name: str) -> Response:
        return Response(assets[name], media_type=None, headers={"Content-Type": ASSET_TYPES[name], **SECURITY_HEADERS})

    @app.get("/", include_in_schema=False)
    @app.get("/playground", include_in_schema=False)
    async def page(request: Request) -> Response:
        if wants_json(request):
            raise StarletteHTTPException(404)
        return asset("index.html")

    @app.get("/playground/{name}", include_in_schema=False)
    async def playground_file(name: str) -> Response:
        if name not in assets:
            raise StarletteHTTPException(404)
        return asset(name)


__all__ = ["ASSET_TYPES", "CONTENT_SECURITY_POLICY", "install_playground"]
