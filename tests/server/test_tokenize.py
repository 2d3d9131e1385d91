"""``POST /tokenize`` and ``POST /detokenize``: the ids generation would use, and every refusal."""

from __future__ import annotations

import json
from typing import Any

import httpx
from srv_harness import assert_error

http = httpx.Client(timeout=30)

TEXT = "Paged attention reads K/V straight from the pool. Ünïcödé, too: 東京 🚀"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


def test_a_prompt_tokenizes_as_completions_encodes_it(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    r = http.post(f"{srv.url}/tokenize", json={"model": "fake-model", "prompt": TEXT})
    assert r.status_code == 200, r.text
    want = list(eng.tokenizer.encode(TEXT))
    assert r.json() == {"count": len(want), "max_model_len": 256, "tokens": want, "token_strs": None}
    # The same count /v1/completions reports for the same text.
    done = http.post(f"{srv.url}/v1/completions", json={"prompt": TEXT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(want)

    r = http.post(f"{srv.url}/tokenize", json={"prompt": TEXT, "return_token_strs": True, "add_special_tokens": False})
    body = r.json()
    assert body["tokens"] == list(eng.tokenizer.encode(TEXT, add_special_tokens=False))
    assert body["token_strs"] == eng.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert len(body["token_strs"]) == body["count"] > 10


def test_messages_tokenize_as_chat_completions_renders_them(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    r = http.post(f"{srv.url}/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = eng.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ids == list(eng.tokenizer.encode(text, add_special_tokens=False))
    assert eng.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    done = http.post(f"{srv.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(ids)

    # Without the assistant's turn marker: a strict prefix of the ids above.
    r = http.post(f"{srv.url}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    bare = r.json()["tokens"]
    assert len(bare) < len(ids) and ids[: len(bare)] == bare


def test_detokenize_inverts_tokenize(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    ids = http.post(f"{srv.url}/tokenize", json={"prompt": TEXT}).json()["tokens"]
    r = http.post(f"{srv.url}/detokenize", json={"model": "fake-model", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    # Special tokens are spelled out, and no ids at all are an empty text.
    marker = eng.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert http.post(f"{srv.url}/detokenize", json={"tokens": [marker]}).json() == {"prompt": "<|im_end|>"}
    assert http.post(f"{srv.url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_bad_requests_get_openai_errors(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    vocab = len(eng.tokenizer)
    cases = [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, 400, "__any__"),
        ("/tokenize", {"prompt": 5}, 400, "__any__"),
        ("/tokenize", {"messages": []}, 400, "__any__"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
        ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "__any__"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ]
    for path, body, status, param in cases:
        assert_error(http.post(f"{srv.url}{path}", json=body), status, param=param)
    r = http.post(f"{srv.url}/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)
    # The server is unharmed.
    assert http.post(f"{srv.url}/tokenize", json={"prompt": "ok"}).status_code == 200


def test_a_prompt_too_long_for_any_context_is_refused_before_tokenizing(fake_server: Any) -> None:
    srv, _, _ = fake_server(max_model_len=64)
    limit = srv.config.app.state.serving.max_prompt_chars
    err = assert_error(http.post(f"{srv.url}/tokenize", json={"prompt": "a" * (limit + 1)}), 400, param="prompt")
    assert f"{limit + 1} characters" in err["message"]
    half = "c" * (limit // 2 + 1)
    msgs = [{"role": "system", "content": half}, {"role": "user", "content": half}]
    assert_error(http.post(f"{srv.url}/tokenize", json={"messages": msgs}), 400, param="messages")
    # At the limit it is tokenized: /tokenize counts, it does not refuse by token count.
    r = http.post(f"{srv.url}/tokenize", json={"prompt": "a" * limit})
    assert r.status_code == 200 and r.json()["count"] > 64


def test_key_and_body_limit_gate_both_routes(fake_server: Any) -> None:
    srv, _, _ = fake_server(api_key="sekret", max_request_bytes=4096)
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        assert_error(http.post(f"{srv.url}{path}", json=body), 401)
        ok = http.post(f"{srv.url}{path}", json=body, headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200, ok.text
    big = json.dumps({"prompt": "x" * 5000}).encode()
    r = httpx.post(
        f"{srv.url}/tokenize",
        content=big,
        headers={"content-type": "application/json", "authorization": "Bearer sekret"},
        timeout=30,
    )
    assert_error(r, 413, code="request_too_large")


def test_messages_with_tools_tokenize_as_chat_renders_them(shared_fake_server: Any) -> None:
    srv, eng, _ = shared_fake_server
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
        extra = {"tools": [tool]} | ({"tool_choice": choice} if choice is not None else {})
        r = http.post(f"{srv.url}/tokenize", json={"messages": MESSAGES, **extra})
        assert r.status_code == 200, r.text
        assert (
            http.post(
                f"{srv.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, **extra}
            ).status_code
            == 200
        )
        assert r.json()["tokens"] == eng.prompts[-1], choice  # what generation was given
        assert ("get_weather" in eng.tokenizer.decode(eng.prompts[-1])) == (choice != "none")
    assert_error(http.post(f"{srv.url}/tokenize", json={"prompt": "x", "tools": [tool]}), 400, param="tools")
    assert_error(
        http.post(f"{srv.url}/tokenize", json={"messages": MESSAGES, "tool_choice": "required"}),
        400,
        param="tool_choice",
    )
