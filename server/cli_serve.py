"""``servelm serve``'s HTTP side: the uvicorn server (its drain, its request bounds) and serving an app in
front of an engine; also the main of an API process after the first (``--api-server-count``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from servelm.server.reasoning.parsers import PARSERS as REASONING_PARSERS
from servelm.server.tool_parsers import PARSERS as TOOL_PARSERS

log = logging.getLogger("servelm")

# After the drain deadline, the handlers of the requests it cut get this long to write their error
# before uvicorn cancels them (its own graceful timeout, the last resort, is the deadline plus this).
SHUTDOWN_FLUSH_S = 2.0


def make_uvicorn_server(app: Any, args: argparse.Namespace, on_exit: Callable[[], None]) -> Any:

    import uvicorn

    from servelm.server.http_protocol import guarded_protocol

    class _Server(uvicorn.Server):
        """uvicorn's server, starting the engine bridge's drain (refuse new requests, deadline for the
        running ones) as soon as a signal lands, and listening until the drain ends."""

        # Awaited on shutdown before uvicorn closes its listener (``run_serve`` sets the bridge's).
        drained: Callable[[], Awaitable[None]] | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            # uvicorn closes its listener first; keeping it open while ``drained`` runs lets requests
            # that arrive during the drain get its 503 (with Retry-After) rather than a refused connection.
            loop = asyncio.get_running_loop()
            started = loop.time()
            if self.drained is not None and not self.force_exit:
                drain, ticks = asyncio.ensure_future(self.drained()), 0
                while not drain.done() and not self.force_exit:
                    await asyncio.wait({drain}, timeout=0.1)
                    ticks += 1
                    await self.on_tick(ticks)  # (keeps the Date header current, as uvicorn's main loop did)
            # uvicorn's last resort stays the deadline plus the flush, counted from the signal.
            graceful = self.config.timeout_graceful_shutdown
            if graceful is not None:
                # uvicorn declares it int, and uses it as a timeout: a float is what it needs here.
                remaining = max(SHUTDOWN_FLUSH_S, graceful - (loop.time() - started))
                self.config.timeout_graceful_shutdown = remaining  # type: ignore[assignment]
            await super().shutdown(sockets)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    log.info("servelm listening on http://%s:%d (OpenAI API under /v1)", host, port)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=math.ceil(max(0.0, args.drain_timeout) + SHUTDOWN_FLUSH_S),
        http=guarded_protocol(args.header_timeout, args.body_timeout),
        # uvicorn refuses a request when the connections, its own included, reach the limit.
        limit_concurrency=args.max_connections + 1,
        lifespan="on",
    )
    return _Server(config)


def run_api_process(args: argparse.Namespace, address: Any, info: Any, sock: Any) -> None:
    """An API process after the first (``--api-server-count``): serves HTTP on the shared port in front
    of the engine core the first one started."""
    from servelm.server.data_parallel import CoresAddress, join_data_parallel
    from servelm.server.engine_process import join_engine_core

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if isinstance(address, CoresAddress):  # --data-parallel-size: every engine core
        async_engine = join_data_parallel(address)
    else:
        async_engine = join_engine_core(address, info)
    chat_template = None
    if args.chat_template is not None:
        from servelm.server.chat_template import load_chat_template

        chat_template = load_chat_template(args.chat_template)  # (checked by the first API process)
    sys.exit(serve_api(args, async_engine, chat_template, None, make_uvicorn_server, sock))


def serve_api(
    args: argparse.Namespace,
    async_engine: Any,
    chat_template: str | None,
    metrics_registry: Any,
    make_server: Callable[..., Any],
    sock: Any = None,
    also_on_stop: Callable[[], None] | None = None,
) -> int:
    """Serve HTTP in front of ``async_engine`` until a signal drains and stops it; the exit status.
    ``sock``: a socket bound already (``--api-server-count``); ``also_on_stop``: called on the signal too."""
    from servelm.runtime.platform import platform_of, resolve_device
    from servelm.server.app import build_app

    interval = platform_of(resolve_device(async_engine.info.device)).gil_switch_interval
    if interval is not None:
        sys.setswitchinterval(interval)
    app = build_app(
        async_engine,
        api_key=args.api_key or None,
        metrics_registry=metrics_registry,
        drain_timeout_s=args.drain_timeout,
        max_request_bytes=args.max_request_bytes,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        playground=args.playground,
    )
    app.state.serving.reasoning_parser = REASONING_PARSERS[args.reasoning_parser] if args.reasoning_parser else None
    app.state.serving.tool_parser = TOOL_PARSERS[args.tool_call_parser] if args.tool_call_parser else None
    app.state.serving.auto_tool_choice = args.enable_auto_tool_choice
    app.state.serving.split_special_tokens_in_content = args.split_special_tokens_in_content
    if chat_template is None and not args.chat_template_as_stored:
        from servelm.server.cli_models import corrected_own_template

        chat_template = corrected_own_template(app.state.serving)
    app.state.serving.chat_template = chat_template
    app.state.serving.trust_request_chat_template = args.trust_request_chat_template

    def on_stop() -> None:
        async_engine.begin_drain(args.drain_timeout)
        if also_on_stop is not None:
            also_on_stop()

    server = make_server(app, args, on_stop)
    server.drained = lambda: async_engine.drained(args.drain_timeout)
    from servelm.server.cli_models import serve_until_stopped

    try:
        return serve_until_stopped(server, lambda: async_engine.dead_reason, sock)
    finally:
        async_engine.close()
