"""Per-step host (Python) overhead of ``Engine.step`` in decode, with a tiny random Llama on CPU.

    .venv/bin/python scripts/bench_host_overhead.py [--batches 1 256] [--prompt-len 16] [--max-tokens 64]
                                                     [--observer prometheus|null] [--profile] [--device cpu]

The model is tiny (3 layers, hidden 64) so its forward is cheap, but its time is measured and taken
out anyway: what remains is the Python that runs around the model every step, which on a GPU is
paid on top of the device time. ``B`` requests (``--prompt-len`` random tokens, ``--max-tokens``
new tokens, greedy, ignore_eos) run to completion; only decode-only steps are kept, and the median
of each part over them is reported:

  schedule   ``Scheduler.schedule`` (block allocation included)
  prepare    ``ModelRunner.prepare``: the step's tensors and attention metadata
  forward    the model over the step's tokens (device work on a GPU)
  sample     ``ModelRunner.sample``: LM head over the sampled rows and the sampler (mostly device work
             on a GPU; on this CPU, large for the 49k vocabulary)
  wait       ``StepOutput.result``: the sampled tokens reaching the host (on a GPU, the wait for the device)
  rest       everything else in ``Engine.step``: request updates, detokenization, stop checks,
             outputs, metrics observation
  host       schedule + prepare + rest: the engine's own per-step Python, which a GPU waits on unless
             the engine schedules ahead (``--async-scheduling``; then the step read is the previous one)

``--observer prometheus`` (default) feeds the server's Prometheus observer, as ``servelm serve`` does.
``--device cuda`` runs the same on a GPU (bfloat16, CUDA graphs): there ``sample`` also holds the wait
for the device, and the host parts are what the GPU idles on. ``--tokenizer DIR`` takes the tokenizer
files from DIR instead of the default model's folder (for a machine without it).
``--profile`` prints a cProfile of the decode steps of the largest batch (``--sort`` picks the order).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import checkout

checkout.use_checkout()

from servelm.metrics.observer import NullObserver, Observer  # noqa: E402
from servelm.runtime.model_files import ensure_default_model  # noqa: E402
from servelm.runtime.step import StepOutput  # noqa: E402
from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PARTS = ("schedule", "prepare", "forward", "sample", "wait", "rest", "host", "step")


def build_tiny_llama(out: Path, tokenizer_dir: Path | None = None) -> Path:
    """A random 3-layer Llama (hidden 64) with the default model's tokenizer and vocabulary."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(str(out))
    src = tokenizer_dir or ensure_default_model()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


class StepTimer:
    """Wraps the engine's parts (instance attributes only) and accumulates their time in the current step."""

    def __init__(self, engine: Engine) -> None:
        self.cur: dict[str, float] = defaultdict(float)
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(runner, "launch", "launch")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(runner, "forward", "forward")
        self._wrap(runner, "sample", "sample")
        self._wrap(StepOutput, "result", "wait")  # (on the class: every step's output)

    def _wrap(self, obj: Any, attr: str, part: str) -> None:
        fn: Callable[..., Any] = getattr(obj, attr)
        cur = self.cur

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[part] += time.perf_counter() - t

        setattr(obj, attr, timed)


def run_batch(
    engine: Engine,
    timer: StepTimer,
    batch: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    profiler: cProfile.Profile | None,
) -> dict[str, list[float]]:
    """Run ``batch`` requests to completion; the parts (ms) of every decode-only step."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{seed}-{i}", [rng.randrange(100, vocab) for _ in range(prompt_len)], params)
    parts: dict[str, list[float]] = defaultdict(list)
    while engine.has_unfinished_requests():
        decode_only = all(r.num_output_tokens > 0 for r in engine.scheduler.running) and not engine.num_waiting
        timer.cur.clear()
        if profiler is not None and decode_only:
            profiler.enable()
        t = time.perf_counter()
        engine.step()
        step = time.perf_counter() - t
        if profiler is not None and decode_only:
            profiler.disable()
        if not decode_only:
            continue
        cur = timer.cur
        rest = step - cur["schedule"] - cur["launch"] - cur["sample"] - cur["wait"]
        host = cur["schedule"] + cur["prepare"] + rest
        values = {**cur, "rest": rest, "host": host, "step": step}
        for k in PARTS:
            parts[k].append(values.get(k, 0.0) * 1e3)
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="request waves per batch size (the first is a warm-up)")
    ap.add_argument("--observer", choices=("prometheus", "null"), default="prometheus")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--async-scheduling", action="store_true", help="the engine schedules one step ahead")
    ap.add_argument(
        "--tokenizer", type=Path, default=None, help="folder with tokenizer.json (default: the default model's)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the decode steps of the largest batch")
    ap.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative, ...)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "tiny-llama", args.tokenizer)
        max_seqs = max(args.batches)
        config = EngineConfig(
            model=str(model_dir),
            device=args.device,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(512, max_seqs * args.prompt_len),
            kv_cache_memory=64 * 2**20,
            max_model_len=args.prompt_len + args.max_tokens + 16,
            async_scheduling=args.async_scheduling,
        )
        observer: Observer = NullObserver()
        if args.observer == "prometheus":
            from servelm.metrics.prometheus import PrometheusObserver

            observer = PrometheusObserver("tiny", {}, 1e12, 1e11, process_metrics=False)
        engine = Engine(config, observer)
        timer = StepTimer(engine)

        print(
            f"tiny Llama on {engine.device} ({engine.dtype}), prompt {args.prompt_len}, "
            f"max_tokens {args.max_tokens}, observer {args.observer}"
            + (", async scheduling" if args.async_scheduling else "")
        )
        print("median ms per decode step: " + "  ".join(f"{p:>8}" for p in PARTS))
        for batch in args.batches:
            profiler = cProfile.Profile() if args.profile and batch == max_seqs else None
            merged: dict[str, list[float]] = defaultdict(list)
            for r in range(args.rounds):
                parts = run_batch(engine, timer, batch, args.prompt_len, args.max_tokens, r, profiler if r else None)
                if r or args.rounds == 1:
                    for k, v in parts.items():
                        merged[k].extend(v)
            med = {k: statistics.median(merged[k]) for k in PARTS}
            print(f"batch {batch:4d} ({len(merged['step'])} steps):   " + "  ".join(f"{med[p]:8.3f}" for p in PARTS))
            if profiler is not None:
                pstats.Stats(profiler).sort_stats(args.sort).print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
