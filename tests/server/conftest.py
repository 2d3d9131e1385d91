"""Fixtures for the server tests: the default model's tokenizer and servers over a scripted engine."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from servelm.server.app import ObserverProxy, build_app
from servelm.server.async_engine import AsyncEngine
from srv_harness import FakeEngine, ServerThread


@pytest.fixture(scope="session")
def server_tokenizer(default_model_dir: Any) -> Any:
    from servelm.runtime.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


class RecordingObserver:
    def __init__(self) -> None:
        self.rejected = 0
        self.steps = 0

    def on_step(self, stats: Any) -> None:
        self.steps += 1

    def on_request_finished(self, stats: Any) -> None:
        pass

    def on_request_rejected(self) -> None:
        self.rejected += 1


def _make(
    tokenizer: Any,
    started: list[ServerThread],
    api_key: str | None = None,
    drain_timeout_s: float = 5.0,
    max_request_bytes: int | None = None,
    **engine_kwargs: Any,
):
    engine = FakeEngine(tokenizer, **engine_kwargs)
    observer = RecordingObserver()
    ae = AsyncEngine(engine, observer=ObserverProxy(observer))
    ae.test_observer = observer  # type: ignore[attr-defined]
    app = build_app(ae, api_key=api_key, drain_timeout_s=drain_timeout_s, max_request_bytes=max_request_bytes)
    srv = ServerThread(app).start()
    started.append(srv)
    return srv, engine, ae


@pytest.fixture
def fake_server(server_tokenizer: Any) -> Iterator[Callable[..., tuple[ServerThread, FakeEngine, AsyncEngine]]]:
    """``fake_server(api_key=None, drain_timeout_s=5, **engine_kwargs)`` -> (running server, engine, bridge)."""
    started: list[ServerThread] = []
    yield lambda **kw: _make(server_tokenizer, started, **kw)
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def shared_fake_server(server_tokenizer: Any) -> Iterator[tuple[ServerThread, FakeEngine, AsyncEngine]]:
    """One default fake server for a whole module (tests that do not change its state)."""
    started: list[ServerThread] = []
    yield _make(server_tokenizer, started)
    for srv in started:
        srv.stop()
