"""The HTTP surface over a scripted engine: shapes, SSE framing, every error path, aborts, liveness.

A real uvicorn server runs in a thread; the engine is ``FakeEngine`` (deterministic tokens), so these
tests are fast and can provoke failures (engine crash, per-request errors, a full queue) at will.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from srv_harness import assert_error, parse_sse

# One client for the module: keep-alive connections, no per-call client set-up.
http = httpx.Client(timeout=30)
# The scripted engine has no prefix cache.
NO_CACHED = {"prompt_tokens_details": {"cached_tokens": 0}}


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------- shapes


def test_completion_shape_and_text(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    r = http.post(f"{srv.url}/v1/completions", json={"model": "fake-model", "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) > 10
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": eng.expected_text(5), "logprobs": None, "finish_reason": "length"}]
    n_prompt = len(eng.tokenizer.encode("Hello"))
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 5,
        "total_tokens": n_prompt + 5,
        **NO_CACHED,
    }


def test_completion_default_max_tokens_is_16_and_model_optional(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["choices"][0]["text"] == eng.expected_text(16)


def test_completion_many_prompts_times_n(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    r = http.post(
        f"{srv.url}/v1/completions",
        json={"model": "fake-model", "prompt": [[5, 6], [7, 8, 9], [10]], "n": 2, "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for c in choices:
        # index = prompt_idx * n + i: choice i of every prompt walks the script from offset i
        assert c["text"] == eng.expected_text(3, index=c["index"] % 2)
    assert r.json()["usage"] == {"prompt_tokens": 6, "completion_tokens": 18, "total_tokens": 24, **NO_CACHED}
    assert len(eng.added) == 3


def test_completion_echo_and_logprobs(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "Say", "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"] == "Say" + eng.expected_text(2)
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "Say", "max_tokens": 3, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    toks = [eng.tokenizer.decode([t]) for t in eng.script[:3]]
    assert lp["tokens"] == toks
    assert lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [0, len(toks[0]), len(toks[0]) + len(toks[1])]
    assert [list(d.values()) for d in lp["top_logprobs"]] == [[-0.25]] * 3
    assert [list(d) for d in lp["top_logprobs"]] == [[t] for t in toks]


def _echo_logprobs(eng: Any, prompt: list[int], k: int, generated: int, index: int = 0) -> dict[str, Any]:
    """What echo + logprobs=k must return: the prompt's tokens (the first with null) then the tokens
    generated, offsets running over the echoed text."""
    texts = [eng.tokenizer.decode([t]) for t in prompt]
    gen = [eng.script[(index + j) % len(eng.script)] for j in range(generated)]
    gen_texts = [eng.tokenizer.decode([t]) for t in gen]
    prompt_lps = eng.prompt_logprobs(prompt, k)
    tops: list[Any] = [None]
    for e in prompt_lps[1:]:
        top = {eng.tokenizer.decode([t]): lp for t, lp in e.top}
        top.setdefault(eng.tokenizer.decode([e.token_id]), e.logprob)
        tops.append(top)
    for j, t in enumerate(gen_texts):
        alt = eng.script[(index + j + 1) % len(eng.script)]
        tops.append(dict([(t, -0.25), (eng.tokenizer.decode([alt]), -1.75)][: max(k, 1)]))
    offsets = [sum(len(x) for x in texts[:j]) for j in range(len(texts))]
    base = len("".join(texts))
    offsets += [base + sum(len(x) for x in gen_texts[:j]) for j in range(generated)]
    return {
        "tokens": texts + gen_texts,
        "token_logprobs": [None] + [e.logprob for e in prompt_lps[1:]] + [-0.25] * generated,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_with_logprobs_scores_the_prompt(fake_server: Any, stream: bool) -> None:
    srv, eng, _ = fake_server()
    prompts = [[1000, 2000, 3000], [4000, 5000]]
    body = {"prompt": prompts, "max_tokens": 2, "echo": True, "logprobs": 2, "n": 2, "stream": stream}
    choices: dict[int, dict[str, Any]] = {}
    if stream:
        with http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = parse_sse(r.read())
        for chunk in (json.loads(e)["choices"][0] for e in events[:-1]):
            c = choices.setdefault(chunk["index"], {"text": "", "logprobs": None})
            c["text"] += chunk["text"]
            if chunk["logprobs"] is not None:
                prev = c["logprobs"]
                c["logprobs"] = chunk["logprobs"] if prev is None else {k: prev[k] + chunk["logprobs"][k] for k in prev}
    else:
        r = http.post(f"{srv.url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = {c["index"]: c for c in r.json()["choices"]}
        assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13, **NO_CACHED}
    assert sorted(choices) == [0, 1, 2, 3]
    for i, c in choices.items():
        prompt = prompts[i // 2]
        assert c["text"] == eng.tokenizer.decode(prompt) + eng.expected_text(2, index=i % 2)
        assert c["logprobs"] == _echo_logprobs(eng, prompt, 2, 2, index=i % 2), i


@pytest.mark.parametrize("stream", [False, True])
def test_completion_max_tokens_0_with_echo_returns_the_prompt_alone(fake_server: Any, stream: bool) -> None:
    srv, eng, _ = fake_server()
    body = {"prompt": "Say it", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    prompt = eng.tokenizer.encode("Say it")
    expected = _echo_logprobs(eng, prompt, 1, 0)
    if stream:
        with http.stream(
            "POST", f"{srv.url}/v1/completions", json={**body, "stream_options": {"include_usage": True}}
        ) as r:
            events = parse_sse(r.read())
        *content, usage = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0] for c in content] == [
            {"index": 0, "text": "Say it", "logprobs": expected, "finish_reason": "length"}
        ]
        assert usage["usage"]["completion_tokens"] == 0
    else:
        r = http.post(f"{srv.url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        (c,) = r.json()["choices"]
        assert c == {"index": 0, "text": "Say it", "logprobs": expected, "finish_reason": "length"}
        assert r.json()["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 0,
            "total_tokens": len(prompt),
            **NO_CACHED,
        }
    # Without logprobs: the prompt, no logprobs; without echo: refused.
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "Say it", "max_tokens": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == "Say it" and r.json()["choices"][0]["logprobs"] is None
    err = assert_error(
        http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, param="max_tokens"
    )
    assert "echo" in err["message"]
    body = {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 2}
    assert "(0)" in assert_error(http.post(f"{srv.url}/v1/completions", json=body), 400, param="min_tokens")["message"]


def _vllm_prompt_logprobs(eng: Any, prompt: list[int], k: int) -> list[Any]:
    out: list[Any] = [None]
    for e in eng.prompt_logprobs(prompt, k)[1:]:
        d = {
            str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": eng.tokenizer.decode([e.token_id])}
        }
        for r, (t, lp) in enumerate(e.top, start=1):
            d.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": eng.tokenizer.decode([t])})
        out.append(d)
    return out


def test_vllm_prompt_logprobs_extension(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    prompt = [1000, 2000, 3000]
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    assert c["prompt_logprobs"] == _vllm_prompt_logprobs(eng, prompt, 2)
    assert c["logprobs"] is None and c["text"] == eng.expected_text(2)
    # With echo + logprobs too: one scoring (the larger k), each view cut to its own k.
    r = http.post(
        f"{srv.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, "echo": True, "logprobs": 1},
    )
    (c,) = r.json()["choices"]
    assert c["prompt_logprobs"] == _vllm_prompt_logprobs(eng, prompt, 2)
    assert c["logprobs"] == _echo_logprobs(eng, prompt, 1, 2)
    # Not asked: no key.
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert "prompt_logprobs" not in r.json()["choices"][0]
    # Chat: at the top level, over the rendered prompt's tokens.
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["prompt_logprobs"] == _vllm_prompt_logprobs(eng, eng.prompts[-1], 0)
    assert len(r.json()["prompt_logprobs"]) == r.json()["usage"]["prompt_tokens"]
    for path, body in (
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1}),
    ):
        assert_error(http.post(f"{srv.url}{path}", json=body), 400, param="prompt_logprobs")


def test_chat_shape_and_logprobs(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            ],
            "max_completion_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
            "user": "u1",
            "metadata": {"a": "b"},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    ch = body["choices"][0]
    assert ch["message"]["role"] == "assistant" and ch["message"]["content"] == eng.expected_text(4)
    assert ch["finish_reason"] == "length"
    content = ch["logprobs"]["content"]
    assert len(content) == 4
    first = content[0]
    assert first["token"] == eng.tokenizer.decode([eng.script[0]])
    assert first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.25, -1.75]
    # The developer message became the system turn and the text parts were joined.
    expected_prompt = eng.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert eng.prompts[-1] == eng.tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(eng.prompts[-1])


def test_models_health_version(fake_server: Any) -> None:
    srv, _, _ = fake_server()
    models = http.get(f"{srv.url}/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "fake-model" and card["object"] == "model" and card["owned_by"] == "servelm"
    assert card["max_model_len"] == 256 and isinstance(card["created"], int)
    assert http.get(f"{srv.url}/v1/models/fake-model").json()["id"] == "fake-model"
    assert_error(http.get(f"{srv.url}/v1/models/nope"), 404, code="model_not_found")
    assert http.get(f"{srv.url}/health").status_code == 200
    assert http.get(f"{srv.url}/version").json()["version"]
    m = http.get(f"{srv.url}/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")


# ------------------------------------------------------------------------------------------- SSE


def test_completion_stream_framing(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    with http.stream(
        "POST",
        f"{srv.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *content, usage = chunks
    assert len(content) == 4
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in content)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert "".join(c["choices"][0]["text"] for c in content) == eng.expected_text(4)
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_chat_stream_framing_n2(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    with http.stream(
        "POST",
        f"{srv.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        raw = r.read()
    events = parse_sse(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # The role chunks come first, one per choice.
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    for i in range(2):
        mine = [c["choices"][0] for c in chunks[2:-1] if c["choices"][0]["index"] == i]
        assert "".join(ch["delta"].get("content", "") for ch in mine) == eng.expected_text(3, index=i)
        # the last one per choice: empty delta + finish_reason
        assert mine[-1] == {"index": i, "delta": {}, "logprobs": None, "finish_reason": "length"}
        assert all(ch["finish_reason"] is None for ch in mine[:-1])
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_key(fake_server: Any) -> None:
    srv, _, _ = fake_server()
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
    )
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


# ----------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": 5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": [1, 999999]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
            "messages[0].content[0].type",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
            "functions",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}, "audio"),
    ],
)
def test_bad_requests_are_400_naming_the_param(shared_fake_server: Any, path: str, body: dict, param: str) -> None:
    srv, eng, _ = shared_fake_server
    before = len(eng.added)
    assert_error(http.post(srv.url + path, json=body), 400, param=param)
    assert len(eng.added) == before  # nothing reached the engine


def test_malformed_json_and_non_object(fake_server: Any) -> None:
    srv, _, _ = fake_server()
    r = http.post(f"{srv.url}/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_error(r, 400)
    r = http.post(f"{srv.url}/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_unknown_model_404(fake_server: Any) -> None:
    srv, _, _ = fake_server()
    assert_error(
        http.post(f"{srv.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, code="model_not_found"
    )
    r = http.post(
        f"{srv.url}/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    )
    assert_error(r, 404, code="model_not_found")


def test_unknown_route_and_method(fake_server: Any) -> None:
    srv, _, _ = fake_server()
    assert_error(http.get(f"{srv.url}/v1/nothing"), 404)
    assert_error(http.get(f"{srv.url}/v1/completions"), 405)


def test_api_key(fake_server: Any) -> None:
    srv, _, _ = fake_server(api_key="sekret")
    body = {"prompt": "x", "max_tokens": 1}
    assert_error(http.post(f"{srv.url}/v1/completions", json=body), 401, code="invalid_api_key")
    bad = {"Authorization": "Bearer wrong"}
    assert_error(http.post(f"{srv.url}/v1/completions", json=body, headers=bad), 401)
    assert_error(http.get(f"{srv.url}/v1/models", headers=bad), 401)
    # malformed JSON without a key is still a 401 (the key is checked first)
    assert_error(
        http.post(f"{srv.url}/v1/completions", content=b"{", headers={"content-type": "application/json"}), 401
    )
    good = {"Authorization": "Bearer sekret"}
    assert http.post(f"{srv.url}/v1/completions", json=body, headers=good).status_code == 200
    assert http.get(f"{srv.url}/v1/models", headers=good).status_code == 200
    for open_path in ("/health", "/version", "/metrics"):
        assert http.get(srv.url + open_path).status_code == 200


def test_request_error_is_500_for_that_request_only(fake_server: Any) -> None:
    srv, eng, _ = fake_server()
    assert_error(http.post(f"{srv.url}/v1/completions", json={"prompt": "FAIL_ME now"}), 500)
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "FAIL_ME"}], "stream": True},
    )
    assert r.status_code == 200
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert set(err) == {"error"} and err["error"]["type"] == "server_error"
    # the server is fine afterwards
    ok = http.post(f"{srv.url}/v1/completions", json={"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == eng.expected_text(2)
    assert http.get(f"{srv.url}/health").status_code == 200


def test_queue_full_503_with_retry_after(fake_server: Any) -> None:
    srv, eng, ae = fake_server(max_num_seqs=1, max_waiting_requests=2, step_time=0.02)
    results: list[httpx.Response] = []

    def call() -> None:
        results.append(http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 30}, timeout=30))

    threads = [threading.Thread(target=call) for _ in range(3)]  # 1 running + 2 waiting
    # The first must reach the engine (and run) before the others: adds still in the inbox count as
    # waiting, so three at once under load would already overflow the queue of 2.
    threads[0].start()
    _wait(lambda: len(eng.added) == 1)
    for t in threads[1:]:
        t.start()
    _wait(lambda: len(eng.added) == 3)
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    err = assert_error(r, 503, code="queue_full")
    assert r.headers["retry-after"] == "1"
    assert "2" in err["message"]
    assert ae.test_observer.rejected == 1
    for t in threads:
        t.join()
    assert [x.status_code for x in results] == [200, 200, 200]


# ----------------------------------------------------------------------------- aborts and liveness


def test_stream_disconnect_aborts_and_frees(fake_server: Any) -> None:
    srv, eng, _ = fake_server(step_time=0.01)
    with http.stream("POST", f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}) as r:
        it = r.iter_raw()
        next(it)
        next(it)
    _wait(lambda: len(eng.aborted) == 1)
    _wait(lambda: eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished_requests())
    assert http.get(f"{srv.url}/health").status_code == 200


def test_non_stream_disconnect_aborts(fake_server: Any) -> None:
    srv, eng, _ = fake_server(step_time=0.01)
    # A raw socket we can close mid-request, like a client that gives up.
    body = json.dumps({"prompt": "x", "max_tokens": 200}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    _wait(lambda: len(eng.added) == 1 and eng.steps > 2)
    s.close()
    _wait(lambda: len(eng.aborted) == 1)
    _wait(lambda: eng.block_manager.num_used_blocks == 0)


def test_the_openapi_schema_documents_what_the_server_returns(fake_server: Any) -> None:
    """Errors as the OpenAI error body with their real statuses (400 for validation, never FastAPI's
    422), /metrics as text, the chat roles, and that prompts must not be empty."""
    srv, _, _ = fake_server()
    schema = http.get(f"{srv.url}/openapi.json").json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in schema["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert sorted(responses) == ["200", "400", "401", "404", "413", "500", "503"]
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    error = schema["components"]["schemas"]["ErrorBody"]
    assert sorted(error["properties"]) == ["code", "message", "param", "type"]
    assert sorted(schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == ["200", "401", "404", "503"]
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    role = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]
    assert role["enum"] == ["system", "developer", "user", "assistant", "tool"]
    branches = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert [b.get("minLength", b.get("minItems")) for b in branches] == [1, 1, 1, 1]
    assert [b["items"].get("minLength", b["items"].get("minItems")) for b in branches[1:]] == [None, 1, 1]
    # Ranges: those SamplingParams checks, under the name each endpoint uses.
    comp = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert (comp["temperature"]["minimum"], comp["temperature"]["maximum"]) == (0, 2)
    assert (comp["top_p"]["exclusiveMinimum"], comp["top_p"]["maximum"]) == (0, 1)
    assert (comp["n"]["minimum"], comp["n"]["maximum"]) == (1, 128) and comp["logprobs"]["maximum"] == 20
    assert chat["top_logprobs"]["maximum"] == 20 and "maximum" not in chat["logprobs"]  # a boolean there
    assert chat["max_completion_tokens"]["minimum"] == 1 and "maximum" not in chat["max_tokens"]
    # What the schema says is what the server does.
    assert_error(http.post(f"{srv.url}/v1/completions", json={"prompt": ""}), 400, param="prompt")
    for field, bad in (("top_p", 0), ("n", 129), ("temperature", 2.01), ("logprobs", 21)):
        assert_error(http.post(f"{srv.url}/v1/completions", json={"prompt": "x", field: bad}), 400, param=field)
    r = http.post(
        f"{srv.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
    )
    assert_error(r, 400, param="top_logprobs")
    r = http.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert_error(r, 400, param="messages[0].role")
    stop_one, stop_many = chat["stop"]["anyOf"][:2]
    assert (stop_one["minLength"], stop_one["maxLength"]) == (1, 4096)
    assert stop_many["maxItems"] == 16 and stop_many["items"]["maxLength"] == 4096
    for bad in ("s" * 4097, ["ok", "s" * 4097], [f"s{i}" for i in range(17)]):
        assert_error(http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "stop": bad}), 400, param="stop")
    r = http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "stop": ["s" * 4096] * 16, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert http.get(f"{srv.url}/metrics").headers["content-type"].startswith("text/plain")


async def test_a_client_gone_before_the_result_is_a_499_not_a_server_error() -> None:
    """``until_disconnect`` when the disconnect wins the race: the work is cancelled, the group closed,
    and the outcome is 499 (it used to ask the just-cancelled task for its result and log a 500)."""
    import asyncio

    from servelm.server.errors import APIError
    from servelm.server.serving_common import until_disconnect

    class Request:
        async def receive(self) -> dict[str, str]:
            return {"type": "http.disconnect"}

    class Group:
        closed = 0

        def close(self) -> None:
            self.closed += 1

    never = asyncio.get_running_loop().create_future()

    async def work() -> str:
        await never
        return "unreachable"

    group = Group()
    with pytest.raises(APIError) as err:
        await until_disconnect(Request(), work(), group)
    assert err.value.status_code == 499 and err.value.code == "client_closed"
    assert group.closed == 1

    # And a result that is ready wins over a client that stays.
    class Staying:
        async def receive(self) -> dict[str, str]:
            await asyncio.sleep(3600)
            return {}

    async def quick() -> str:
        return "done"

    assert await until_disconnect(Staying(), quick(), group) == "done"
    assert group.closed == 1


def test_engine_death(fake_server: Any) -> None:
    srv, eng, ae = fake_server(step_time=0.01)
    got: dict[str, Any] = {}

    def stream() -> None:
        got["raw"] = http.post(
            f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}, timeout=30
        ).content

    def plain() -> None:
        got["plain"] = http.post(f"{srv.url}/v1/completions", json={"prompt": "y", "max_tokens": 200}, timeout=30)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    _wait(lambda: len(eng.added) == 2 and eng.steps > 2)
    eng.crash = True
    for t in threads:
        t.join(10)
    events = parse_sse(got["raw"])
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
    assert_error(got["plain"], 503, code="engine_dead")
    assert not ae.is_alive
    assert_error(http.get(f"{srv.url}/health"), 503)
    assert_error(http.post(f"{srv.url}/v1/completions", json={"prompt": "x"}), 503, code="engine_dead")
    assert_error(http.get(f"{srv.url}/v1/models"), 503)


def test_graceful_shutdown_finishes_running_stream(fake_server: Any) -> None:
    srv, eng, ae = fake_server(step_time=0.01)
    got: dict[str, Any] = {}

    def stream() -> None:
        got["raw"] = http.post(
            f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 60, "stream": True}, timeout=30
        ).content

    t = threading.Thread(target=stream)
    t.start()
    _wait(lambda: eng.steps > 3)
    ae.stop_accepting()  # what the SIGTERM handler does first
    assert_error(http.post(f"{srv.url}/v1/completions", json={"prompt": "x"}), 503, code="shutting_down")
    srv.stop()
    t.join(10)
    events = parse_sse(got["raw"])
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == eng.expected_text(60)
    assert not srv.thread.is_alive()
    assert ae._engine_thread.thread is not None and not ae._engine_thread.thread.is_alive()


def test_stream_disconnect_while_queued_aborts_before_it_runs(fake_server: Any) -> None:
    srv, eng, _ = fake_server(max_num_seqs=1, step_time=0.01)
    done: list[httpx.Response] = []
    blocker = threading.Thread(
        target=lambda: done.append(http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 100}))
    )
    blocker.start()
    _wait(lambda: len(eng.added) == 1)
    with http.stream("POST", f"{srv.url}/v1/completions", json={"prompt": "y", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        _wait(lambda: len(eng.added) == 2)
    # It never produced a token (the blocker holds the only slot), yet it is gone from the engine.
    _wait(lambda: eng.aborted == [eng.added[1]])
    assert eng.num_waiting == 0
    blocker.join()
    assert done[0].status_code == 200
