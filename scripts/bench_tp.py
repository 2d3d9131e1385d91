"""Decode step time at TP=1 against TP=N (CPU, gloo), and the time rank 0 spends inside the collectives.

    .venv/bin/python scripts/bench_tp.py [--model DIR] [--tp N] [--batches 1 8] [--context 64] [--steps 24] [--threads 1]

The default model (SmolLM2-135M: 9 heads over 3 KV heads) splits over 3 ranks, not 2; ``--tp``
defaults to the smallest size that divides its shapes. Each rank runs ``--threads`` torch threads;
TP=1 is timed with ``--threads`` and with N x ``--threads`` (the same cores as the N ranks take).
A decode step is ``ModelRunner.execute`` over B sequences of ``--context`` prompt tokens (prefilled
untimed): forward, LM head and greedy sampling. "in collectives" is rank 0's wall time inside
all-reduce, gather and broadcast calls during the step, waiting for the other ranks included; on a
machine with fewer free cores than ranks that wait is most of it. Medians over ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import Blocks, make_seqs, run_chunked  # puts the checkout on sys.path

from servelm.runtime.batch import BatchItem
from servelm.runtime.config import ModelConfig
from servelm.runtime.distributed.comm import Communicator
from servelm.runtime.distributed.launcher import TensorParallelGroup
from servelm.runtime.model_files import ensure_default_model
from servelm.runtime.runner import ModelRunner

NUM_BLOCKS = 1024


class CollectiveClock:
    """Rank 0's seconds inside the collectives since ``reset`` (its communicator's methods wrapped)."""

    def __init__(self, comm: Communicator) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in ("all_reduce", "gather_last_dim", "broadcast"):
            setattr(comm, name, self._timed(getattr(comm, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def decode_steps(
    runner: ModelRunner, batch: int, context: int, steps: int, clock: CollectiveClock | None
) -> dict[str, float]:
    """Median decode step (ms), and with ``clock`` the median ms and count of collectives a step."""
    blocks = Blocks(NUM_BLOCKS, runner.block_size)
    seqs = make_seqs(batch, context, first_id=1000 * batch)
    for s in seqs:  # the default model's vocabulary; a smaller one wraps
        s.token_ids[:] = [t % runner.model_config.vocab_size for t in s.token_ids]
    run_chunked(runner, blocks, seqs, runner.max_num_batched_tokens)
    step_ms, coll_ms, calls = [], [], []
    for _ in range(steps):
        items = []
        for s in seqs:
            blocks.grow(s, len(s.token_ids))
            items.append(BatchItem(s, 1, sample=True))
        if clock is not None:
            clock.reset()
        start = time.perf_counter()
        out = runner.execute(items)
        step_ms.append((time.perf_counter() - start) * 1e3)
        if clock is not None:
            coll_ms.append(clock.seconds * 1e3)
            calls.append(clock.calls)
        for s, tok in zip(seqs, out.sampled_token_ids):
            s.num_computed_tokens += 1
            s.token_ids.append(tok)
    result = {"step_ms": statistics.median(step_ms)}
    if clock is not None:
        result |= {"collectives_ms": statistics.median(coll_ms), "collectives": statistics.median(calls)}
    return result


def smallest_tp(cfg: ModelConfig) -> int:
    shapes = (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)
    return next(n for n in range(2, cfg.num_kv_heads + 1) if all(s % n == 0 for s in shapes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a safetensors folder (default: the default model)")
    ap.add_argument("--tp", type=int, default=None, help="ranks (default: the smallest size that divides the model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()

    model_dir = args.model or ensure_default_model()
    cfg = ModelConfig.from_dir(model_dir)
    tp = args.tp or smallest_tp(cfg)
    kwargs: dict[str, Any] = dict(device=torch.device("cpu"), dtype=torch.float32, block_size=16, num_blocks=NUM_BLOCKS,
                                  max_num_batched_tokens=512, max_num_seqs=64)  # fmt: skip
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for threads in (args.threads, tp * args.threads):
        torch.set_num_threads(threads)
        runner = ModelRunner(model_dir, cfg, **kwargs)
        rows[f"TP=1, {threads} thread(s)"] = {
            b: decode_steps(runner, b, args.context, args.steps, None) for b in args.batches
        }
        del runner
    torch.set_num_threads(args.threads)
    with TensorParallelGroup(tp, num_threads=args.threads) as group:
        runner = group.load(model_dir, **kwargs)
        clock = CollectiveClock(group.comm)
        rows[f"TP={tp}, {args.threads} thread(s) per rank"] = {
            b: decode_steps(runner, b, args.context, args.steps, clock) for b in args.batches
        }
        runner.release()

    print(
        f"{model_dir.name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}; decode, context {args.context}, "
        f"median of {args.steps} steps"
    )
    for name, by_batch in rows.items():
        for b, r in by_batch.items():
            extra = (
                f"; in {r['collectives']:.0f} collectives {r['collectives_ms']:.2f} ms" if "collectives" in r else ""
            )
            print(f"  {name:32s} batch {b:2d}: {r['step_ms']:7.2f} ms/step{extra}")


if __name__ == "__main__":
    main()
