"""Several models behind one server (issue 46), measured: the time to first token of a request that
must load its model (page cache warm, and "cold": the model's files evicted from the page cache with
posix_fadvise(DONTNEED), which needs no root but is advisory), and the server's resident memory over a
rotation through four models under a memory budget that holds about two.

    python scripts/bench_models.py [--rounds 2] [--budget 1200MiB] [--port 18630]

Prints one line per request: the model, whether it waited for a load (and how long), TTFT, the
models loaded after it, and the server's VmRSS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def models_file(tmp: Path, budget: str) -> tuple[Path, dict[str, Path]]:
    sys.path.insert(0, str(REPO))
    from servelm.runtime.model_fetch import ensure
    from servelm.runtime.model_files import ensure_default_model

    paths = {
        "smol": ensure_default_model(),
        "gemma": ensure("gemma3"),
        "qwen05": ensure("qwen05"),
        "minilm": ensure("minilm"),
    }
    gen = {"kv_cache_memory": "64MiB", "max_model_len": 1024}
    models = [
        {"id": "smol", "path": "default", **gen},
        {"id": "gemma", "path": str(paths["gemma"]), **gen},
        {"id": "qwen05", "path": str(paths["qwen05"]), **gen},
        {"id": "minilm", "path": str(paths["minilm"])},
    ]
    path = tmp / "models.yaml"
    path.write_text(json.dumps({"memory_budget": budget, "models": models}))
    return path, paths


def evict_page_cache(path: Path) -> None:
    """Ask the kernel to drop the files' clean pages (advisory; no root needed)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(path: Path) -> None:
    """Read the files once, so that a load finds them in the page cache."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def rss_mib(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else float("nan")


def ask(url: str, model: str) -> tuple[float, float | None]:
    """(TTFT in seconds, seconds waited for a load or None) of one streamed request."""
    started = time.monotonic()
    if model == "minilm":
        r = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": "a sentence"}, timeout=900)
        r.raise_for_status()
        wait = r.headers.get("x-servelm-model-load-seconds")
        return time.monotonic() - started, float(wait) if wait else None
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        wait = r.headers.get("x-servelm-model-load-seconds")
        ttft = None
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and '"text":""' not in line:
                ttft = time.monotonic() - started
        return ttft or time.monotonic() - started, float(wait) if wait else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", default="1200MiB")
    ap.add_argument("--port", type=int, default=18630)
    ap.add_argument(
        "--ttft-models", default="smol,gemma", help="the models whose load + TTFT is measured, comma-separated"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "serve.log", "w") as log:
        path, paths = models_file(Path(tmp), args.budget)
        proc = subprocess.Popen(
            [sys.executable, "-m", "servelm.server.cli", "serve", "--port", str(args.port), "--models-file", str(path), "--no-access-log"],
            stderr=log, stdout=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
        url = f"http://127.0.0.1:{args.port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            print(f"server up, VmRSS {rss_mib(proc.pid):.0f} MiB, budget {args.budget}")
            # The process's first load also pays its first engine's one-time costs (imports, kernels): unmeasured.
            ask(url, "minilm")
            httpx.post(f"{url}/api/generate", json={"model": "minilm", "keep_alive": 0}, timeout=900)
            # Time to first token with a load: page cache warm (read once just before), evicted, warm again.
            for cold in (False, True, False):
                for model in args.ttft_models.split(","):
                    httpx.post(f"{url}/api/generate", json={"model": model, "keep_alive": 0}, timeout=900)  # unloaded
                    time.sleep(0.5)
                    (evict_page_cache if cold else warm_page_cache)(paths[model])
                    ttft, wait = ask(url, model)
                    print(
                        f"load+TTFT {model:6s} page cache {'cold' if cold else 'warm'}: TTFT {ttft:.2f} s (load {wait or 0:.2f} s)"
                    )
            print("rotation: smol -> gemma -> qwen05 -> minilm, repeated")
            for r in range(args.rounds):
                for model in ("smol", "gemma", "qwen05", "minilm"):
                    ttft, wait = ask(url, model)
                    loaded = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"] if m["state"] == "loaded"]
                    load = f"waited {wait:.2f} s" if wait is not None else "loaded already"
                    print(
                        f"round {r + 1} {model:6s}: {load}, TTFT {ttft:.2f} s, loaded now {loaded}, VmRSS {rss_mib(proc.pid):.0f} MiB"
                    )
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
