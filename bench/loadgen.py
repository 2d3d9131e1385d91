"""``servelm bench``: an async load generator for any OpenAI-compatible server.

Sends streaming completions or chat requests (Poisson arrivals or all at once, optionally capped
in concurrency), times every streamed chunk, takes token counts from the server's usage chunk
(``stream_options.include_usage``), and prints throughput plus TTFT / TPOT / ITL / end-to-end
latency statistics. ``--compare-base-url`` replays the same workload against a second server
(e.g. one started with ``--scheduling-policy static``) and prints the ratio of every figure.

Run as ``servelm bench ...`` or ``python -m servelm.bench.loadgen ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from servelm.bench.datasets import BenchRequest, Tokenizer, count_tokens, jsonl_requests, load_tokenizer, random_requests

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = (  # (key, title, abbreviation)
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


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


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * scale
    out: dict[str, float | None] = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def summarize(run: BenchmarkRun) -> dict[str, Any]:
    """Throughput and latency statistics (latencies in ms) of a run, flat like vLLM's result JSON."""
    ok = [r for r in run.results if r.success]
    failed = [r for r in run.results if not r.success]
    dur = run.duration if run.duration > 0 else float("nan")
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    s: dict[str, Any] = {
        "base_url": run.base_url,
        "model": run.model,
        "completed": len(ok),
        "failed": len(failed),
        "duration": run.duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "errors": sorted({r.error for r in failed})[:10],
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for key, values in series.items():
        for stat, v in _stats(values).items():
            s[f"{stat}_{key}_ms"] = v
    return s


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    width = 52
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<38}{_fmt(value):>14}")

    row("Base URL:", s["base_url"])
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, name, abbr in LATENCY_METRICS:
        lines.append(f" {name} ".center(width, "-"))
        row(f"Mean {abbr} (ms):", s[f"mean_{key}_ms"])
        row(f"Median {abbr} (ms):", s[f"median_{key}_ms"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {abbr} (ms):", s[f"p{p}_{key}_ms"])
    lines.append("=" * width)
    for e in s.get("errors") or []:
        lines.append(f"error: {e}")
    return "\n".join(lines)


COMPARED = (
    ("completed", "Successful requests"),
    ("duration", "Duration (s)"),
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output throughput (tok/s)"),
    ("total_token_throughput", "Total throughput (tok/s)"),
) + tuple(
    (f"{stat}_{key}_ms", f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {abbr} (ms)")
    for key, _, abbr in LATENCY_METRICS
    for stat in ("mean", "median", "p99")
)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """B / A for every compared figure (None where A is 0 or missing)."""
    out: dict[str, float | None] = {}
    for key, _ in COMPARED:
        va, vb = a.get(key), b.get(key)
        out[key] = vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
    return out


def format_comparison(a: dict[str, Any], b: dict[str, Any]) -> str:
    ratio = compare(a, b)
    lines = [
        " Comparison ".center(72, "="),
        f"A = {a['base_url']}",
        f"B = {b['base_url']}",
        f"{'':<32}{'A':>12}{'B':>12}{'B/A':>12}",
    ]
    for key, label in COMPARED:
        r = ratio[key]
        lines.append(f"{label:<32}{_fmt(a.get(key)):>12}{_fmt(b.get(key)):>12}{(f'{r:.3f}x' if r else 'n/a'):>12}")
    lines.append("=" * 72)
    return "\n".join(lines)


def tokens_per_second(run: BenchmarkRun, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s over time: each request's tokens spread evenly over its content chunks."""
    nbins = max(1, int(math.ceil(run.duration / bin_s)))
    counts = np.zeros(nbins)
    for r in run.results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        for t in r.chunk_times:
            counts[min(nbins - 1, int(t / bin_s))] += per_chunk
    return np.arange(nbins) * bin_s, counts / bin_s


def plot(runs: list[BenchmarkRun], path: str | Path) -> None:
    """Latency distributions (TTFT, TPOT, ITL, E2E) and output tokens/s over time, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        ("TTFT (ms)", lambda rs: [r.ttft * 1e3 for r in rs]),
        ("TPOT (ms)", lambda rs: [r.tpot * 1e3 for r in rs if r.tpot is not None]),
        ("ITL (ms)", lambda rs: [g * 1e3 for r in rs for g in r.itl]),
        ("End-to-end latency (s)", lambda rs: [r.latency for r in rs]),
    ]
    for ax, (label, values) in zip(axes.flat, panels):
        per_run = [values([r for r in run.results if r.success]) for run in runs]
        everything = [x for v in per_run for x in v]
        if not everything:
            continue
        bins = np.histogram_bin_edges(everything, bins=40)  # shared, so the runs compare bar for bar
        for run, v in zip(runs, per_run):
            if v:
                ax.hist(v, bins=bins, alpha=0.6, label=run.base_url)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    ax = axes.flat[4]
    longest = max(run.duration for run in runs)
    bin_s = max(0.05, longest / 60)  # about 60 points whatever the run's length
    for run in runs:
        t, tps = tokens_per_second(run, bin_s)
        ax.step(t, tps, where="post", label=run.base_url)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax = axes.flat[5]
    for run in runs:  # requests in flight over time
        events = sorted(
            [(r.start, 1) for r in run.results] + [(r.start + r.latency, -1) for r in run.results if r.success]
        )
        if events:
            xs, ys, n = [], [], 0
            for t, d in events:
                n += d
                xs.append(t)
                ys.append(n)
            ax.step(xs, ys, where="post", label=run.base_url)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests in flight")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------
def _default_tokenizer() -> str | None:
    from servelm.runtime.model_files import default_model_dir

    d = default_model_dir()
    return str(d) if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file() else None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", choices=("random",), default="random", help="ignored when --dataset-path is given")
    p.add_argument("--dataset-path", default=None, help='JSONL: {"prompt": ..., "max_tokens": ...} or {"messages": [...]}')
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens (after the shared prefix)")
    p.add_argument("--output-len", type=int, default=128, help="random: max_tokens (also the JSONL default)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1±r)")
    p.add_argument("--prefix-len", type=int, default=0, help="random: tokens of a prefix shared by every prompt")
    p.add_argument("--token-ids", action="store_true", help="completions: send prompts as token ids")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM-style extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (default: the default model's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--compare-base-url", default=None, help="run the same workload against a second server")
    p.add_argument("--result-json", default=None, help="write the summary and per-request data here")
    p.add_argument("--plot", default=None, help="write latency distributions and tokens/s over time (PNG)")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on a CLI's subparsers (``servelm bench``); sets ``func=run``."""
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _build_requests(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[BenchRequest]:
    if args.dataset_path:
        return jsonl_requests(args.dataset_path, args.num_prompts, args.output_len, args.endpoint, tokenizer)
    if tokenizer is None:
        raise ValueError("the random dataset needs a tokenizer: pass --tokenizer PATH (a local folder)")
    return random_requests(
        tokenizer,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.prefix_len,
        args.seed,
        args.endpoint,
        args.token_ids,
    )


def _run_json(run: BenchmarkRun, summary: dict[str, Any]) -> dict[str, Any]:
    out = dict(summary)
    out["requests"] = [
        {k: v for k, v in asdict(r).items() if k != "chunk_times"} | {"tpot": r.tpot} for r in run.results
    ]
    return out


def _finite(x: Any) -> Any:
    """JSON has no inf/nan (``--request-rate inf``): write null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    """Run ``servelm bench``; 0 when every request succeeded, 1 when some failed, 2 on bad input."""
    tok_path = args.tokenizer or _default_tokenizer()
    try:
        tokenizer = load_tokenizer(tok_path) if tok_path else None
        requests = _build_requests(args, tokenizer)
        extra = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    except (ValueError, OSError) as e:
        print(f"servelm bench: {e}", file=sys.stderr)
        return 2

    targets = [args.base_url] + ([args.compare_base_url] if args.compare_base_url else [])
    runs: list[BenchmarkRun] = []
    summaries: list[dict[str, Any]] = []
    for url in targets:
        try:
            r = asyncio.run(
                run_benchmark(
                    url,
                    requests,
                    model=args.model,
                    endpoint=args.endpoint,
                    request_rate=args.request_rate,
                    max_concurrency=args.max_concurrency,
                    seed=args.seed,
                    ignore_eos=args.ignore_eos,
                    temperature=args.temperature,
                    extra_body=extra,
                    api_key=args.api_key,
                    tokenizer=tokenizer,
                    timeout_s=args.timeout,
                    progress=not args.disable_tqdm,
                )
            )
        except (httpx.HTTPError, RuntimeError, OSError) as e:
            print(f"servelm bench: {url}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        s = summarize(r)
        runs.append(r)
        summaries.append(s)
        tag = f" ({'AB'[len(runs) - 1]})" if len(targets) > 1 else ""
        print(format_summary(s, "Serving Benchmark Result" + tag))
    if len(summaries) == 2:
        print(format_comparison(*summaries))

    if args.result_json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        out = _run_json(runs[0], summaries[0])
        out["config"] = config
        if len(runs) == 2:
            out["compare"] = _run_json(runs[1], summaries[1])
            out["ratio"] = compare(summaries[0], summaries[1])
        Path(args.result_json).write_text(json.dumps(_finite(out), indent=2, allow_nan=False, default=str))
    if args.plot:
        plot(runs, args.plot)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servelm.bench.loadgen", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
