"""What structured outputs cost a decode step: the default model, B requests decoding together, free
text against the same requests constrained by a JSON schema (a string field of at least 2,000
characters), a plain regex, and the same regex with a counted repetition ({2000,}).

    .venv/bin/python scripts/bench_structured_output.py [--batches 1 8 32] [--tokens 64] [--rounds 3]
                                                        [--quantization auto] [--num-threads 2]

The prompt asks for a long story, so the constrained outputs run to ``--tokens`` like the free ones
(ignore_eos; the schema cannot end sooner) and every run decodes at a fixed batch. Rounds alternate free
and constrained runs; the medians over rounds of each run's median decode-step time (steps where all B
requests decode) are printed, with the time the grammar's mask took per row
(``GrammarMatcher.fill_bitmask``, timed inside the runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import checkout

checkout.use_checkout()

from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402
from servelm.scheduler.structured_output import GrammarMatcher, StructuredOutput  # noqa: E402

SPECS = {
    "json": StructuredOutput(
        "json",
        json.dumps(
            {
                "type": "object",
                "properties": {"title": {"type": "string"}, "story": {"type": "string", "minLength": 2000}},
                "required": ["title", "story"],
            }
        ),
    ),
    "regex": StructuredOutput("regex", r"[A-Za-z ,.'\n]+"),
    # A counted repetition makes the lexer's states counters: ~0.3 ms a mask here instead of ~10 us.
    "regex2000": StructuredOutput("regex", r"[A-Za-z ,.'\n]{2000,}"),
}
PROMPT = "Write a long story about a lighthouse keeper, as JSON with a title and the story."

mask_times: list[float] = []
_fill = GrammarMatcher.fill_bitmask


def _timed_fill(self: GrammarMatcher, bitmask, row) -> None:
    t0 = time.perf_counter()
    _fill(self, bitmask, row)
    mask_times.append(time.perf_counter() - t0)


GrammarMatcher.fill_bitmask = _timed_fill


def run(engine: Engine, prompt: list[int], batch: int, tokens: int, spec: StructuredOutput | None) -> float:
    """Median wall time of the steps in which every request decodes."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, structured_output=spec)
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        decoding = engine.scheduler.num_running == batch and all(r.is_decoding for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--specs", nargs="+", default=list(SPECS), choices=list(SPECS))
    args = ap.parse_args()

    engine = Engine(
        EngineConfig(
            quantization=args.quantization,
            num_threads=args.num_threads,
            kv_cache_memory=512 * 2**20,
            max_model_len=1024,
            max_num_seqs=max(args.batches),
            enable_prefix_caching=False,
        )
    )
    tok = engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    compiled = {name: SPECS[name] for name in args.specs}
    for spec in compiled.values():
        engine.grammar_compiler.compile(spec)
    run(engine, prompt, 1, 8, None)  # warm-up
    print(f"decode step, {args.tokens} tokens, prompt {len(prompt)} tokens, medians of {args.rounds} rounds")
    print(
        f"{'batch':>5} {'free ms':>9} " + " ".join(f"{n + ' ms':>9} {'ratio':>6} {'mask us/row':>11}" for n in compiled)
    )
    for batch in args.batches:
        free: list[float] = []
        constrained: dict[str, list[float]] = {n: [] for n in compiled}
        masks: dict[str, list[float]] = {n: [] for n in compiled}
        for _ in range(args.rounds):
            free.append(run(engine, prompt, batch, args.tokens, None))
            for name, spec in compiled.items():
                mask_times.clear()
                constrained[name].append(run(engine, prompt, batch, args.tokens, spec))
                masks[name].append(statistics.median(mask_times))
        f = statistics.median(free)
        cols = []
        for name in compiled:
            c = statistics.median(constrained[name])
            cols.append(f"{c * 1e3:9.2f} {c / f:6.3f} {statistics.median(masks[name]) * 1e6:11.1f}")
        print(f"{batch:5d} {f * 1e3:9.2f} " + " ".join(cols))
    assert engine.block_manager.num_used_blocks == 0


if __name__ == "__main__":
    main()
