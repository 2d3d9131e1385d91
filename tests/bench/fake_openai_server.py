"""A small OpenAI-compatible streaming server for testing ``servelm bench`` without a model.

Each request "generates" ``max_tokens`` tokens (or ``eos_after`` when ``ignore_eos`` is not set):
the first after ``first_token_delay`` seconds, the rest every ``token_delay`` seconds. Prompt
tokens in the usage chunk are counted with the given tokenizer, as a real server would.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeState:
    model: str = "fake-model"
    first_token_delay: float = 0.02
    token_delay: float = 0.005
    eos_after: int = 3
    fail_every: int = 0  # every k-th request answers 500 (0: never)
    send_usage: bool = True
    tokenizer: Any = None
    received: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model, "object": "model", "owned_by": "test"}]}

    def prompt_tokens(body: dict[str, Any]) -> int:
        if "messages" in body:
            text = "".join(m["content"] for m in body["messages"])
            return len(state.tokenizer.encode(text, add_special_tokens=False)) + 5  # a template's worth
        p = body["prompt"]
        if isinstance(p, list):
            return len(p)
        return len(state.tokenizer.encode(p, add_special_tokens=False))

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.received.append(body)
        state.arrivals.append(time.perf_counter())
        if state.fail_every and len(state.received) % state.fail_every == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        n = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], state.eos_after)
        n_prompt = prompt_tokens(body)

        async def events() -> Any:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if chat:  # a role-only first chunk, as OpenAI sends: carries no token
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
                await asyncio.sleep(state.first_token_delay)
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.token_delay)
                    text = f" t{i}"
                    finish = None if i < n - 1 else ("length" if n == body["max_tokens"] else "stop")
                    choice = (
                        {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                        if chat
                        else {"index": 0, "text": text, "finish_reason": finish}
                    )
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if state.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(state: FakeState) -> Iterator[str]:
    """Run the fake server on a free loopback port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
