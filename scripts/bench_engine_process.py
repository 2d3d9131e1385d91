#!/usr/bin/env python3
"""The HTTP front's tax on the engine: the engine alone (offline, in this process) against ``servelm serve``
over HTTP, with the engine in an engine-core process (the default) and in a thread of the server's
process (``--engine-in-process``, the design before issue 47), one server at a time, same workload.

    .venv/bin/python scripts/bench_engine_process.py [--model PATH] [--streams 1 32 128]
        [--input-len 128] [--output-len 64] [--modes offline split inprocess] [--out FILE.json]
        [--data-parallel-size 1 2]

``--data-parallel-size 1 2`` runs the split mode once per value (``split``, ``split-dp2``): one engine core
against two, same workload (random prompts: no prefix is shared, the balancer goes by load alone).
DP=1 against DP=2 over HTTP: ``--modes split --streams 32 128 --data-parallel-size 1 2``.

Workload at S streams: S requests of ``--input-len`` random token ids and ``--output-len`` tokens
(greedy, ignore_eos), all sent at once, timed to the last token; at one stream, ``--single-requests``
requests one after another. Printed: output tok/s and median ITL per mode and S, and each HTTP mode's
ratio to offline. The HTTP client is ``servelm bench`` in its own process (on a small machine it takes
CPU from the server: the ratio counts it, as a client on the same machine would).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def offline(model: str | None, streams: list[int], args: argparse.Namespace) -> dict[int, dict[str, float]]:
    from servelm.scheduler.config import EngineConfig
    from servelm.scheduler.engine import Engine
    from servelm.scheduler.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model, max_num_seqs=max(streams)))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    out: dict[int, dict[str, float]] = {}
    run(engine, [[rng.randrange(100, vocab - 1000) for _ in range(args.input_len)]], params)  # warm-up
    for s in streams:
        n = args.single_requests if s == 1 else s
        prompts = [[rng.randrange(100, vocab - 1000) for _ in range(args.input_len)] for _ in range(n)]
        if s == 1:
            walls, itls = [], []
            for prompt in prompts:
                wall, gaps = run(engine, [prompt], params)
                walls.append(wall)
                itls += gaps
            tps = n * args.output_len / sum(walls)
            out[s] = {"output_tok_s": tps, "median_itl_ms": statistics.median(itls) * 1e3}
        else:
            wall, gaps = run(engine, prompts, params)
            out[s] = {"output_tok_s": n * args.output_len / wall, "median_itl_ms": statistics.median(gaps) * 1e3}
        print(
            f"offline  S={s:4d}: {out[s]['output_tok_s']:8.1f} tok/s, ITL {out[s]['median_itl_ms']:.2f} ms", flush=True
        )
    return out


def run(engine: Any, prompts: list[list[int]], params: Any) -> tuple[float, list[float]]:
    """Wall seconds to the last token of all ``prompts``, and the gaps between a request's tokens."""
    t0 = time.perf_counter()
    for prompt in prompts:
        engine.add_request(engine.new_offline_id(), prompt, params)
    last: dict[str, float] = {}
    gaps: list[float] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if not any(c.new_token_ids for c in o.outputs):
                continue
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
    return time.perf_counter() - t0, gaps


def http(
    model: str | None, streams: list[int], flags: list[str], args: argparse.Namespace
) -> dict[int, dict[str, float]]:
    port = args.port
    cmd = [sys.executable, "-m", "servelm.server.cli", "serve", "--port", str(port), "--no-access-log", *flags]
    if model:
        cmd += ["--model", model]
    cmd += ["--max-num-seqs", str(max(streams)), "--max-waiting-requests", str(4 * max(streams))]
    log = Path(tempfile.mkdtemp(prefix="servelm-bench-")) / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    out: dict[int, dict[str, float]] = {}
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        loadgen(base, 1, 1, args)  # warm-up
        for s in streams:
            n = args.single_requests if s == 1 else s
            r = loadgen(base, n, s, args)
            out[s] = {"output_tok_s": r["output_throughput"], "median_itl_ms": r["median_itl_ms"]}
            label = " ".join(flags) or "split"
            print(
                f"http {label:>19} S={s:4d}: {out[s]['output_tok_s']:8.1f} tok/s, ITL {out[s]['median_itl_ms']:.2f} ms",
                flush=True,
            )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    return out


def loadgen(base: str, n: int, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            sys.executable, "-m", "servelm.server.cli", "bench", "--base-url", base, "--num-prompts", str(n),
            "--max-concurrency", str(concurrency), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--ignore-eos", "--token-ids", "--disable-tqdm", "--result-json", f.name,
        ]  # fmt: skip
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        data: dict[str, Any] = json.loads(Path(f.name).read_text())
    summary: dict[str, Any] = data.get("summary", data)
    if isinstance(summary, list):
        summary = summary[0]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--tokenizer", default=None, help="for the client's prompts (default: the default model's)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--single-requests", type=int, default=4, help="requests, one after another, at one stream")
    ap.add_argument("--modes", nargs="+", default=["offline", "split", "inprocess"])
    ap.add_argument("--rounds", type=int, default=1, help="runs of every mode, in turn; medians are printed")
    ap.add_argument("--api-server-count", type=int, default=1, help="split: API processes in front of the core")
    ap.add_argument(
        "--data-parallel-size",
        type=int,
        nargs="+",
        default=[1],
        help="split: engine cores behind the API process(es); one split run per value ('split', 'split-dp2'...)",
    )
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--out", default=None, help="write the numbers here (JSON)")
    args = ap.parse_args()
    # "plain": no flag (a checkout from before the split, run through PYTHONPATH, steps its engine in a thread)
    flags: dict[str, list[str]] = {}
    for mode in args.modes:
        if mode == "split":
            for dp in args.data_parallel_size:
                name = "split" if dp == 1 else f"split-dp{dp}"
                flags[name] = ["--api-server-count", str(args.api_server_count)]
                if dp != 1:  # (one core: the command line of the runs before the flag existed)
                    flags[name] += ["--data-parallel-size", str(dp)]
        else:
            flags[mode] = {"inprocess": ["--engine-in-process"], "plain": [], "offline": []}[mode]
    runs: dict[str, list[dict[int, dict[str, float]]]] = {m: [] for m in flags}
    for _ in range(args.rounds):
        for mode in flags:
            if mode == "offline":
                runs[mode].append(offline(args.model, args.streams, args))
            else:
                runs[mode].append(http(args.model, args.streams, flags[mode], args))
    results = {
        m: {s: {k: statistics.median(r[s][k] for r in rs) for k in rs[0][s]} for s in args.streams}
        for m, rs in runs.items()
    }
    for m, by_s in results.items():
        for s, v in by_s.items():
            print(
                f"median of {args.rounds}: {m:>10} S={s:4d}: {v['output_tok_s']:8.1f} tok/s, ITL {v['median_itl_ms']:.2f} ms"
            )
    if "offline" in results:
        for mode in results:
            if mode == "offline":
                continue
            for s in args.streams:
                a, o = results[mode][s], results["offline"][s]
                ratio = a["output_tok_s"] / o["output_tok_s"]
                itl = a["median_itl_ms"] / o["median_itl_ms"]
                print(f"{mode:>9} / offline at S={s:4d}: throughput {ratio:.3f}x, median ITL {itl:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
