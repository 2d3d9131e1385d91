"""``--quantization int8`` against float32 on the default model (CPU): speed and what it costs in accuracy.

    .venv/bin/python scripts/bench_quantization.py [--rounds 5] [--tokens 128] [--batches 1 4 16]

Speed: one engine of each kind in this process; ``--rounds`` times, each runs ``B`` requests of a
64-token prompt -> ``--tokens`` tokens (ignore_eos) for every ``--batches`` entry, float32 and int8 in
turn (so a noisy neighbour hits both); the median decode step (no prompt tokens in it) is reported.

Accuracy, on 8 chat prompts: the float32 model's greedy 96-token answers are scored teacher-forced by
both models: how often int8's top token is float32's, the mean KL(float32 || int8) of the next-token
distributions, and the perplexity of float32's own answers under each model. Then each model answers
greedily: how many tokens int8's answer shares with float32's before they part.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # device_checks.common.SeqView

from metrics.observer import StepStats  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short motivational quote.",
    "What is 17 times 23? Show your work.",
]


class Steps:
    """An Observer keeping each step's duration and token counts."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_request_finished(self, stats: Any) -> None:
        pass

    def on_request_rejected(self) -> None:
        pass


def chat(engine: Engine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)  # type: ignore[no-any-return]


def decode_ms(engine: Engine, obs: Steps, batch: int, tokens: int) -> float:
    """Median decode-only step of ``batch`` requests of 64 prompt tokens -> ``tokens``."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    obs.steps.clear()
    for i in range(batch):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", [(7 * i + j) % 30000 + 100 for j in range(64)], params)
    while engine.has_unfinished_requests():
        engine.step()
    steps = [s.duration_s for s in obs.steps if s.num_prompt_tokens == 0 and s.num_generation_tokens == batch]
    return statistics.median(steps) * 1e3


def prefill_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of ``token_ids``, in one prefill step on
    the last blocks of the engine's pool (scratch: call when the engine is idle and done with)."""
    from device_checks.common import SeqView
    from runtime.batch import BatchItem

    runner = engine.runner
    need = -(-len(token_ids) // runner.block_size)
    blocks = list(range(runner.kv_pool.num_blocks - need, runner.kv_pool.num_blocks))
    seq = SeqView(10**9, list(token_ids), len(token_ids), 0, blocks, SamplingParams(temperature=0.0))
    with torch.inference_mode():
        inputs = runner.prepare([BatchItem(seq, len(token_ids), True)])  # type: ignore[arg-type]
        hidden = runner.forward(inputs)
        return torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--answer-tokens", type=int, default=96)
    args = ap.parse_args()

    engines: dict[str, tuple[Engine, Steps]] = {}
    for name, q in (("float32", None), ("int8", "int8")):
        obs = Steps()
        t = time.perf_counter()
        engines[name] = (Engine(EngineConfig(quantization=q, max_model_len=1024, kv_cache_memory=512 << 20), obs), obs)
        print(f"{name}: loaded in {time.perf_counter() - t:.1f} s; weights read per decode step "
              f"{engines[name][0].runner.weight_bytes / 1e6:.0f} MB")  # fmt: skip

    # Speed.
    for name, (engine, obs) in engines.items():
        decode_ms(engine, obs, 1, 8)  # warm-up
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batches:
            for name, (engine, obs) in engines.items():
                times.setdefault((name, b), []).append(decode_ms(engine, obs, b, args.tokens))
    print(f"\ndecode step, median of {args.rounds} rounds (each the median step of {args.tokens} tokens):")
    for b in args.batches:
        f, q = statistics.median(times[("float32", b)]), statistics.median(times[("int8", b)])
        print(f"  batch {b:3d}: float32 {f:6.1f} ms ({b / f * 1e3:6.1f} tok/s)  int8 {q:6.1f} ms "
              f"({b / q * 1e3:6.1f} tok/s)  int8 speed-up x{f / q:.2f}")  # fmt: skip

    # Accuracy.
    f32, _ = engines["float32"]
    q8, _ = engines["int8"]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens)
    prompts = [chat(f32, p) for p in PROMPTS]
    answers = {name: [r.outputs[0].token_ids for r in e.generate(prompts, greedy)] for name, (e, _) in engines.items()}
    agree = kl = nll_f = nll_q = 0.0
    n = 0
    for prompt, ans in zip(prompts, answers["float32"]):
        seq = prompt + ans
        lf = prefill_logits(f32, seq)[len(prompt) - 1 : len(seq) - 1]
        lq = prefill_logits(q8, seq)[len(prompt) - 1 : len(seq) - 1]
        target = torch.tensor(ans)
        agree += (lq.argmax(-1) == lf.argmax(-1)).sum().item()
        kl += (lf.exp() * (lf - lq)).sum(-1).sum().item()
        nll_f -= lf.gather(1, target[:, None]).sum().item()
        nll_q -= lq.gather(1, target[:, None]).sum().item()
        n += len(ans)
    shared = []
    for a, b in zip(answers["float32"], answers["int8"]):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        shared.append(k)
    print(f"\naccuracy over {len(PROMPTS)} chat prompts, {n} answer tokens of the float32 model (teacher-forced):")
    print(f"  int8's top token is float32's at {agree / n:.1%} of positions; mean KL(float32 || int8) {kl / n:.4f} nats")
    print(f"  perplexity of those answers: float32 {torch.tensor(nll_f / n).exp():.3f}, int8 {torch.tensor(nll_q / n).exp():.3f}")
    print(f"  greedy answers token-identical for the first {statistics.median(shared):.0f} tokens (median; "
          f"{sum(a == b for a, b in zip(answers['float32'], answers['int8']))}/{len(PROMPTS)} identical throughout): {shared}")
    print("  first answer: float32", repr(f32.tokenizer.decode(answers["float32"][0])), "| int8",
          repr(f32.tokenizer.decode(answers["int8"][0])))  # fmt: skip


if __name__ == "__main__":
    main()
