#!/usr/bin/env python3
"""The server over HTTP on a GPU: ``servelm serve`` on a saved model folder, driven as a client would.

    python3 scripts/device_http_check.py --model FOLDER [--out DIR]   # the folder device_check.py --keep saved
    python3 scripts/device_http_check.py --build 8b [--out DIR]       # builds the Llama-3-8B-shaped folder itself
    python3 scripts/device_http_check.py --build tiny --device cpu --out /tmp/x  # plumbing only, anywhere

It starts the server from this checkout (no pip install: fastapi, uvicorn and pydantic travel as
wheels on PYTHONPATH), waits for /health, then checks what a client sees: /v1/models, greedy
completions from token ids (identical requests on the same prefix-cache state give identical tokens;
logprobs and usage agree),
SSE streaming ending in [DONE], the clear 400s (a chat request to a model without a chat template, a
prompt over max_model_len, a token id outside the vocabulary, a bad max_tokens) with the engine still
answering after them, a client that disconnects mid-stream; then ``servelm bench`` at one stream and at
256 concurrent (again under py-spy, when it is on PATH, for where the server's threads spend the
time), and /metrics afterwards (request counts, histograms, no KV block left in use). The server's
log, the bench JSONs, the profile and a summary JSON go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
# Runs servelm from the checkout, as scripts/checkout.py maps it (the device machine has no pip install).
LAUNCH = (
    f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import checkout; checkout.use_checkout(); "
    "from servelm.server.cli import main; sys.exit(main(sys.argv[1:]))"
)
NAME = "llama8b-random"


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def check(self, name: str, ok: bool, detail: str = "", **numbers: Any) -> bool:
        self.rows.append({"name": name, "ok": bool(ok), "detail": detail, **numbers})
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        return bool(ok)


def build(shape_name: str, device: str, folder: Path) -> None:
    """A random Llama (tiny, or Llama-3-8B-shaped in bf16) + word-level tokenizer, saved to ``folder``."""
    sys.path.insert(0, str(SCRIPTS))
    import checkout

    checkout.use_checkout()
    import torch
    from device_checks.common import LLAMA3_8B, TINY, build_hf_model, save_model_folder

    shape, dtype = (TINY, torch.float32) if shape_name == "tiny" else (LLAMA3_8B, torch.bfloat16)
    t0 = time.perf_counter()
    model = build_hf_model(shape, dtype, torch.device(device), 0)
    save_model_folder(model, folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the server sizes its KV pool from the GPU memory left
    print(f"built and saved a random {shape_name} Llama in {time.perf_counter() - t0:.1f} s", flush=True)


def start_server(args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-c", LAUNCH, "serve", "--model", str(args.model), "--served-model-name", NAME,
        "--device", args.device, "--port", str(args.port), "--host", "127.0.0.1",
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    if args.device == "cuda":
        cmd += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.85"]
    else:
        cmd += ["--dtype", "float32", "--kv-cache-memory", str(64 * 2**20), "--num-threads", "1"]
    print("server:", " ".join(cmd[3:]), flush=True)
    # Its own process group, so the check can end it and any helper it started; the child keeps its own copy of the log's fd.
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float) -> float | None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            return None
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return None


def error_shape(r: httpx.Response) -> str:
    """'' when ``r`` is a 4xx in OpenAI's error shape, else what is wrong."""
    if not 400 <= r.status_code < 500:
        return f"status {r.status_code}"
    try:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err
    except Exception:
        return f"body {r.text[:200]!r}"
    return ""


def greedy(c: httpx.Client, prompt: list[int], n: int) -> dict[str, Any]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    r = c.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()


def api_checks(c: httpx.Client, ck: Checks, vocab: int, max_model_len: int) -> None:
    models = c.get("/v1/models").json()
    ck.check("GET /v1/models", [m["id"] for m in models["data"]] == [NAME], json.dumps(models)[:160])

    # The first request computes the whole prompt; the later ones find all but its last block in the
    # prefix cache, so their prefill runs on other shapes: in bf16 that may round differently, and a
    # random-weight model's flat logits turn that into other tokens. So cached runs are compared with
    # each other, and the uncached one is only reported.
    prompt = list(range(100, 228))
    a, b, b2 = greedy(c, prompt, 32), greedy(c, prompt, 32), greedy(c, prompt, 32)
    ta, tb = a["choices"][0]["logprobs"]["tokens"], b["choices"][0]["logprobs"]["tokens"]
    lp = b["choices"][0]["logprobs"]["token_logprobs"]
    ck.check(
        "greedy completion from token ids, twice on the same cache state",
        tb == b2["choices"][0]["logprobs"]["tokens"]
        and len(tb) == 32
        and b["usage"] == {**b["usage"], "prompt_tokens": 128, "completion_tokens": 32}
        and all(x is not None and x <= 1e-6 for x in lp),
        f"usage {b['usage']}; first logprobs {lp[:3]}; uncached run's tokens equal: {ta == tb}",
    )

    body = {"model": NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, done, text = [], False, ""
    with c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            ev = json.loads(line[6:])
            chunks.append(ev)
            text += "".join(ch.get("text", "") for ch in ev.get("choices", []))
    usage = next((ev["usage"] for ev in chunks if ev.get("usage")), None)
    same = text == greedy(c, prompt, 16)["choices"][0]["text"]
    ck.check(
        "streamed completion (SSE)",
        done and usage is not None and usage["completion_tokens"] == 16 and same,
        f"{len(chunks)} events, [DONE] {done}, usage {usage}, text equals the non-streamed greedy text: {same}",
    )

    bad = {
        "chat to a model without a chat template": ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "t5 t6"}]}),
        "prompt over max_model_len": ("/v1/completions", {"model": NAME, "prompt": [5] * (max_model_len + 1), "max_tokens": 1}),
        "token id outside the vocabulary": ("/v1/completions", {"model": NAME, "prompt": [5, vocab + 7], "max_tokens": 1}),
        "max_tokens -1": ("/v1/completions", {"model": NAME, "prompt": [5, 6], "max_tokens": -1}),
        "unknown model": ("/v1/completions", {"model": "nope", "prompt": [5, 6], "max_tokens": 1}),
    }  # fmt: skip
    for name, (path, body) in bad.items():
        r = c.post(path, json=body)
        problem = error_shape(r)
        ck.check(f"4xx: {name}", not problem, problem or f"{r.status_code} {r.json()['error']['message'][:120]!r}")

    # A client that leaves mid-stream: the request is aborted and its blocks come back (checked in /metrics).
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with c.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 8:
                break
    after = greedy(c, prompt, 32)["choices"][0]["logprobs"]["tokens"]
    ck.check(
        "engine answers after the bad requests and a dropped stream", after == tb, f"same greedy tokens: {after == tb}"
    )


def bench(
    args: argparse.Namespace, tag: str, prompts: int, concurrency: int, out: Path, profile_pid: int = 0
) -> dict[str, Any] | None:
    cmd = [
        sys.executable, "-c", LAUNCH, "bench", "--base-url", f"http://127.0.0.1:{args.port}", "--model", NAME,
        "--tokenizer", str(args.model), "--token-ids", "--ignore-eos", "--disable-tqdm",
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--result-json", str(out / f"bench_{tag}.json"),
    ]  # fmt: skip
    print(f"\n== servelm bench: {tag} ({prompts} requests, concurrency {concurrency})", flush=True)
    t0 = time.perf_counter()
    load = subprocess.Popen(cmd, cwd=str(REPO))
    if profile_pid:
        # Once requests are running (the client takes seconds to start), every thread's stack, idle
        # ones too (a thread waiting for the GIL is idle to the OS), without stopping the server.
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline and load.poll() is None:
            if (
                metric(
                    httpx.get(f"http://127.0.0.1:{args.port}/metrics", timeout=5).text, "servelm_num_requests_running"
                )
                > 0
            ):
                break
            time.sleep(0.2)
        subprocess.run(["py-spy", "record", "--pid", str(profile_pid), "--rate", "250", "--nonblocking", "--threads", "--idle",
                        "--format", "raw", "--duration", str(args.profile_seconds), "-o", str(out / f"pyspy_{tag}.txt")])  # fmt: skip
    rc = load.wait()
    print(f"   ({time.perf_counter() - t0:.1f} s, exit {rc})", flush=True)
    path = out / f"bench_{tag}.json"
    if not path.exists():
        return None
    res = json.loads(path.read_text())
    res.pop("requests", None)
    return res


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples (every label set) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a saved HF model folder with its tokenizer")
    p.add_argument(
        "--build",
        choices=("tiny", "8b"),
        default=None,
        help="build a random Llama in --out (or /dev/shm) and serve that",
    )
    p.add_argument(
        "--profile-seconds",
        type=int,
        default=8,
        help="seconds of py-spy over a third 256-concurrent run, when py-spy is on PATH (0: no third run)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=8377)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single", type=int, default=8, help="requests of the one-stream run")
    p.add_argument("--concurrent", type=int, default=256)
    p.add_argument("--start-timeout", type=float, default=300)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.build:
        args.model = (Path("/dev/shm") if args.build == "8b" else args.out) / f"{args.build}-model"
        build(args.build, args.device, args.model)
    if args.build == "tiny":
        args.max_model_len, args.max_num_seqs = min(args.max_model_len, 1024), min(args.max_num_seqs, 16)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ck = Checks()
    summary: dict[str, Any] = {"checks": ck.rows}
    proc = start_server(args, args.out / "server.log")
    base = f"http://127.0.0.1:{args.port}"
    try:
        startup = wait_healthy(proc, base, args.start_timeout)
        if not ck.check(
            "server starts and answers /health", startup is not None, f"{startup or 0:.1f} s", startup_s=startup
        ):
            return 1
        summary["startup_s"] = startup
        print("\n== API checks", flush=True)
        with httpx.Client(base_url=base, timeout=120) as c:
            try:
                api_checks(c, ck, vocab, args.max_model_len)
            except Exception as e:  # one broken check must not hide the load runs
                ck.check("API checks", False, f"raised {type(e).__name__}: {e}")
            summary["one_stream"] = bench(args, "one_stream", args.single, 1, args.out)
            summary["concurrent"] = bench(args, "concurrent", 2 * args.concurrent, args.concurrent, args.out)
            if args.profile_seconds and shutil.which("py-spy"):
                summary["concurrent_profiled"] = bench(
                    args, "concurrent_profiled", 3 * args.concurrent, args.concurrent, args.out, proc.pid
                )
            for tag in ("one_stream", "concurrent"):
                s = summary[tag]
                ck.check(f"bench {tag}: every request succeeded", bool(s) and s.get("failed") == 0 and s.get("completed", 0) > 0,
                         json.dumps({k: s.get(k) for k in ("completed", "failed", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")}) if s else "no result")  # fmt: skip
            time.sleep(1.0)
            text = c.get("/metrics").text
        (args.out / "metrics.txt").write_text(text)
        usage = metric(text, "servelm_kv_cache_usage_perc")
        ck.check("no KV block in use once idle", usage == 0.0, f"servelm_kv_cache_usage_perc {usage}")
        ttft = metric(text, "servelm_time_to_first_token_seconds_count")
        ck.check("TTFT histogram counted the requests", ttft >= args.single + 2 * args.concurrent, f"count {ttft:.0f}")
        steps = metric(text, "servelm_iteration_tokens_count")
        summary["engine_steps"] = steps
        ck.check("server still alive", proc.poll() is None, "")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            summary["server_exit"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            summary["server_exit"] = "killed"
        (args.out / "http_check.json").write_text(json.dumps(summary, indent=2, default=str))
        if args.build == "8b":
            shutil.rmtree(args.model, ignore_errors=True)
    ok = all(r["ok"] for r in ck.rows)
    print(f"\nHTTP check: {sum(r['ok'] for r in ck.rows)}/{len(ck.rows)} passed; server exit {summary['server_exit']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
