"""``--quantization int8`` / ``int4`` against float32 on the default model (CPU): speed and what each
costs in accuracy.

    .venv/bin/python scripts/bench_quantization.py [--schemes int8 int4] [--rounds 5] [--tokens 128] [--batches 1 4 16]

Speed: one engine of each kind in this process; ``--rounds`` times, each runs ``B`` requests of a
64-token prompt -> ``--tokens`` tokens (ignore_eos) for every ``--batches`` entry, float32 and each
scheme in turn (so a noisy neighbour hits all); the median decode step (no prompt tokens in it) is reported.

Accuracy, on 8 chat prompts: the float32 model's greedy 96-token answers are scored teacher-forced by
every model: how often a scheme's top token is float32's, the mean KL(float32 || scheme) of the
next-token distributions, and the perplexity of float32's own answers under each model. Then each model
answers greedily: how many tokens a scheme's answer shares with float32's before they part.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import checkout

checkout.use_checkout()
sys.path.insert(0, str(Path(__file__).resolve().parent))  # device_checks.common.SeqView

from servelm.metrics.observer import StepStats  # noqa: E402
from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402

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
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


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

    from servelm.runtime.batch import BatchItem

    runner = engine.runner
    need = -(-len(token_ids) // runner.block_size)
    blocks = list(range(runner.kv_pool.num_blocks - need, runner.kv_pool.num_blocks))
    seq = SeqView(10**9, list(token_ids), len(token_ids), 0, blocks, SamplingParams(temperature=0.0))
    with torch.inference_mode():
        inputs = runner.prepare([BatchItem(seq, len(token_ids), True)])
        hidden = runner.forward(inputs)
        return torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--schemes", nargs="+", choices=["int8", "int4"], default=["int8", "int4"])
    args = ap.parse_args()

    engines: dict[str, tuple[Engine, Steps]] = {}
    for name, q in [("float32", None)] + [(s, s) for s in args.schemes]:
        obs = Steps()
        t = time.perf_counter()
        engines[name] = (Engine(EngineConfig(quantization=q, max_model_len=1024, kv_cache_memory=512 << 20), obs), obs)
        print(
            f"{name}: loaded in {time.perf_counter() - t:.1f} s; weights read per decode step "
            f"{engines[name][0].runner.weight_bytes / 1e6:.0f} MB"
        )

    # Speed.
    for engine, obs in engines.values():
        decode_ms(engine, obs, 1, 8)  # warm-up
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batches:
            for name, (engine, obs) in engines.items():
                times.setdefault((name, b), []).append(decode_ms(engine, obs, b, args.tokens))
    print(f"\ndecode step, median of {args.rounds} rounds (each the median step of {args.tokens} tokens):")
    for b in args.batches:
        f = statistics.median(times[("float32", b)])
        line = f"  batch {b:3d}: float32 {f:6.1f} ms ({b / f * 1e3:6.1f} tok/s)"
        for name in args.schemes:
            q = statistics.median(times[(name, b)])
            line += f"  {name} {q:6.1f} ms ({b / q * 1e3:6.1f} tok/s, x{f / q:.2f})"
        print(line)

    # Accuracy.
    f32, _ = engines["float32"]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens)
    prompts = [chat(f32, p) for p in PROMPTS]
    answers = {name: [r.outputs[0].token_ids for r in e.generate(prompts, greedy)] for name, (e, _) in engines.items()}
    reference = [
        (prefill_logits(f32, prompt + ans)[len(prompt) - 1 : len(prompt) + len(ans) - 1], torch.tensor(ans))
        for prompt, ans in zip(prompts, answers["float32"])
    ]
    n = sum(len(ans) for ans in answers["float32"])
    nll_f = -sum(lf.gather(1, target[:, None]).sum().item() for lf, target in reference)
    print(
        f"\naccuracy over {len(PROMPTS)} chat prompts, {n} answer tokens of the float32 model (teacher-forced); "
        f"float32's perplexity of them {torch.tensor(nll_f / n).exp():.3f}:"
    )
    for name in args.schemes:
        engine, _ = engines[name]
        agree = kl = nll_q = 0.0
        for prompt, ans, (lf, target) in zip(prompts, answers["float32"], reference):
            lq = prefill_logits(engine, prompt + ans)[len(prompt) - 1 : len(prompt) + len(ans) - 1]
            agree += (lq.argmax(-1) == lf.argmax(-1)).sum().item()
            kl += (lf.exp() * (lf - lq)).sum(-1).sum().item()
            nll_q -= lq.gather(1, target[:, None]).sum().item()
        shared = []
        for a, b in zip(answers["float32"], answers[name]):
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            shared.append(k)
        identical = sum(a == b for a, b in zip(answers["float32"], answers[name]))
        print(
            f"  {name}: top token is float32's at {agree / n:.1%} of positions; mean KL(float32 || {name}) "
            f"{kl / n:.2e} nats; perplexity {torch.tensor(nll_q / n).exp():.3f}; greedy answers token-identical "
            f"for the first {statistics.median(shared):.0f} tokens (median; {identical}/{len(PROMPTS)} identical "
            f"throughout): {shared}"
        )
        print(f"    first answer: {engine.tokenizer.decode(answers[name][0])!r}")
    print(f"  float32's first answer: {f32.tokenizer.decode(answers['float32'][0])!r}")


if __name__ == "__main__":
    main()
