"""Liveness (``/live``) apart from readiness (``/health``): what Kubernetes' probes read.

A draining server is alive but not ready (the kubelet must not restart it while it finishes its
requests; routers and Services must stop sending it new ones); a dead engine is neither.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from srv_harness import assert_error

http = httpx.Client(timeout=30)


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_live_and_ready_while_serving_need_no_api_key(fake_server: Any) -> None:
    srv, _, _ = fake_server(api_key="sekret")
    assert http.get(f"{srv.url}/v1/models").status_code == 401  # the key is enforced...
    for path in ("/live", "/health"):  # ...but not on the probes
        r = http.get(f"{srv.url}{path}")
        assert r.status_code == 200 and r.json() == {"status": "ok"}, (path, r.text)
        assert http.head(f"{srv.url}{path}").status_code == 200, path


def test_draining_is_alive_but_not_ready(fake_server: Any) -> None:
    srv, eng, ae = fake_server(step_time=0.01)
    got: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: got.update(r=http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 60}))
    )
    t.start()
    _wait(lambda: eng.steps > 3)
    ae.stop_accepting()  # what the SIGTERM handler does first
    live = http.get(f"{srv.url}/live")
    assert live.status_code == 200 and live.json() == {"status": "draining"}
    assert http.head(f"{srv.url}/live").status_code == 200
    assert_error(http.get(f"{srv.url}/health"), 503, code="shutting_down")
    assert http.head(f"{srv.url}/health").status_code == 503
    t.join(10)
    assert got["r"].status_code == 200  # the request running at the signal still finished


def test_dead_engine_is_neither_alive_nor_ready(fake_server: Any) -> None:
    srv, eng, ae = fake_server(step_time=0.01)
    t = threading.Thread(target=lambda: http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 200}))
    t.start()
    _wait(lambda: eng.steps > 2)
    eng.crash = True
    t.join(10)
    _wait(lambda: not ae.is_alive)
    assert_error(http.get(f"{srv.url}/live"), 503, code="engine_dead")
    assert_error(http.get(f"{srv.url}/health"), 503, code="engine_dead")


def test_probes_are_documented_with_their_503(fake_server: Any) -> None:
    srv, _, _ = fake_server()
    paths = http.get(f"{srv.url}/openapi.json").json()["paths"]
    # GET only (HEAD is for load balancers); both documented with their 503.
    assert set(paths["/live"]) == {"get"} and "503" in paths["/live"]["get"]["responses"]
    assert set(paths["/health"]) == {"get"} and "503" in paths["/health"]["get"]["responses"]
