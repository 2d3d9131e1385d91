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
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from servelm.bench.client import BenchmarkRun, run_benchmark
from servelm.bench.datasets import BenchRequest, Tokenizer, jsonl_requests, load_tokenizer, random_requests
from servelm.bench.report import compare, format_comparison, format_summary, plot, summarize


def _default_tokenizer() -> str | None:
    from servelm.runtime.model_files import default_model_dir

    d = default_model_dir()
    return str(d) if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file() else None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", choices=("random",), default="random", help="ignored when --dataset-path is given")
    p.add_argument(
        "--dataset-path", default=None, help='JSONL: {"prompt": ..., "max_tokens": ...} or {"messages": [...]}'
    )
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens (after the shared prefix)")
    p.add_argument("--output-len", type=int, default=128, help="random: max_tokens (also the JSONL default)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1±r)")
    p.add_argument("--prefix-len", type=int, default=0, help="random: tokens of a prefix shared by every prompt")
    p.add_argument("--token-ids", action="store_true", help="completions: send prompts as token ids")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (inf: all at once)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM-style extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (default: the default model's)")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--compare-base-url", default=None, help="run the same workload against a second server")
    p.add_argument("--result-json", default=None, help="write the summary and per-request data here")
    p.add_argument("--plot", default=None, help="write latency distributions and tokens/s over time (PNG)")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on a CLI's subparsers (``servelm bench``); sets ``func=run``."""
    p = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server", description=__doc__.split("\n\n")[0]
    )
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
