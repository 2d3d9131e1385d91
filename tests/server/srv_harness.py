"""Test helpers for the server: a scripted engine double and a uvicorn server running in a thread."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import torch
import uvicorn

from servelm.runtime.batch import TokenLogprobs
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.outputs import CompletionOutput, RequestOutput
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams

SCRIPT = " The quick brown fox jumps over the lazy dog and runs far away into the green hills."


@dataclass
class _Choice:
    index: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    choices: list[_Choice]
    fail: bool = False
    prompt_logprobs_sent: bool = False


class FakeEngine:
    """Scripted stand-in for ``scheduler.engine.Engine`` (same attributes and methods the server uses).

    Each running choice emits one token per ``step()``: choice ``i`` walks the tokens of ``SCRIPT``
    starting at offset ``i`` (so n=2 choices differ). At most ``max_num_seqs`` requests run at once
    (the rest wait, holding no blocks); a running request holds one block per choice. A prompt
    containing ``FAIL_ME`` finishes with ``finish_reason="error"``; ``crash = True`` makes the next
    ``step()`` raise (the engine thread dies).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 256,
        max_num_seqs: int = 8,
        max_waiting_requests: int = 1024,
        step_time: float = 0.002,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = EngineConfig(
            max_model_len=max_model_len, max_waiting_requests=max_waiting_requests, max_num_seqs=max_num_seqs
        )
        self.model_config = SimpleNamespace(vocab_size=len(tokenizer))
        self.served_model_name = "fake-model"
        self.device = torch.device("cpu")
        self.capacity = SimpleNamespace(describe=lambda: "fake capacity", block_size=16, num_blocks=64)
        self.step_time = step_time
        self.script = list(tokenizer.encode(SCRIPT))
        self.fail_marker = "FAIL_ME"
        self._reqs: dict[str, _FakeRequest] = {}
        self._pending: list[RequestOutput] = []
        self.added: list[str] = []
        self.prompts: list[list[int]] = []
        self.aborted: list[str] = []
        self.steps_at_abort: list[int] = []  # ``steps`` when each abort was applied
        self.crash = False
        self.steps = 0
        self.block_manager = SimpleNamespace(num_used_blocks=0)

    # -- the Engine surface --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running())

    @property
    def num_waiting(self) -> int:
        return sum(r.params.n for r in list(self._reqs.values())[self.config.max_num_seqs :])

    def _running(self) -> list[_FakeRequest]:
        return list(self._reqs.values())[: self.config.max_num_seqs]

    def _update_blocks(self) -> None:
        self.block_manager.num_used_blocks = sum(
            sum(1 for c in r.choices if c.finish_reason is None) for r in self._running()
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> None:
        """``Engine.add_request``'s signature; the scripted model has no adapters, prefix cache, priorities
        or fair share."""
        params.validate(vocab_size=self.model_config.vocab_size)
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "the prompt is empty")
        limit = self.config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(prompt_token_ids)
        total = len(prompt_token_ids) + max_tokens
        if total > limit:
            raise InvalidParameterError(
                "max_tokens",
                f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
                f"({len(prompt_token_ids)} in the prompt, {max_tokens} for the completion).",
            )
        fail = self.fail_marker in self.tokenizer.decode(prompt_token_ids)
        self._reqs[request_id] = _FakeRequest(
            request_id, list(prompt_token_ids), params, [_Choice(i) for i in range(params.n)], fail
        )
        self.added.append(request_id)
        self.prompts.append(list(prompt_token_ids))
        self.last_params = params
        self._update_blocks()

    def abort(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        self.aborted.append(request_id)
        self.steps_at_abort.append(self.steps)
        outs = [
            CompletionOutput(c.index, [], "", None, len(c.tokens), "abort")
            for c in req.choices
            if c.finish_reason is None
        ]
        self._pending.append(RequestOutput(request_id, req.prompt, outs, finished=True))
        self._update_blocks()

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs) or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        if self.crash:
            raise RuntimeError("simulated engine failure")
        time.sleep(self.step_time)
        self.steps += 1
        outputs, self._pending = self._pending, []
        for req in self._running():
            outs: list[CompletionOutput] = []
            for c in req.choices:
                if c.finish_reason is not None:
                    continue
                if req.fail:
                    c.finish_reason = "error"
                    outs.append(CompletionOutput(c.index, [], "", None, len(c.tokens), "error"))
                    continue
                tok = self.script[(c.index + len(c.tokens)) % len(self.script)]
                c.tokens.append(tok)
                max_tokens = req.params.max_tokens or (self.config.max_model_len - len(req.prompt))
                if len(c.tokens) >= max_tokens:
                    c.finish_reason = "length"
                lps = None
                if req.params.logprobs is not None:
                    alt = self.script[(c.index + len(c.tokens)) % len(self.script)]
                    top = [(tok, -0.25), (alt, -1.75)][: req.params.logprobs]
                    lps = [TokenLogprobs(tok, -0.25, 1, top)]
                outs.append(
                    CompletionOutput(c.index, [tok], self.tokenizer.decode([tok]), lps, len(c.tokens), c.finish_reason)
                )
            finished = all(c.finish_reason is not None for c in req.choices)
            prompt_lps = None
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and not req.fail:
                prompt_lps = self.prompt_logprobs(req.prompt, req.params.prompt_logprobs)
                req.prompt_logprobs_sent = True
            outputs.append(
                RequestOutput(
                    req.request_id,
                    req.prompt,
                    outs,
                    finished=finished,
                    error="boom" if req.fail else None,
                    prompt_logprobs=prompt_lps,
                )
            )
            if finished:
                del self._reqs[req.request_id]
        self._update_blocks()
        return outputs

    # -- what a test expects ---------------------------------------------------------------------------
    @staticmethod
    def prompt_logprobs(prompt: list[int], k: int) -> list[TokenLogprobs | None]:
        """Scripted prompt logprobs: token j (j >= 1) gets -j / 10, rank j, and itself then token 0 as
        alternatives (k of them)."""
        out: list[TokenLogprobs | None] = [None]
        for j, t in enumerate(prompt[1:], start=1):
            out.append(TokenLogprobs(t, -j / 10, j, [(t, -j / 10), (prompt[0], -0.05)][:k]))
        return out

    def expected_text(self, n_tokens: int, index: int = 0) -> str:
        ids = [self.script[(index + k) % len(self.script)] for k in range(n_tokens)]
        return "".join(self.tokenizer.decode([t]) for t in ids)


class ServerThread:
    """A real uvicorn server on a free loopback port, in a background thread (lifespan included)."""

    def __init__(self, app: Any, *, graceful_timeout: int = 5) -> None:
        self.config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=graceful_timeout,
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.port = 0

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def parse_sse(raw: bytes) -> list[str]:
    """Split an SSE body into its ``data:`` payloads, asserting the exact framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events = raw.decode().split("\n\n")[:-1]
    out = []
    for ev in events:
        assert ev.startswith("data: "), ev
        assert "\n" not in ev, ev
        out.append(ev[len("data: ") :])
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = "__any__", code: str | None = None) -> dict:
    """``resp`` is an OpenAI-shaped error with this status (and this param / code when given); its error object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param != "__any__":
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def typed_sse_events(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each ``event:``/``data:`` pair of a typed stream (Responses, Messages); each
    data's ``type`` must repeat its event name."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out
