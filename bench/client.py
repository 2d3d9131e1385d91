"""The load generator's HTTP side: one streaming request timed chunk by chunk, and a workload sent
with Poisson arrivals (or all at once) under an optional concurrency cap."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from servelm.bench.datasets import BenchRequest, Tokenizer, count_tokens


@dataclass
class RequestResult:
    """What one request did, in seconds relative to the benchmark's start."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens, else the local count
    output_len: int = 0  # the server's usage.completion_tokens, else counted locally
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass
class BenchmarkRun:
    """One workload's results against one server, and how long it took end to end."""

    base_url: str
    model: str
    duration: float
    results: list[RequestResult]


def _normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The id of the first model the server lists at ``/v1/models``."""
    r = await client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def build_payload(
    req: BenchRequest, endpoint: str, model: str, ignore_eos: bool, temperature: float, extra: dict[str, Any]
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        payload["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM-style extension; servelm honours it
    payload.update(extra)
    return payload


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if endpoint == "chat":
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    endpoint: str,
    t0: float,
    tokenizer: Tokenizer | None,
    local_prompt_len: int | None,
) -> RequestResult:
    """POST one streaming request and time its chunks (times relative to ``t0``)."""
    res = RequestResult()
    start = time.perf_counter()
    res.start = start - t0
    text_parts: list[str] = []
    last = start
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return res
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_len = int(usage.get("prompt_tokens") or 0)
                    res.output_len = int(usage.get("completion_tokens") or 0)
                text = _chunk_text(chunk, endpoint)
                if text:
                    if not res.chunk_times:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    res.chunk_times.append(now - t0)
                    text_parts.append(text)
                    last = now
        res.latency = time.perf_counter() - start
    except (httpx.HTTPError, ValueError, KeyError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not res.chunk_times:
        res.error = "no output tokens streamed"
        return res
    if not res.usage_reported:
        text = "".join(text_parts)
        res.output_len = count_tokens(tokenizer, text) if tokenizer else len(res.chunk_times)
        res.prompt_len = local_prompt_len or 0
    res.success = True
    return res


async def run_benchmark(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    endpoint: str = "completions",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    tokenizer: Tokenizer | None = None,
    timeout_s: float | None = 600.0,
    progress: bool = True,
) -> BenchmarkRun:
    """Send ``requests`` to ``base_url`` and collect per-request timings."""
    base_url = _normalize_base_url(base_url)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s), limits=limits, headers=_headers(api_key), trust_env=False
    ) as client:
        if model is None:
            model = await first_model(client, base_url)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        url = base_url + path
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = random.Random(seed)  # the arrival process: the same seed gives the same schedule
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc=base_url, file=sys.stderr)

        async def one(req: BenchRequest) -> RequestResult:
            payload = build_payload(req, endpoint, model, ignore_eos, temperature, extra_body or {})
            if sem is None:
                r = await send_request(client, url, payload, endpoint, t0, tokenizer, req.prompt_len)
            else:
                async with sem:
                    r = await send_request(client, url, payload, endpoint, t0, tokenizer, req.prompt_len)
            if bar is not None:
                bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        for i, req in enumerate(requests):
            if i and math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return BenchmarkRun(base_url, model, duration, results)
