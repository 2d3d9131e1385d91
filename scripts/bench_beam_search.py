"""What beam search costs against independent samples on the default model: one request with
``use_beam_search`` at width 4 against one request with ``n=4`` samples of the same prompt (temperature 1),
each alone on the engine, both running ``--tokens`` steps (no EOS stop), on a long chat prompt.

    .venv/bin/python scripts/bench_beam_search.py [--tokens 128] [--rounds 3] [--width 4] [--num-threads 2]

Printed per mode: the medians over rounds of the wall time, the tokens computed per second (width x steps:
every beam or sample computes one token a step) and the peak KV blocks in use (the prompt's blocks and a
beam's common prefix are shared by reference; samples share only the prompt's full blocks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout

checkout.use_checkout()

from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402

SYSTEM = (
    "You are a meticulous technical assistant working for a small engineering team. Always answer in plain "
    "English, keep answers short, and prefer concrete examples over theory. When a question is about code, show a "
    "minimal snippet and explain it in one or two sentences. Never invent references. If you are unsure, say so "
    "and suggest how to check. The team works mostly with Python, Linux servers, and small language models."
)
QUESTION = "How do I read a file line by line in Python, and what happens to the newline characters?"


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    """Wall seconds of one request alone, and the peak KV blocks in use while it ran."""
    bm = engine.block_manager
    engine.add_request("bench", prompt, params)
    group = engine.choice_group("bench")
    peak = 0
    start = time.perf_counter()
    while not group.finished:
        engine.step()
        peak = max(peak, bm.num_used_blocks)
    elapsed = time.perf_counter() - start
    engine.forget("bench")
    assert bm.num_used_blocks == 0 and not engine.has_unfinished_requests()
    return elapsed, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    engine = Engine(EngineConfig(kv_cache_memory=256 * 2**20, max_model_len=2048, num_threads=args.num_threads))
    tok = engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    w, n = args.width, args.tokens
    modes = {
        f"beam search, width {w}": SamplingParams(
            n=w, use_beam_search=True, temperature=0.0, max_tokens=n, ignore_eos=True
        ),
        f"n={w} samples (temperature 1)": SamplingParams(n=w, temperature=1.0, seed=0, max_tokens=n, ignore_eos=True),
    }
    print(
        f"{engine.served_model_name}, prompt {len(prompt)} tokens, {n} steps, block size {engine.block_manager.block_size}"
    )
    for label, params in modes.items():
        run(engine, prompt, params)  # warm-up
        runs = [run(engine, prompt, params) for _ in range(args.rounds)]
        secs = statistics.median(r[0] for r in runs)
        print(f"{label:32s} {secs:6.2f} s  {w * n / secs:7.1f} tok/s  peak KV blocks {max(r[1] for r in runs)}")


if __name__ == "__main__":
    main()
