"""What n-gram speculative decoding gives one greedy stream: the default model, time per output token
with and without ``--speculative-config``, on answers that repeat their prompt (rewriting a text,
editing code) and on ones that do not (a story, an explanation, a list).

    .venv/bin/python scripts/bench_speculative.py [--tokens 128] [--rounds 3] [--k 3]
                                                  [--quantization auto] [--num-threads 2]

Both engines are loaded side by side and rounds alternate them. Each run's time per output token is
(last token - first token) / (tokens - 1), from the engine's own timestamps (the prompt's prefill is
not in it). Printed: medians over rounds, the ratio, the share of drafts kept, and whether the tokens
were the same (they must be: greedy verification is exact).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import checkout

checkout.use_checkout()

from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402

TEXT = (
    "The lighthouse stood on a rock at the edge of the bay. Every night its keeper climbed the one "
    "hundred and twelve steps, trimmed the wick, wound the clockwork and watched the beam sweep over "
    "the water until dawn. Ships passed safely, and nobody in the town thought about him at all."
)
CODE = """def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
"""
WORKLOADS = {
    "rewrite": f"Rewrite this text, changing 'keeper' to 'guardian' and nothing else:\n\n{TEXT}",
    "code": f"Add type hints to this Python function. Answer with the whole function only.\n\n{CODE}",
    "story": "Write a story about a robot who learns to paint.",
    "explain": "Explain in a few sentences why the sky is blue and why sunsets are red.",
    "list": "List five everyday uses of a paperclip, one line each.",
}


class _Timestamps:
    def __init__(self) -> None:
        self.finished: list[Any] = []

    def on_step(self, stats: Any) -> None:
        pass

    def on_request_finished(self, stats: Any) -> None:
        self.finished.append(stats)

    def on_request_rejected(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    spec = json.dumps(
        {"num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    )
    engines: dict[str, tuple[Engine, _Timestamps]] = {}
    for name, sc in (("plain", None), ("ngram", spec)):
        obs = _Timestamps()
        cfg = EngineConfig(kv_cache_memory=128 * 2**20, max_model_len=2048, quantization=args.quantization,
                           num_threads=args.num_threads, speculative_config=sc)  # fmt: skip
        engines[name] = (Engine(cfg, observer=obs), obs)
    tok = engines["plain"][0].tokenizer
    params = SamplingParams(max_tokens=args.tokens, temperature=0)  # answers end where the model ends them
    print(f"default model, quantization {args.quantization}, {args.tokens} tokens, greedy, speculative config {spec}")
    print(f"{'workload':<10} {'plain ms/tok':>13} {'ngram ms/tok':>13} {'speed-up':>9} {'kept':>7} same")
    for wname, text in WORKLOADS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        times: dict[str, list[float]] = {"plain": [], "ngram": []}
        outs: dict[str, list[int]] = {}
        kept = verified = 0
        for r in range(args.rounds + 1):  # round 0 warms up (and fills nothing into the results)
            for name, (e, obs) in engines.items():
                before = (e.drafts_verified, e.num_accepted_drafts)
                (res,) = e.generate([ids], params)
                st = obs.finished[-1]
                outs[name] = res.outputs[0].token_ids
                if r == 0:
                    continue
                times[name].append((st.last_token_time - st.first_token_time) / (st.num_generation_tokens - 1) * 1000)
                if name == "ngram":
                    verified += e.drafts_verified - before[0]
                    kept += e.num_accepted_drafts - before[1]
        p, n = statistics.median(times["plain"]), statistics.median(times["ngram"])
        share = f"{kept / verified:.0%}" if verified else "-"
        print(f"{wname:<10} {p:>13.2f} {n:>13.2f} {p / n:>8.2f}x {share:>7} {outs['plain'] == outs['ngram']}")


if __name__ == "__main__":
    main()
