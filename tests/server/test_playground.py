"""The playground's HTTP side, without a browser: the page and its files, their types and the
Content-Security-Policy, ``--no-playground``, and the API's auth left as it was.
(tests/server/test_playground_browser.py drives the page itself in Chromium.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomllib
from srv_harness import FakeEngine, ServerThread

from servelm.server.app import build_app
from servelm.server.async_engine import AsyncEngine
from servelm.server.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
PLAYGROUND = REPO / "server" / "playground"
KEY = "sk-playground-test"


@pytest.fixture(scope="module")
def servers(server_tokenizer: Any) -> Iterator[dict[str, str]]:
    """Three apps over scripted engines: the default, one with an API key, one with --no-playground."""
    started = {
        name: ServerThread(build_app(AsyncEngine(FakeEngine(server_tokenizer)), **kw)).start()
        for name, kw in {"default": {}, "keyed": {"api_key": KEY}, "off": {"playground": False}}.items()
    }
    yield {name: srv.url for name, srv in started.items()}
    for srv in started.values():
        srv.stop()


class PageParts(HTMLParser):
    """The page's tags and attributes, for what CSP would refuse (inline code and styles)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.script_bodies: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.script_bodies.append(data)


def _csp(response: httpx.Response) -> dict[str, str]:
    policy = response.headers["content-security-policy"]
    return {d.split()[0]: d.partition(" ")[2] for d in (p.strip() for p in policy.split(";")) if d}


@pytest.mark.parametrize("path", ["/", "/playground"])
def test_the_page_is_html_under_a_strict_content_security_policy(servers: dict[str, str], path: str) -> None:
    r = httpx.get(servers["default"] + path, headers={"Accept": "text/html,*/*;q=0.8"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    csp = _csp(r)
    assert csp["default-src"] == "'self'" and csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
    assert csp["object-src"] == "'none'" and csp["frame-ancestors"] == "'none'" and csp["base-uri"] == "'none'"
    assert "unsafe" not in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    parts = PageParts()
    parts.feed(r.text)
    # The policy forbids inline code and styles, so the page must not need any.
    assert not parts.script_bodies
    assert not [(t, a) for t, a in parts.tags if "style" in a or any(k.startswith("on") for k in a)]
    assert not [t for t, _ in parts.tags if t == "style"]
    scripts = [a["src"] for t, a in parts.tags if t == "script"]
    assert scripts == ["playground/app.js"]


def test_curl_gets_the_page_too(servers: dict[str, str]) -> None:
    r = httpx.get(servers["default"] + "/", headers={"Accept": "*/*"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")


def _referenced_files(servers: dict[str, str]) -> set[str]:
    """Every file the page loads: its script and stylesheet, and each module's imports."""
    parts = PageParts()
    parts.feed(httpx.get(servers["default"] + "/").text)
    todo = [a.get("src") or a.get("href") for t, a in parts.tags if t in ("script", "link") and a.get("rel") != "icon"]
    seen: set[str] = set()
    while todo:
        ref = str(todo.pop())
        name = ref.removeprefix("playground/").removeprefix("./")
        if name in seen:
            continue
        seen.add(name)
        if name.endswith(".js"):
            todo += re.findall(r"""^import .* from "(\./[\w.]+)";$""", (PLAYGROUND / name).read_text(), re.MULTILINE)
    return seen


def test_every_file_the_page_loads_is_served_with_its_type_and_the_policy(servers: dict[str, str]) -> None:
    names = _referenced_files(servers)
    assert {"app.js", "style.css", "markdown.js", "api.js", "metrics.js"} <= names
    # Every file in the folder is one the page uses (nothing shipped and unserved, nothing served unused).
    assert names | {"index.html"} == {p.name for p in PLAYGROUND.iterdir()} - {"LICENSE"}
    want = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
    for name in names:
        r = httpx.get(f"{servers['default']}/playground/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"] == want[Path(name).suffix], name
        assert r.content == (PLAYGROUND / name).read_bytes()
        assert "script-src 'self'" in r.headers["content-security-policy"]


@pytest.mark.parametrize("path", ["/playground/nope.js", "/playground/..%2Fapp.py", "/playground/../app.py"])
def test_anything_else_under_playground_is_the_api_404(servers: dict[str, str], path: str) -> None:
    r = httpx.get(servers["default"] + path)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


def test_a_json_client_still_gets_the_json_answer_at_the_root(servers: dict[str, str]) -> None:
    old = httpx.get(servers["off"] + "/", headers={"Accept": "application/json"})
    new = httpx.get(servers["default"] + "/", headers={"Accept": "application/json"})
    assert old.status_code == new.status_code == 404
    assert old.json() == new.json()
    assert old.json()["error"]["message"] == "Invalid URL (GET /)"


@pytest.mark.parametrize("path", ["/", "/playground", "/playground/app.js", "/playground/index.html"])
def test_no_playground_serves_nothing_of_it(servers: dict[str, str], path: str) -> None:
    r = httpx.get(servers["off"] + path, headers={"Accept": "text/html"})
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/json"
    assert "content-security-policy" not in r.headers


def test_the_page_is_open_but_the_api_still_wants_the_key(servers: dict[str, str]) -> None:
    url = servers["keyed"]
    assert httpx.get(url + "/").status_code == 200
    assert httpx.get(url + "/playground/app.js").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401


def test_the_cli_flag_turns_the_page_off() -> None:
    assert build_parser().parse_args(["serve"]).playground is True
    assert build_parser().parse_args(["serve", "--no-playground"]).playground is False


def test_the_wheel_ships_every_page_file() -> None:
    """pyproject's package data covers the folder, so an installed wheel serves the page
    (tests/test_wheel.py checks one file is in a built wheel)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["servelm.server"]
    for path in PLAYGROUND.iterdir():
        assert any(fnmatch(f"playground/{path.name}", pattern) for pattern in data), path.name
