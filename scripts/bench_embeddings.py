"""Embedding throughput, servelm against sentence-transformers' ``encode`` and llama.cpp's ``llama-server
--embedding``, on the same texts in the same run, one at a time (no two measured together).

    python scripts/bench_embeddings.py --model minilm            # servelm vs sentence-transformers
    python scripts/bench_embeddings.py --model nomic             # servelm vs llama-server (the GGUF file)

Two workloads of the same ``--texts`` texts (each ``--tokens`` tokens long): batch 1 (one text per request,
one request at a time) and batch 64 (requests of 64 texts). servelm and llama-server are HTTP servers
driven by one client (httpx, token ids in, float vectors out: the same work for both); sentence-transformers
runs ``encode`` in its own process with ``batch_size`` 1 and 64. Each figure is the median of
``--rounds`` rounds; memory is the process's peak resident set (VmHWM). Prints a Markdown table and
writes JSON beside it when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

LLAMA_SERVER = Path.home() / ".cache/servelm/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
SENTENCES = [
    "Retrieval systems split long documents into passages and embed each one.",
    "Le gouvernement a annoncé mardi une réforme des retraites très contestée.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "The committee will meet again next week to discuss the budget for the coming year.",
    "Der Bundestag hat am Donnerstag über das neue Klimaschutzgesetz abgestimmt.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name;",
]


def make_inputs(tokenizer: Any, n: int, tokens: int) -> list[list[int]]:
    """``n`` different token id lists of exactly ``tokens`` tokens (special tokens included)."""
    out = []
    for i in range(n):
        text = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(tokens // 8 + 2))
        ids = tokenizer(text)["input_ids"]
        out.append(ids[: tokens - 1] + ids[-1:])
    return out


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not start")


def drive(url: str, inputs: list[list[int]], batch: int, rounds: int) -> list[float]:
    """Seconds per round of embedding every input, ``batch`` inputs per request, one request at a time."""
    times = []
    with httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/embeddings", json={"input": inputs[:batch]}).raise_for_status()  # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(0, len(inputs), batch):
                r = client.post(f"{url}/v1/embeddings", json={"input": inputs[i : i + batch]})
                r.raise_for_status()
                assert len(r.json()["data"]) == len(inputs[i : i + batch])
            times.append(time.perf_counter() - t0)
    return times


def run_server(name: str, argv: list[str], url: str, inputs: list[list[int]], rounds: int) -> dict[str, Any]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url, proc)
        result = {b: drive(url, inputs, b, rounds) for b in (1, 64)}
        return {"name": name, "seconds": result, "peak_rss": peak_rss(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(60)


ST_CHILD = """
import json, sys, time, torch
from sentence_transformers import SentenceTransformer
folder, rounds = sys.argv[1], int(sys.argv[2])
inputs = json.load(sys.stdin)
model = SentenceTransformer(folder, device="cpu")
texts = [model.tokenizer.decode(i[1:-1]) for i in inputs]  # the same tokens, as text (encode takes text)
model.max_seq_length = max(len(i) for i in inputs) + 8
out = {}
for batch in (1, 64):
    model.encode(texts[:batch], batch_size=batch)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        model.encode(texts, batch_size=batch, convert_to_tensor=True)
        times.append(time.perf_counter() - t0)
    out[batch] = times
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"seconds": out, "peak_rss": int(hwm) * 1024}))
"""


def run_sentence_transformers(folder: Path, inputs: list[list[int]], rounds: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", ST_CHILD, str(folder), str(rounds)],
        input=json.dumps(inputs), capture_output=True, text=True, check=True,
    )  # fmt: skip
    res = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "name": "sentence-transformers encode",
        "seconds": {int(k): v for k, v in res["seconds"].items()},
        "peak_rss": res["peak_rss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm", help="minilm, mpnet, nomic (fetched like the tests' models) or a path")
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=18455)
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", str(LLAMA_SERVER)))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from servelm.runtime.encoder_tokenizer import load_encoder_tokenizer
    from servelm.runtime.model_fetch import FILES, ensure

    path = ensure(args.model) if args.model in FILES else Path(args.model)
    inputs = make_inputs(load_encoder_tokenizer(str(path)), args.texts, args.tokens)
    url = f"http://127.0.0.1:{args.port}"
    rows = []
    serve = [sys.executable, "-m", "servelm.server.cli", "serve", "--model", str(path), "--port", str(args.port)]
    rows.append(
        run_server(
            "servelm", [*serve, "--max-num-seqs", "64", "--max-num-batched-tokens", "8192"], url, inputs, args.rounds
        )
    )
    if path.suffix == ".gguf":
        llama = [args.llama_server, "-m", str(path), "--embedding", "-nr", "-t", "2", "--port", str(args.port)]
        llama += ["-c", "8192", "-b", "8192", "-ub", "8192", "-np", "64"]
        rows.append(run_server("llama-server --embedding", llama, url, inputs, args.rounds))
    else:
        rows.append(run_sentence_transformers(path, inputs, args.rounds))

    n, total = len(inputs), sum(map(len, inputs))
    print(
        f"\n{path.name}: {n} texts x {args.tokens} tokens, median of {args.rounds} rounds ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n"
    )
    print("| | batch 1 texts/s | batch 1 tokens/s | batch 64 texts/s | batch 64 tokens/s | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = []
        for b in (1, 64):
            s = statistics.median(r["seconds"][b])
            cells += [f"{n / s:.1f}", f"{total / s:.0f}"]
        print(f"| {r['name']} | {' | '.join(cells)} | {r['peak_rss'] / 2**20:.0f} MiB |")
    if args.out:
        args.out.write_text(json.dumps({"model": str(path), "texts": n, "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
