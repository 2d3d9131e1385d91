"""The playground in a real browser: headless Chromium from the system's packages, driven by
Playwright, against ``servelm serve --api-key --quantization auto`` (what ``make serve`` runs) on the
default model. It chats and sees tokens stream in, stops a long answer and sees the server free it,
shows markup from the model as text, keeps conversations across a reload, fits a phone, and leaves a
screenshot in ``$SERVELM_ARTIFACTS``."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proc_harness import REPO, ServeProcess

pytestmark = pytest.mark.slow  # a servelm serve process and a browser

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
CHROMIUM = os.environ.get("SERVELM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    pytest.skip("no chromium here: `apt-get install chromium` (.ci/run does so as root)", allow_module_level=True)

KEY = "sk-browser-test"
LORA = "tiny-adapter"
# A bound for one short answer, generous for a machine busy with other work (they take seconds alone).
GENERATION_TIMEOUT_MS = 240_000
ARTIFACTS = Path(os.environ.get("SERVELM_ARTIFACTS") or REPO / "artifacts")
# The model is made to write this exactly (a regex constraint), so what reaches the page is known.
MARKUP = "<script>pwned=1</script><img src=x onerror=pwned=2> **bold** `<b>x</b>`"


def _regex_for(text: str) -> str:
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def _buckets(text: str, name: str) -> list[tuple[float, float]]:
    found = re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.MULTILINE)
    return sorted((float(le), float(count)) for le, count in found)


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile: linear inside the bucket the rank falls in, from 0 below the first."""
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            return lower if upper == float("inf") else lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError(buckets)


def _shown(seconds: float) -> str:
    return f"{int(seconds * 1000 + 0.5)} ms" if seconds < 1 else f"{seconds:.2f} s"


def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from lora_files import save_lora_adapter

    adapter = save_lora_adapter(
        default_model_dir, tmp_path_factory.mktemp("lora") / "a", seed=0, r=4, target_modules=("q_proj", "v_proj")
    )
    args = ("--api-key", KEY, "--quantization", "auto", "--kv-cache-memory", "128MiB", "--max-model-len", "2048",
            "--lora-modules", f"{LORA}={adapter}", "--no-access-log")  # fmt: skip
    with ServeProcess(*args) as srv:
        yield srv


@pytest.fixture(scope="module")
def page(server: ServeProcess) -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM)
        context = browser.new_context(viewport={"width": 1200, "height": 760})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
        page.goto(server.url + "/")
        yield page
        browser.close()
        assert not errors, errors  # no script error, and nothing the CSP refused


def _new_chat(page: Any, *, max_tokens: int, extra: str = "", temperature: str = "0") -> None:
    page.click("#new-chat")
    page.fill("#temperature", temperature)
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#extra", extra)
    page.dispatch_event("#extra", "change")


def _send(page: Any, text: str) -> Any:
    page.fill("#prompt", text)
    page.click("#send")
    answer = page.locator(".msg.assistant").last
    answer.wait_for()
    return answer


def test_the_key_unlocks_the_models_and_a_chat_streams_with_its_speed(page: Any, server: ServeProcess) -> None:
    sync_api.expect(page.locator("#status")).to_contain_text("API key")  # /v1/models said 401
    page.fill("#api-key", KEY)
    page.locator("#api-key").blur()
    options = page.locator("#model option")
    sync_api.expect(options).to_have_count(2)
    base = options.first.get_attribute("value")
    sync_api.expect(options.last).to_have_text(f"{LORA} (LoRA on {base})")
    _new_chat(page, max_tokens=32)
    # Every text the answer shows while it streams, recorded in the page as the DOM changes.
    page.evaluate(
        """() => { window.seen = new Set(); new MutationObserver(() => {
            const a = [...document.querySelectorAll('.msg.assistant')].pop();
            if (a && a.dataset.state === 'streaming' && a.querySelector('.content').textContent) window.seen.add(a.querySelector('.content').textContent);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true, attributes: true}); }"""
    )
    question = "What is the capital of France?"
    answer = _send(page, question)
    sync_api.expect(answer).to_have_attribute("data-state", "done", timeout=GENERATION_TIMEOUT_MS)
    assert page.evaluate("window.seen.size") >= 2, "the answer did not appear a piece at a time"
    speed = answer.locator(".speed").inner_text()
    m = re.fullmatch(
        r"TTFT \d+ ms · [\d.]+ tok/s · (\d+) prompt \+ (\d+) completion tokens · finish: (stop|length)", speed
    )
    assert m, speed
    # The same request without the page: the same greedy tokens.
    ref = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=GENERATION_TIMEOUT_MS / 1000,
        json={"messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0, "top_p": 1},
    ).json()
    assert (int(m[1]), int(m[2])) == (ref["usage"]["prompt_tokens"], ref["usage"]["completion_tokens"])
    shown = " ".join(answer.locator(".content").inner_text().split())
    assert shown == " ".join(ref["choices"][0]["message"]["content"].split())
    # The server panel (it scrapes /metrics every 2 s) shows the percentiles of both requests, as
    # Prometheus's histogram_quantile computes them from the buckets.
    text = httpx.get(f"{server.url}/metrics").text
    for cell, name in (
        ("#m-ttft", "servelm_time_to_first_token_seconds"),
        ("#m-tpot", "servelm_time_per_output_token_seconds"),
    ):
        buckets = _buckets(text, name)
        assert buckets[-1][1] == 2, (name, buckets)  # the page's answer and the reference
        want = " / ".join(_shown(_histogram_quantile(q, buckets)) for q in (0.5, 0.9, 0.99))
        sync_api.expect(page.locator(cell)).to_have_text(want, timeout=10_000)
    sync_api.expect(page.locator("#m-running")).to_have_text("0")


def test_stop_ends_a_long_answer_and_the_server_frees_it(page: Any, server: ServeProcess) -> None:
    """On the LoRA adapter chosen in the model list (the server reports it running)."""
    _new_chat(page, max_tokens=1500, extra='{"ignore_eos": true}')
    page.select_option("#model", LORA)
    answer = _send(page, "Count from one to a thousand.")
    sync_api.expect(answer.locator(".content")).not_to_be_empty(timeout=GENERATION_TIMEOUT_MS)
    assert _metric(server.url, "servelm_num_requests_running") == 1
    assert re.search(
        rf'servelm_lora_requests_info{{[^}}]*running_lora_adapters="{LORA}"', httpx.get(f"{server.url}/metrics").text
    )
    sync_api.expect(page.locator("#m-running")).to_have_text("1", timeout=10_000)
    page.click("#stop")
    sync_api.expect(answer).to_have_attribute("data-state", "stopped")
    sync_api.expect(answer.locator(".speed")).to_contain_text("stopped")
    _until(lambda: _metric(server.url, "servelm_num_requests_running") == 0, 10, "the server to free the request")
    assert _metric(server.url, "servelm_kv_cache_usage_perc") == 0
    assert re.search(
        r'servelm_request_failure_total\{[^}]*reason="aborted"[^}]*\} 1\.0', httpx.get(f"{server.url}/metrics").text
    )
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    sync_api.expect(page.locator("#m-running")).to_have_text("0", timeout=10_000)
    page.select_option("#model", index=0)


def test_markup_from_the_model_is_shown_as_text(page: Any) -> None:
    """In raw completion mode (/v1/completions), under a regex that makes the model write MARKUP."""
    _new_chat(page, max_tokens=80, extra=json.dumps({"structured_outputs": {"regex": _regex_for(MARKUP)}}))
    page.check('input[name="mode"][value="completion"]')
    answer = _send(page, "Some HTML:")
    sync_api.expect(answer).to_have_attribute("data-state", "done", timeout=GENERATION_TIMEOUT_MS)
    sync_api.expect(answer.locator(".speed")).to_contain_text("finish: stop")

    def check() -> None:
        content = answer.locator(".content")
        assert content.inner_text() == "<script>pwned=1</script><img src=x onerror=pwned=2> bold <b>x</b>"
        # The markdown became elements; the markup inside it stayed text.
        assert content.locator("strong").inner_text() == "bold"
        assert content.locator("code").inner_text() == "<b>x</b>"
        assert page.locator("#messages script, #messages img, #messages b").count() == 0
        assert page.evaluate("window.pwned") is None

    check()
    page.reload()  # the conversation comes back from localStorage, still as text
    answer = page.locator(".msg.assistant").last
    check()
    page.check('input[name="mode"][value="chat"]')


def test_the_json_schema_example_answers_in_that_schema(page: Any) -> None:
    _new_chat(page, max_tokens=80)
    page.fill("#prompt", "")
    page.click('[data-example="json_schema"]')  # fills the extra fields and the prompt
    schema = json.loads(page.input_value("#extra"))["response_format"]["json_schema"]["schema"]
    page.click("#send")
    answer = page.locator(".msg.assistant").last
    sync_api.expect(answer).to_have_attribute("data-state", "done", timeout=GENERATION_TIMEOUT_MS)
    value = json.loads(answer.locator(".content").inner_text())
    assert set(value) == set(schema["required"]) and isinstance(value["population"], int), value


MARKDOWN_DOCS = [
    "Hello **bold** and *it*, _under_ and __strong__ with `<b>x</b>` & more.\na second line",
    "text <script>alert(1)</script> <img src=x onerror=alert(1)>",
    "- one\n- two `c`\n\n1. a\n2. **b**",
    "3. three\n\n4. four\n\nafter the list",
    "```\n<img src=x onerror=alert(1)>\n  indented *not italic*\n```\nafter",
]


def _commonmark(text: str) -> str:
    """markdown-it-py's CommonMark HTML (raw HTML off), in the form a browser serializes our DOM."""
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark", {"html": False}).render(text)
    html = re.sub(r">\n<", "><", html).strip().replace("&quot;", '"').replace("\n</code></pre>", "</code></pre>")
    return re.sub(r"<li><p>(.*?)</p></li>", r"<li>\1</li>", html)  # a loose list's items: same text


def test_the_markdown_renderer_agrees_with_commonmark(page: Any) -> None:
    got = page.evaluate(
        """async (docs) => { const md = await import("./playground/markdown.js");
            return docs.map((d) => { const div = document.createElement("div"); div.append(md.renderMarkdown(d)); return div.innerHTML; }); }""",
        MARKDOWN_DOCS,
    )
    assert got == [_commonmark(d) for d in MARKDOWN_DOCS]


def test_it_fits_a_phone_and_leaves_a_screenshot(page: Any) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator(".conversations button.open").nth(2).click()  # the France chat
    page.screenshot(path=str(ARTIFACTS / "playground.png"))
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), (
        "the page scrolls sideways on a phone"
    )
    for selector in ("#prompt", "#send", "#stop", "#model", "#api-key"):
        box = page.locator(selector).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390 and box["width"] >= 150, (selector, box)
    page.screenshot(path=str(ARTIFACTS / "playground-phone.png"))
