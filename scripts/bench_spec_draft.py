"""What a draft model gives one greedy stream: Qwen2.5-Coder-1.5B-Instruct alone against the same with
Qwen2.5-Coder-0.5B-Instruct drafting K tokens a step (both Q4_K_M GGUF files, served as stored), on a
few code prompts.

    .venv/bin/python scripts/bench_spec_draft.py [--tokens 128] [--rounds 1] [--ks 3,4,5]
                                                 [--target FILE] [--draft FILE] [--num-threads 2]
    .venv/bin/python scripts/bench_spec_draft.py --llama-server http://127.0.0.1:18441 [--tokens 128]

Both engines are loaded side by side; one engine with the draft serves every K (its proposer's
``num_speculative_tokens`` is set between runs). Each run's inter-token latency is (last token - first
token) / (tokens - 1), from the engine's own timestamps (the prefill is not in it); tok/s is its
inverse. Printed per prompt and K: medians over rounds, the speed-up, the acceptance rate (drafts kept
/ drafts verified), the mean accepted length (tokens a step: 1 + kept / verifications), and whether the
tokens equal the target's alone (they must: greedy verification is exact). With ``--llama-server``, the
same prompts against a llama-server already started on the same files (``-md DRAFT`` for its draft).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import bench_speculative
import checkout

checkout.use_checkout()

from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402

MODELS = Path.home() / ".cache" / "servelm" / "models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
CODE = bench_speculative.CODE  # the same function the n-gram benchmark edits
PROMPTS = {
    "write": "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "type-hints": f"Add type hints to this Python function. Answer with the whole function only.\n\n{CODE}",
    "explain": f"Explain what this function does, step by step.\n\n{CODE}",
}


class _Timestamps:
    def __init__(self) -> None:
        self.finished: list[Any] = []
        self.drafts = 0  # verifications (sequences whose drafts a step verified)

    def on_step(self, stats: Any) -> None:
        self.drafts += stats.num_drafts

    def on_request_finished(self, stats: Any) -> None:
        self.finished.append(stats)

    def on_request_rejected(self) -> None:
        pass


def llama_server(url: str, tokens: int) -> None:
    """The same prompts against a running llama-server (with or without ``-md``), from the ``timings`` it
    returns: time per generated token after the prompt, and its drafts accepted."""
    import urllib.request

    print(f"llama-server at {url}: {tokens} tokens, greedy, one stream")
    print(f"{'prompt':<11} {'ITL ms':>8} {'tok/s':>7} {'accepted':>9} tokens")
    for pname, text in PROMPTS.items():
        body = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": tokens,
            "temperature": 0,
            "cache_prompt": False,
        }
        for _ in range(2):  # the first warms up
            req = urllib.request.Request(
                f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                t = json.load(r)["timings"]
        drafted = t.get("draft_n", 0)
        rate = f"{t.get('draft_n_accepted', 0) / drafted:.0%}" if drafted else "-"
        ms = t["predicted_ms"] / t["predicted_n"]
        print(f"{pname:<11} {ms:>8.1f} {1000 / ms:>7.1f} {rate:>9} {t['predicted_n']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ks", default="3,4,5", help="num_speculative_tokens values, comma-separated")
    ap.add_argument("--target", type=Path, default=TARGET)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument(
        "--llama-server", metavar="URL", help="measure a running llama-server instead (e.g. http://127.0.0.1:18441)"
    )
    ap.add_argument(
        "--concurrency", metavar="N,N", help="then: this many requests at once, each count in turn (e.g. 1,2,4)"
    )
    args = ap.parse_args()
    if args.llama_server:
        llama_server(args.llama_server, args.tokens)
        return
    ks = [int(k) for k in args.ks.split(",")]
    spec = json.dumps({"method": "draft_model", "model": str(args.draft), "num_speculative_tokens": ks[0]})
    engines: dict[str, tuple[Engine, _Timestamps]] = {}
    for name, sc in (("target", None), ("draft", spec)):
        obs = _Timestamps()
        t0 = time.perf_counter()
        cfg = EngineConfig(model=str(args.target), kv_cache_memory=512 * 2**20, max_model_len=2048,
                           num_threads=args.num_threads, speculative_config=sc)  # fmt: skip
        engines[name] = (Engine(cfg, observer=obs), obs)
        print(f"loaded {name} engine in {time.perf_counter() - t0:.1f} s", flush=True)
    plain, spec_engine = engines["target"][0], engines["draft"][0]
    proposer: Any = spec_engine.proposer
    tok = plain.tokenizer
    params = SamplingParams(max_tokens=args.tokens, temperature=0)  # answers end where the model ends them
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.target.name} with {args.draft.name} drafting, "
          f"{args.tokens} tokens, greedy, one stream, medians of {args.rounds} round(s)")  # fmt: skip
    print(
        f"{'prompt':<11} {'K':>2} {'ITL ms':>8} {'tok/s':>7} {'target ms':>10} {'speed-up':>9} {'accepted':>9} {'mean len':>9} same"
    )
    for pname, text in PROMPTS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        for e, _ in engines.values():  # warm-up: the prompt's first kernels and caches
            e.generate([ids], SamplingParams(max_tokens=4, temperature=0))
        runs: dict[str, list[float]] = {}
        outs: dict[str, list[int]] = {}
        stats: dict[str, tuple[int, int, int]] = {}
        for _ in range(args.rounds):
            for name in ["target"] + [f"K={k}" for k in ks]:
                e, obs = engines["target" if name == "target" else "draft"]
                if name != "target":
                    proposer.config = dataclasses.replace(proposer.config, num_speculative_tokens=int(name[2:]))
                before = (e.drafts_verified, e.num_accepted_drafts, obs.drafts)
                (res,) = e.generate([ids], params)
                st = obs.finished[-1]
                outs[name] = res.outputs[0].token_ids
                runs.setdefault(name, []).append(
                    (st.last_token_time - st.first_token_time) / (st.num_generation_tokens - 1)
                )
                if name != "target":
                    v, a, n = stats.get(name, (0, 0, 0))
                    stats[name] = (
                        v + e.drafts_verified - before[0],
                        a + e.num_accepted_drafts - before[1],
                        n + obs.drafts - before[2],
                    )
        base = statistics.median(runs["target"])
        print(f"{pname:<11} best of rounds: " + ", ".join(f"{n} {min(r) * 1000:.1f} ms" for n, r in runs.items()))
        print(f"{pname:<11} {'-':>2} {base * 1000:>8.1f} {1 / base:>7.1f} {base * 1000:>10.1f} {'':>9} {'':>9} {'':>9}")
        for k in ks:
            name = f"K={k}"
            itl = statistics.median(runs[name])
            v, a, n = stats[name]
            rate = a / v if v else 0.0
            mean_len = 1 + a / n if n else 1.0  # drafts kept per verification, + the target's own token
            print(f"{pname:<11} {k:>2} {itl * 1000:>8.1f} {1 / itl:>7.1f} {base * 1000:>10.1f} {base / itl:>8.2f}x "
                  f"{rate:>8.0%} {mean_len:>9.2f} {outs[name] == outs['target']}")  # fmt: skip
    if args.concurrency:
        concurrent(engines, [int(c) for c in args.concurrency.split(",")], ks[0], args.tokens)


def concurrent(engines: dict[str, tuple[Engine, _Timestamps]], counts: list[int], k: int, tokens: int) -> None:
    """Where drafting stops paying: ``c`` requests at once (the prompts in turn), output tok/s over the
    batch's wall time, the target alone and with the draft (K = ``k``, drafting whatever the batch)."""
    plain, spec_engine = engines["target"][0], engines["draft"][0]
    proposer: Any = spec_engine.proposer
    proposer.config = dataclasses.replace(proposer.config, num_speculative_tokens=k, max_running=max(counts))
    tok = plain.tokenizer
    asks = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in PROMPTS.values()
    ]
    ids = [list(a["input_ids"] if hasattr(a, "keys") else a) for a in asks]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    print(f"concurrent requests, {tokens} tokens each (ignore_eos), output tok/s over the batch, K={k}")
    print(f"{'requests':>8} {'target':>8} {'drafted':>8} {'ratio':>6}")
    for c in counts:
        batch = [ids[i % len(ids)] for i in range(c)]
        rates = []
        for e in (plain, spec_engine):
            t0 = time.perf_counter()
            out = e.generate(batch, params)
            rates.append(sum(len(r.outputs[0].token_ids) for r in out) / (time.perf_counter() - t0))
        print(f"{c:>8} {rates[0]:>8.1f} {rates[1]:>8.1f} {rates[1] / rates[0]:>5.2f}x")


if __name__ == "__main__":
    main()
