"""Step times of ``ModelRunner.execute`` on the default model (CPU, float32): decode and chunked prefill.

    .venv/bin/python scripts/bench_runner.py [--batches 1 8 32] [--context 192] [--steps 12] [--no-kernel] [--quantization int8]

Decode: ``B`` sequences with ``--context`` prompt tokens each are prefilled (not timed), then each step
decodes one token for all of them (greedy, through the sampler); the median step time is reported.
Prefill: 32 prompts of 128 tokens fed in 512-token steps as the scheduler would chunk them.
Compare with a plain-torch contiguous forward on the same host (here: batch 1 -> 25-27 ms, 32 -> 97-102 ms;
prefill ~1,000 tok/s). Numbers are noisy on a shared machine: look at the median and the spread.
"""

from __future__ import annotations

import argparse
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

from servelm.runtime.batch import BatchItem, SamplingOptions  # noqa: E402
from servelm.runtime.config import ModelConfig  # noqa: E402
from servelm.runtime.cpu.torch_backend import TorchAttentionBackend  # noqa: E402
from servelm.runtime.model_files import ensure_default_model  # noqa: E402
from servelm.runtime.quantization import QUANTIZATIONS  # noqa: E402
from servelm.runtime.runner import ModelRunner  # noqa: E402

# Wall time by default; ``--cpu-time`` switches to process CPU time, which (with --threads 1) stays
# meaningful on a machine shared with other jobs, where wall times mostly measure the neighbours.
clock = time.perf_counter


@dataclass
class Greedy(SamplingOptions):
    temperature: float = 0.0


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    params: Greedy = field(default_factory=Greedy)
    generator: torch.Generator | None = None
    stop_token_ids_for_min_tokens: tuple[int, ...] = ()
    grammar: Any = None  # runtime.batch.TokenMask


class Blocks:
    """Scattered block allocation, as a long-running server's free list looks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)

    def grow(self, s: Seq, n: int) -> None:
        while len(s.block_table) * self.bs < n:
            s.block_table.append(self.free.pop())

    def release(self, s: Seq) -> None:
        self.free.extend(s.block_table)
        s.block_table = []


def make_seqs(n: int, length: int, first_id: int) -> list[Seq]:
    g = torch.Generator().manual_seed(first_id)
    return [
        Seq(first_id + i, ids := torch.randint(3, 49152, (length,), generator=g).tolist(), len(ids)) for i in range(n)
    ]


def run_chunked(runner: ModelRunner, blocks: Blocks, seqs: list[Seq], budget: int) -> list[float]:
    """Feed the prompts of ``seqs`` in steps of at most ``budget`` tokens; returns each step's seconds."""
    times = []
    pending = list(seqs)
    while pending:
        items, left = [], budget
        for s in pending:
            remaining = len(s.token_ids) - s.num_computed_tokens
            n = min(remaining, left)
            if n == 0:
                break
            blocks.grow(s, s.num_computed_tokens + n)
            items.append(BatchItem(s, n, sample=n == remaining))
            left -= n
        t = clock()
        out = runner.execute(items)
        times.append(clock() - t)
        for it, tok in zip(items, out.sampled_token_ids):
            it.seq.num_computed_tokens += it.num_new_tokens
            if tok is not None:
                it.seq.token_ids.append(tok)
        pending = [s for s in pending if s.num_computed_tokens < s.num_prompt_tokens]
    return times


class HFDecoder:
    """Hugging Face transformers with its own KV cache: the same-moment baseline for decode steps."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.inference_mode()
    def start(self, seqs: list[Seq]) -> None:
        ids = torch.tensor([s.token_ids[: s.num_prompt_tokens] for s in seqs])
        out = self.model(input_ids=ids, use_cache=True)
        self.cache = out.past_key_values
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step(self) -> None:
        out = self.model(input_ids=self.next, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)


class ContiguousBaseline:
    """The plain-torch reference, on our own model object: per-sequence contiguous KV
    ([B, KVH, L, D] per layer, all sequences the same length) and SDPA with GQA, no paging.

    It stands in for the attention backend (layers call it in order every step), so the difference
    to the runner is exactly the paged attention plus the runner's per-step work.
    """

    name = "contiguous-sdpa"

    def __init__(self, runner: ModelRunner, batch: int, max_len: int) -> None:
        cfg = runner.model_config
        self.runner = runner
        self.layers = cfg.num_layers
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape) for _ in range(self.layers)]
        self.v = [torch.zeros(shape) for _ in range(self.layers)]
        self.calls = 0
        self.length = 0

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # AttentionBackend.forward
        layer = self.calls % self.layers
        self.calls += 1
        b = self.k[layer].shape[0]
        t = q.shape[0] // b  # tokens per sequence this step
        start = self.length
        self.k[layer][:, :, start : start + t] = k.view(b, t, *k.shape[1:]).transpose(1, 2)
        self.v[layer][:, :, start : start + t] = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        kk = self.k[layer][:, :, : start + t]
        vv = self.v[layer][:, :, : start + t]
        qq = q.view(b, t, *q.shape[1:]).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, is_causal=t > 1 and start == 0, scale=scale, enable_gqa=True
        )
        if layer == self.layers - 1:
            self.length += t
        return out.transpose(1, 2).reshape(q.shape)

    @torch.inference_mode()
    def run(self, seqs: list[Seq], steps: int) -> list[float]:
        """Prefill all prompts in one forward, then ``steps`` decode steps; returns the decode step times."""
        model = self.runner.model
        saved = [layer.self_attn.backend for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.backend = self
        try:
            b, n = len(seqs), seqs[0].num_prompt_tokens
            ids = torch.tensor([s.token_ids[:n] for s in seqs]).reshape(-1)
            pos = torch.arange(n).repeat(b)
            h = model(ids, pos, None)
            nxt = model.compute_logits(h.view(b, n, -1)[:, -1]).argmax(-1)
            times = []
            for _ in range(steps):
                t = clock()
                h = model(nxt, torch.full((b,), self.length), None)
                nxt = model.compute_logits(h).argmax(-1)
                times.append(clock() - t)
            return times
        finally:
            for layer, be in zip(model.model.layers, saved):
                layer.self_attn.backend = be


def bench_decode(
    runner: ModelRunner, blocks: Blocks, batch: int, context: int, steps: int, hf: HFDecoder | None = None
) -> tuple[list[float], list[float]]:
    """Median-able step times of the runner (and of HF, interleaved step by step, when given)."""
    seqs = make_seqs(batch, context, first_id=1000 * batch)
    run_chunked(runner, blocks, seqs, runner.max_num_batched_tokens)
    if hf is not None:
        hf.start(seqs)
    times, hf_times = [], []
    for _ in range(steps):
        items = []
        for s in seqs:
            blocks.grow(s, len(s.token_ids))
            items.append(BatchItem(s, 1, sample=True))
        t = clock()
        out = runner.execute(items)
        times.append(clock() - t)
        for s, tok in zip(seqs, out.sampled_token_ids):
            s.num_computed_tokens += 1
            s.token_ids.append(tok)
        if hf is not None:
            t = clock()
            hf.step()
            hf_times.append(clock() - t)
    for s in seqs:
        blocks.release(s)
    return times, hf_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prefill-prompts", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--no-kernel", action="store_true", help="torch decode attention instead of the C++ kernel")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compare-hf", action="store_true", help="interleave HF transformers decode steps as a baseline")
    ap.add_argument("--compare-contiguous", action="store_true", help="also time a contiguous-KV plain-torch decode")
    ap.add_argument("--profile", type=int, default=0, metavar="B", help="print a torch.profiler table for batch B")
    ap.add_argument("--cpu-time", action="store_true", help="time with process CPU time (use with --threads 1)")
    ap.add_argument(
        "--quantization", choices=QUANTIZATIONS, default=None, help="weight-only int8 (runtime.quantization)"
    )
    args = ap.parse_args()
    global clock
    if args.cpu_time:
        clock = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = ensure_default_model()
    cfg = ModelConfig.from_dir(model_dir)
    block_size = 16
    backend = TorchAttentionBackend(block_size, use_kernel=not args.no_kernel)
    t = clock()
    runner = ModelRunner(
        model_dir,
        cfg,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=block_size,
        num_blocks=1024,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=max(max(args.batches), args.prefill_prompts),
        backend=backend,
        quantization=args.quantization,
    )
    print(f"load {clock() - t:.2f} s; backend {runner.backend.name}; threads {torch.get_num_threads()}")
    blocks = Blocks(runner.kv_pool.num_blocks, block_size)

    hf = HFDecoder(model_dir) if args.compare_hf else None
    for b in args.batches:
        bench_decode(runner, blocks, b, args.context, 2, hf)  # warm-up (allocator, kernel caches)
        ts, hf_ts = bench_decode(runner, blocks, b, args.context, args.steps, hf)
        med = statistics.median(ts)
        line = (
            f"decode batch {b:3d} ctx ~{args.context}: median {med * 1e3:7.1f} ms "
            f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}) -> {b / med:6.1f} tok/s"
        )
        if hf_ts:
            line += f"; HF same moments: median {statistics.median(hf_ts) * 1e3:.1f} ms (min {min(hf_ts) * 1e3:.1f})"
        if args.compare_contiguous:
            base = ContiguousBaseline(runner, b, args.context + args.steps + 4)
            bts = base.run(make_seqs(b, args.context, first_id=5000 + b), args.steps + 2)[2:]
            line += f"; contiguous plain torch: median {statistics.median(bts) * 1e3:.1f} ms"
        print(line)

    if args.prefill_prompts > 0:
        seqs = make_seqs(args.prefill_prompts, args.prefill_len, first_id=7)
        t = clock()
        steps = run_chunked(runner, blocks, seqs, args.chunk)
        total = clock() - t
        n_tok = args.prefill_prompts * args.prefill_len
        print(
            f"prefill {args.prefill_prompts}x{args.prefill_len} in {len(steps)} steps of <= {args.chunk}: "
            f"{total:.2f} s -> {n_tok / total:.0f} tok/s (median step {statistics.median(steps) * 1e3:.0f} ms)"
        )
        for s in seqs:
            blocks.release(s)

    if args.profile:
        from torch.profiler import profile

        seqs = make_seqs(args.profile, args.context, first_id=99)
        run_chunked(runner, blocks, seqs, runner.max_num_batched_tokens)
        items = []
        for s in seqs:
            blocks.grow(s, len(s.token_ids))
            items.append(BatchItem(s, 1, sample=True))
        with profile() as prof:
            runner.execute(items)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
