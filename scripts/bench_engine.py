"""Offline ``Engine`` throughput on the default model (used by ``make bench``).

    .venv/bin/python scripts/bench_engine.py [--workload fixed varied single] [--hf] [--quick]

Workloads (random-token prompts, fixed seed, ignore_eos so every request produces what it asked for):
  fixed   64 requests x 128 prompt tokens x 128 new tokens, max_num_seqs 32
  varied  128 requests, prompt lengths uniform 32-512, output lengths uniform 16-512, max_num_seqs 32,
          under both the fcfs (continuous batching) and the static policy
  single  one request alone (128 prompt tokens, 128 new): ms per output token
``--hf`` runs Hugging Face ``generate`` on the same workloads in static batches of 32 (left-padded, run to
the batch's longest output; only the tokens each request asked for count) and prints the ratio.
``--quick`` shrinks every workload (for a smoke run of the plumbing).
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import checkout

checkout.use_checkout()

from servelm.metrics.observer import RequestStats, StepStats  # noqa: E402
from servelm.runtime.batch import BatchItem  # noqa: E402
from servelm.runtime.model_files import ensure_default_model  # noqa: E402
from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Workload:
    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    max_num_seqs: int = 32

    def prompts(self, seed: int, vocab: int) -> list[list[int]]:
        rng = random.Random(seed)
        # Ordinary vocabulary ids (skip the special tokens at the bottom of SmolLM's vocabulary).
        return [[rng.randrange(100, vocab) for _ in range(n)] for n in self.prompt_lens]


def make_workloads(quick: bool, seed: int) -> dict[str, Workload]:
    rng = random.Random(seed)
    k = 4 if quick else 1  # --quick: a quarter of the requests, an eighth of the lengths
    s = 8 if quick else 1
    n_var = 128 // k
    return {
        "fixed": Workload("fixed 64x128->128", [128 // s] * (64 // k), [128 // s] * (64 // k)),
        "varied": Workload(
            "varied 128 x U(32,512)->U(16,512)",
            [rng.randint(32, 512) // s for _ in range(n_var)],
            [max(1, rng.randint(16, 512) // s) for _ in range(n_var)],
        ),
        "single": Workload("single 1x128->128", [128 // s], [128 // s], max_num_seqs=1),
    }


class StepRecorder:
    """An ``Observer`` keeping every step's and request's stats."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.requests: list[RequestStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.requests.append(stats)

    def on_request_rejected(self) -> None:
        pass


@dataclass
class TimedRunner:
    """Times the model runner's part of each step (``launch``: inputs + forward, ``sample``: LM head +
    sampler; both synchronous on CPU) to split step time into model execution and engine overhead.

    Wraps the runner's methods on the instance (the engine calls them there) until ``restore``.
    """

    inner: Any
    seconds: float = 0.0
    calls: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        launch, sample = self.inner.launch, self.inner.sample

        def timed_launch(items: list[BatchItem]) -> Any:
            t = time.perf_counter()
            try:
                return launch(items)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1
                self.batch_sizes.append(len(items))

        def timed_sample(launched: Any) -> Any:
            t = time.perf_counter()
            try:
                return sample(launched)
            finally:
                self.seconds += time.perf_counter() - t

        self.inner.launch, self.inner.sample = timed_launch, timed_sample

    def restore(self) -> None:
        del self.inner.launch, self.inner.sample  # back to the class's methods


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_engine(engine: Engine, wl: Workload, seed: int) -> dict[str, float]:
    rec = StepRecorder()
    engine.observer = rec
    timed = TimedRunner(engine.runner)
    engine.scheduler.max_num_seqs = wl.max_num_seqs
    prompts = wl.prompts(seed, engine.model_config.vocab_size)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in wl.output_lens]
    preempt0 = engine.scheduler.num_preemptions_total
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    total = time.perf_counter() - t0
    timed.restore()
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert out_tokens == sum(wl.output_lens), "every request must produce what it asked for"
    assert engine.block_manager.num_used_blocks == 0
    steps = rec.steps
    prefill_steps = [s for s in steps if s.num_prompt_tokens > 0]
    decode_steps = [s for s in steps if s.num_prompt_tokens == 0]
    ttft = [r.first_token_time - r.arrival_time for r in rec.requests if r.first_token_time is not None]
    itl = [x for s in steps for x in s.inter_token_latencies]
    step_time = sum(s.duration_s for s in steps)
    return {
        "total_s": total,
        "output_tok_s": out_tokens / total,
        "total_tok_s": (out_tokens + sum(wl.prompt_lens)) / total,
        "steps": len(steps),
        "prefill_steps_s": sum(s.duration_s for s in prefill_steps),
        "prompt_tok_s_in_prefill_steps": sum(s.num_prompt_tokens for s in prefill_steps)
        / max(1e-9, sum(s.duration_s for s in prefill_steps)),
        "decode_steps_s": sum(s.duration_s for s in decode_steps),
        "decode_step_ms_median": 1e3 * statistics.median([s.duration_s for s in decode_steps]) if decode_steps else 0.0,
        "mean_batch": statistics.mean(timed.batch_sizes) if timed.batch_sizes else 0.0,
        "model_s": timed.seconds,
        "engine_overhead_ms_per_step": 1e3 * (step_time - timed.seconds) / max(1, len(steps)),
        "overhead_pct": 100.0 * (step_time - timed.seconds) / max(1e-9, step_time),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * pct(itl, 0.5),
        "itl_p99_ms": 1e3 * pct(itl, 0.99),
        "ms_per_output_token": 1e3 * total / max(1, out_tokens) if wl.max_num_seqs == 1 else float("nan"),
        "preemptions": engine.scheduler.num_preemptions_total - preempt0,
        "out_tokens": out_tokens,
    }


def run_hf(model_dir: Path, wl: Workload, seed: int, vocab: int, batch: int = 32) -> dict[str, float]:
    """HF ``generate`` in static batches: left-padded, every row runs to the batch's longest output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts = wl.prompts(seed, vocab)
    batch = min(batch, wl.max_num_seqs) if wl.max_num_seqs > 1 else 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ps = prompts[i : i + batch]
            width = max(len(p) for p in ps)
            ids = torch.full((len(ps), width), 2, dtype=torch.long)
            mask = torch.zeros((len(ps), width), dtype=torch.long)
            for j, p in enumerate(ps):
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            new = max(wl.output_lens[i : i + batch])
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
    total = time.perf_counter() - t0
    useful = sum(wl.output_lens)
    del model
    gc.collect()
    return {
        "total_s": total,
        "output_tok_s": useful / total,
        "ms_per_output_token": 1e3 * total / useful if wl.max_num_seqs == 1 else float("nan"),
    }


def show(label: str, r: dict[str, float]) -> None:
    keys = [
        ("total_s", "{:.1f} s"),
        ("output_tok_s", "{:.1f} out tok/s"),
        ("total_tok_s", "{:.1f} tok/s incl. prompt"),
        ("ms_per_output_token", "{:.1f} ms/token"),
        ("steps", "{:.0f} steps"),
        ("mean_batch", "mean batch {:.1f}"),
        ("prefill_steps_s", "steps with prompt tokens {:.1f} s"),
        ("prompt_tok_s_in_prefill_steps", "({:.0f} prompt tok/s)"),
        ("decode_steps_s", "decode-only steps {:.1f} s"),
        ("decode_step_ms_median", "(median {:.1f} ms)"),
        ("engine_overhead_ms_per_step", "engine overhead {:.2f} ms/step"),
        ("overhead_pct", "({:.1f}% of step time)"),
        ("ttft_p50_s", "TTFT p50 {:.2f} s"),
        ("ttft_p99_s", "p99 {:.2f} s"),
        ("itl_p50_ms", "ITL p50 {:.1f} ms"),
        ("itl_p99_ms", "p99 {:.1f} ms"),
        ("preemptions", "{:.0f} preemptions"),
    ]
    parts = [fmt.format(r[k]) for k, fmt in keys if k in r and r[k] == r[k]]  # skip NaN
    print(f"  {label:<14} " + "; ".join(parts), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ["fixed", "varied", "single"]
    ap.add_argument("--workload", nargs="+", choices=names, default=names)
    ap.add_argument("--hf", action="store_true", help="also run the HF transformers generate baseline")
    ap.add_argument("--quick", action="store_true", help="tiny workloads: check the plumbing only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    model_dir = Path(args.model) if args.model else ensure_default_model()
    engine = Engine(EngineConfig(model=str(model_dir), num_threads=args.num_threads, max_num_seqs=32))
    print(
        f"engine: {engine.served_model_name}, {engine.config.device}/{engine.config.dtype}, "
        f"{torch.get_num_threads()} threads, max_num_batched_tokens {engine.config.max_num_batched_tokens}"
    )
    print(f"        {engine.capacity.describe()}")
    workloads = make_workloads(args.quick, args.seed)
    vocab = engine.model_config.vocab_size
    ours: dict[str, dict[str, float]] = {}
    for name in args.workload:
        wl = workloads[name]
        print(f"\n{wl.name}", flush=True)
        policies = ["fcfs", "static"] if name == "varied" else ["fcfs"]
        for policy in policies:
            engine.scheduler.policy = policy
            r = run_engine(engine, wl, args.seed)
            ours[f"{name}/{policy}"] = r
            show(f"servelm {policy}", r)
        engine.scheduler.policy = "fcfs"
        if name == "varied" and "varied/static" in ours:
            print(
                f"  continuous / static batching: "
                f"{ours['varied/fcfs']['output_tok_s'] / ours['varied/static']['output_tok_s']:.2f}x"
            )
        if args.hf:
            h = run_hf(model_dir, wl, args.seed, vocab)
            show("HF generate", h)
            r = ours[f"{name}/fcfs"]
            if name == "single":
                print(f"  HF / servelm ms per token: {h['ms_per_output_token'] / r['ms_per_output_token']:.2f}x")
            else:
                print(f"  servelm / HF output tok/s: {r['output_tok_s'] / h['output_tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
