"""Fixtures for the server tests: the default model's tokenizer and servers over a scripted engine."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from srv_harness import FakeEngine, ServerThread

from servelm.server.app import ObserverProxy, build_app
from servelm.server.async_engine import AsyncEngine


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
    ae.test_observer = observer
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


@pytest.fixture
def serve_app(monkeypatch: pytest.MonkeyPatch, server_tokenizer: Any) -> Callable[..., Any]:
    """``serve_app(*argv, status=0)``: run ``servelm serve --port 0 --engine-in-process ARGV`` with the
    engine, metrics and uvicorn faked (the fake engine steps in this process), and return the app it built (what the flags reached); None when it is to exit with a
    non-zero ``status`` (a refused start)."""
    import servelm.scheduler.engine
    import servelm.server.app
    import servelm.server.cli as cli

    apps: list[Any] = []

    class NoServer:
        started = True

        def run(self) -> None:
            pass

    def no_server(app: Any, args: Any, on_stop: Any) -> NoServer:
        apps.append(app)
        return NoServer()

    monkeypatch.setattr(
        servelm.scheduler.engine, "Engine", lambda config, observer=None, **_: FakeEngine(server_tokenizer)
    )
    monkeypatch.setattr(servelm.server.app, "create_prometheus_observer", lambda engine: None)
    monkeypatch.setattr(cli, "_make_uvicorn_server", no_server)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # keep the test session's handlers

    def run(*argv: str, status: int = 0) -> Any:
        args = cli.build_parser().parse_args(["serve", "--port", "0", "--engine-in-process", *argv])
        assert args.func(args) == status
        return apps[-1] if status == 0 else None

    return run


@pytest.fixture(scope="session")
def marker_tokenizer() -> Any:
    """The default model's byte-level BPE with every family's markers as single added tokens."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from servelm.runtime.model_files import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    markers = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call|>"]
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    return tok
