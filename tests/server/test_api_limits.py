"""Input limits over a scripted engine: what the server refuses before it spends time or memory on a
request (body size, prompt text longer than the context can hold, more sequences than the queue),
and the cost of parsing what it accepts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from srv_harness import assert_error

http = httpx.Client(timeout=30)


def test_prompt_too_long_names_both_numbers(fake_server: Any) -> None:
    srv, _, _ = fake_server(max_model_len=64)
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": list(range(10, 40)), "max_tokens": 40})
    err = assert_error(r, 400, param="max_tokens")
    assert "64" in err["message"] and "70" in err["message"]
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 60},
    )
    err = assert_error(r, 400, param="max_completion_tokens")
    assert "64" in err["message"]


def test_a_prompt_text_too_long_for_the_context_is_refused_before_tokenizing(fake_server: Any) -> None:
    """No text of 64 tokens can have more than 64 x (the longest vocabulary entry) characters; a longer
    one is refused without being tokenized (a 100 MB prompt once held the tokenizer for 97 s and grew
    the server by 10 GB before its context-length 400)."""
    srv, _, _ = fake_server(max_model_len=64)
    ctx = srv.config.app.state.serving
    limit = ctx.max_prompt_chars
    longest = max(len(t) for t in ctx.tokenizer.get_vocab())
    assert limit == 64 * longest  # SmolLM2's byte-level BPE has no normalizer
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 1})
    err = assert_error(r, 400, param="prompt")
    assert f"{limit + 1} characters" in err["message"] and "64 tokens" in err["message"]
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": ["ok", "b" * (limit + 1)], "max_tokens": 1})
    assert "prompt 1 has" in assert_error(r, 400, param="prompt")["message"]
    half = "c" * (limit // 2 + 1)
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "system", "content": half}, {"role": "user", "content": half}], "max_tokens": 1},
    )
    assert "characters" in assert_error(r, 400, param="messages")["message"]
    # At the limit the text is tokenized and refused (or served) by its real token count.
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "a" * limit, "max_tokens": 1})
    err = assert_error(r, 400)
    assert "characters" not in err["message"] and "in the prompt" in err["message"]
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_request_bodies_over_the_limit_get_413_unparsed(fake_server: Any) -> None:
    srv, eng, _ = fake_server(max_request_bytes=4096)
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = http.post(f"{srv.url}/v1/completions", content=big, headers={"content-type": "application/json"})
    err = assert_error(r, 413, param=None, code="request_too_large")
    assert "4096" in err["message"]

    def chunked():  # no Content-Length: counted while read
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    with httpx.Client(timeout=30) as c:  # a fresh connection: the 413 may close the one it was sent on
        r = c.post(f"{srv.url}/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")
    small = {"prompt": "Hi", "max_tokens": 2, "user": "u" * 3000}
    r = httpx.post(f"{srv.url}/v1/completions", json=small, timeout=30)  # just under: served
    assert r.status_code == 200, r.text
    with httpx.Client(timeout=30) as c:  # a small chunked body is reassembled whole
        body = json.dumps(small).encode()
        r = c.post(f"{srv.url}/v1/completions", content=iter([body[:10], body[10:]]), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200


def test_a_request_larger_than_the_whole_queue_is_400_not_503(fake_server: Any) -> None:
    """Retrying cannot help a request of more sequences than --max-waiting-requests: no Retry-After."""
    srv, eng, ae = fake_server(max_waiting_requests=4)
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
    err = assert_error(r, 400, param="prompt")
    assert "6 sequences" in err["message"] and "4" in err["message"] and "retry-after" not in r.headers
    r = http.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 5})
    assert_error(r, 400, param="n")
    assert ae.test_observer.rejected == 0 and not eng.added
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})  # exactly 4
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4


def test_the_prompt_union_keeps_each_form_and_validates_token_ids_without_trying_strings() -> None:
    """Token ids come first in the prompt union (a 2.5M-id prompt spent 0.6 s of the event loop
    while pydantic collected an error per id for the list[str] member); every form still parses
    as itself."""
    from server.protocol import CompletionRequest

    def parsed(prompt: Any) -> Any:
        return CompletionRequest.model_validate({"prompt": prompt}).prompt

    assert parsed("x") == "x"
    assert parsed(["1", "2"]) == ["1", "2"]  # digit strings stay text
    assert parsed([3, 4]) == [3, 4] and parsed([[3], [4, 5]]) == [[3], [4, 5]]
    with pytest.raises(Exception):
        parsed(["a", 1])  # mixed lists are no form at all
    assert CompletionRequest.model_fields["prompt"].annotation.__args__[:3] == (str, list[int], list[str])
