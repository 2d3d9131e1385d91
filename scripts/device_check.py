#!/usr/bin/env python3
"""One GPU check of servelm's CUDA path, sized to finish in well under 8 minutes on one H200.

It needs only torch, triton, transformers (+ tokenizers, safetensors) and this repo's ``runtime``,
``scheduler`` and ``metrics`` packages: no network, no fastapi/uvicorn/pydantic.

1. A Llama-3-8B-shaped model (32 layers, hidden 4096, 32/8 heads, intermediate 14336, vocab 128256,
   rope_theta 500000) with random bf16 weights is built on the device with transformers and saved,
   with a word-level tokenizer over its vocabulary, to a scratch folder; servelm loads that folder.
2. Logits: our prefill logits vs HF's on the same prompts (bf16 tolerance, argmax agreement).
3. Greedy: 32 tokens per prompt, batched through ``Engine.generate``, equal HF ``generate``'s
   (a divergence is excused only at a near-tie of HF's own logits), and our logprobs vs HF's.
4. Paging: prefix-cached, chunked-prefill and preempted runs give the baseline's tokens.
5. CUDA graphs: ``runtime.cuda_graphs.CudaGraphRunner`` replays equal eager decode steps; timings.
6. Throughput: ms per output token at batch 1 vs the weight-read floor, output tok/s for 256
   concurrent 128 -> 128 requests, one 8k-token prefill vs a measured bf16 matmul rate.

``--dry-run --device cpu --tiny`` runs the same plumbing with a tiny model and toy sizes on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# Packages the GPU machine does not have: the check must not import them.
# (httpx is not among them: huggingface_hub, which transformers imports, uses it, and the machine has it.)
SERVER_ONLY = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette")

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    rope_theta=500000.0,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
H200_BANDWIDTH = 4.8e12  # datasheet HBM3e bytes/s (runtime.capacity's "h200" preset)
GiB = 2**30


@dataclass
class Plan:
    """Workload sizes: the real check, or toy sizes for --dry-run."""

    num_prompts: int = 8
    prompt_len: int = 128
    greedy_tokens: int = 32
    prefix_blocks: int = 2  # shared prefix of the prefix-cache check, in pool blocks (at least 512 tokens)
    suffix_len: int = 32
    chunk_tokens: int = 64  # max_num_batched_tokens of the chunked-prefill engine
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    kv_bytes: int = 40 * GiB
    exact_kv_bytes: int = 8 * GiB  # the float32 engine of the exactness checks
    graph_max_batch: int = 64
    graph_context: int = 512
    single_prompt: int = 128
    single_tokens: int = 128
    concurrent: int = 256
    concurrent_prompt: int = 128
    concurrent_tokens: int = 128
    prefill_tokens: int = 8000
    timing_iters: int = 20

    @classmethod
    def dry(cls) -> "Plan":
        return cls(
            num_prompts=3,
            prompt_len=12,
            greedy_tokens=8,
            prefix_blocks=2,
            suffix_len=4,
            chunk_tokens=8,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=1024,
            kv_bytes=64 * 2**20,
            exact_kv_bytes=64 * 2**20,
            graph_max_batch=4,
            graph_context=40,
            single_prompt=16,
            single_tokens=8,
            concurrent=8,
            concurrent_prompt=16,
            concurrent_tokens=8,
            prefill_tokens=256,
            timing_iters=3,
        )


@dataclass
class Report:
    """Everything printed at the end (and written as JSON with --json)."""

    environment: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    throughput: list[dict[str, Any]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str, **numbers: Any) -> None:
        self.checks.append({"name": name, "ok": ok, "detail": detail, **numbers})
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)

    def row(self, name: str, value: float, unit: str, reference: str = "", **extra: Any) -> None:
        self.throughput.append({"name": name, "value": value, "unit": unit, "reference": reference, **extra})
        print(f"  {name}: {value:,.2f} {unit}" + (f"   ({reference})" if reference else ""), flush=True)

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)


class CountingObserver:
    """A ``metrics.observer.Observer`` that keeps what the checks assert on."""

    def __init__(self) -> None:
        self.steps: list[Any] = []
        self.preemptions = 0
        self.prefix_hits = 0

    def on_step(self, stats: Any) -> None:
        self.steps.append(stats)
        self.preemptions += stats.num_preemptions
        self.prefix_hits += stats.prefix_cache_hits

    def on_request_finished(self, stats: Any) -> None:
        pass

    def on_request_rejected(self) -> None:
        pass

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


@dataclass
class SeqView:
    """A ``runtime.batch.SequenceView`` for driving the runner directly (no scheduler)."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    params: Any
    generator: Any = None
    stop_token_ids_for_min_tokens: tuple[int, ...] = ()


# ----------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs (after one warm-up)."""
    fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    # Ids 0..2 are unk/bos/eos of the word-level tokenizer: keep prompts to ordinary tokens.
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_runs(
    name: str, ref: list[list[int]], ref_gaps: list[list[float]], got: list[list[int]], tol: float, report: Report
) -> None:
    """Token-exact, except a divergence where the reference's own top-two gap is below ``tol``."""
    exact = 0
    ties: list[str] = []
    bad: list[str] = []
    for i, (r, g) in enumerate(zip(ref, got)):
        d = first_divergence(r, g)
        if d is None:
            exact += 1
        elif d < len(ref_gaps[i]) and ref_gaps[i][d] < tol:
            ties.append(f"prompt {i} step {d} (gap {ref_gaps[i][d]:.3g})")
        else:
            gap = ref_gaps[i][d] if d < len(ref_gaps[i]) else float("nan")
            bad.append(f"prompt {i} step {d} (gap {gap:.3g}): ref {r[d:d + 4]} got {g[d:d + 4]}")
    detail = f"{exact}/{len(ref)} token-exact"
    if ties:
        detail += f"; near-ties (< {tol:.3g}): " + ", ".join(ties)
    if bad:
        detail += "; MISMATCH: " + ", ".join(bad)
    report.check(name, not bad, detail, exact=exact, near_ties=len(ties), mismatches=len(bad))


# ----------------------------------------------------------------------------- model + tokenizer


def build_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over exactly the model's vocabulary ("t0" .. "tN"): no download needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


def build_hf_model(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """HF ``LlamaForCausalLM`` with random weights, created directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    # Parameters only: ``model.to(bf16)`` would also round the RoPE inverse frequencies (a float32
    # buffer), which ``from_pretrained(dtype=bf16)`` keeps in float32; at position ~100 that rounding
    # moves the rotation angles by ~0.1 rad and the reference would no longer be Llama.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


# ----------------------------------------------------------------------------- the checks


def our_prefill_logits(runner: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Our prefill logits for every prompt position (float32, ``[n * len, vocab]``), on scattered blocks."""
    from runtime.batch import BatchItem
    from scheduler.sampling_params import SamplingParams

    bs = runner.block_size
    length = len(prompts[0])
    per_seq = -(-length // bs)
    # Scattered, non-contiguous block tables.
    blocks = torch.randperm(runner.kv_pool.num_blocks, generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0.0)
    items = [
        BatchItem(SeqView(i, list(p), length, 0, blocks[i * per_seq : (i + 1) * per_seq], params), length, True)
        for i, p in enumerate(prompts)
    ]
    with torch.inference_mode():
        inputs = runner.prepare(items)
        return runner.model.compute_logits(runner.forward(inputs)).float()


def hf_logits(hf: Any, prompts: list[list[int]], device: torch.device) -> torch.Tensor:
    with torch.inference_mode():
        out = hf(torch.tensor(prompts, device=device)).logits.float()
    return out.reshape(-1, out.shape[-1])


def logit_error(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Distance of ``ours`` from ``ref``: max/p99/mean |d|, argmax agreement, and the near-tie
    tolerance it implies (4 x p99)."""
    diff = (ours - ref).abs()
    flat = diff.flatten()
    sample = flat[torch.randint(0, flat.numel(), (min(flat.numel(), 2_000_000),), device=flat.device)]
    p99 = torch.quantile(sample, 0.99).item()
    ref_top2 = ref.topk(2, dim=-1)
    agree = ours.argmax(-1) == ref_top2.indices[:, 0]
    return dict(
        max=diff.max().item(),
        p99=p99,
        mean=diff.mean().item(),
        std=ref.std().item(),
        agree=agree.float().mean().item(),
        tol=max(4 * p99, 1e-4),
        gap=(ref_top2.values[:, 0] - ref_top2.values[:, 1]),
        agree_mask=agree,
    )


def describe_error(e: dict[str, Any]) -> str:
    return (
        f"max |d| {e['max']:.3g}, p99 {e['p99']:.3g}, mean {e['mean']:.3g} (logit std {e['std']:.3g}); "
        f"argmax agrees at {e['agree']:.2%}"
    )


def check_logits_exact(runner: Any, ref: torch.Tensor, prompts: list[list[int]], report: Report) -> float:
    """float32: our logits must match HF float32's closely (the same math, other kernels and sum orders).
    Returns the near-tie tolerance for the float32 token comparisons."""
    ours = our_prefill_logits(runner, prompts)
    e = logit_error(ours, ref)
    real = int((~e["agree_mask"] & (e["gap"] >= e["tol"])).sum())
    mean_rel = e["mean"] / e["std"]
    report.check(
        "float32 prefill logits vs HF float32",
        real == 0 and mean_rel < 1e-3,
        f"{ours.shape[0]} positions: {describe_error(e)}, {real} disagreements outside near-ties (< {e['tol']:.3g}); "
        f"mean |d| / std {mean_rel:.2g} (limit 1e-3)",
        max_abs=e["max"],
        p99_abs=e["p99"],
        mean_rel=mean_rel,
    )
    return e["tol"]


def check_logits_bf16(runner: Any, ref: torch.Tensor, hf_low: torch.Tensor, prompts: list[list[int]], report: Report) -> None:
    """Low precision: our logits' distance from the float32 reference must be about HF's own
    (the same weights run by HF in the same dtype), since neither can be exact."""
    ours = our_prefill_logits(runner, prompts)
    e_ours = logit_error(ours, ref)
    e_hf = logit_error(hf_low, ref)
    ratio = e_ours["mean"] / max(e_hf["mean"], 1e-12)
    report.check(
        f"{runner.dtype} prefill logits: distance from HF float32 vs HF {runner.dtype}'s own",
        ratio <= 1.5 and e_ours["agree"] >= e_hf["agree"] - 0.05,
        f"ours: {describe_error(e_ours)}; HF {runner.dtype}: {describe_error(e_hf)}; mean |d| ratio {ratio:.2f} (limit 1.5)",
        mean_ratio=ratio,
        ours_mean_abs=e_ours["mean"],
        hf_mean_abs=e_hf["mean"],
        ours_agree=e_ours["agree"],
        hf_agree=e_hf["agree"],
    )
    return None


def hf_greedy(hf: Any, prompts: list[list[int]], steps: int, device: torch.device) -> tuple[list[list[int]], list[list[float]]]:
    """HF ``generate`` greedy tokens per prompt (batch 1: no padding) and its top-two logit gaps per step."""
    tokens, gaps = [], []
    # No EOS: like our ignore_eos requests, run the full length without masking any token.
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p], device=device),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                max_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(p) :].tolist())
            top2 = torch.stack([lg[0].float().topk(2).values for lg in out.logits])
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    return tokens, gaps


def our_gaps(results: list[Any]) -> list[list[float]]:
    """Top-two logprob gaps per generated token (needs logprobs >= 1 in the request)."""
    gaps = []
    for r in results:
        lps = r.outputs[0].logprobs or []
        gaps.append([(lp.top[0][1] - lp.top[1][1]) if len(lp.top) > 1 else float("inf") for lp in lps])
    return gaps


def greedy_params(n: int, logprobs: int = 2) -> Any:
    from scheduler.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def check_greedy_vs_hf(
    engine: Any, hf: Any, prompts: list[list[int]], steps: int, tol: float, device: torch.device, report: Report
) -> None:
    hf_tokens, hf_gaps = hf_greedy(hf, prompts, steps, device)
    results = engine.generate(prompts, greedy_params(steps))
    ours = [r.outputs[0].token_ids for r in results]
    compare_runs(f"greedy {steps} tokens x {len(prompts)} prompts (batched) vs HF generate", hf_tokens, hf_gaps, ours, tol, report)
    # Our logprobs vs HF's log-softmax along *our* tokens (teacher forcing: valid even past a near-tie).
    with torch.inference_mode():
        full = torch.tensor([p + o for p, o in zip(prompts, ours)], device=device)
        ref_lp = torch.log_softmax(hf(full).logits.float(), dim=-1)
    worst = 0.0
    for i, (p, r) in enumerate(zip(prompts, results)):
        for t, lp in enumerate(r.outputs[0].logprobs or []):
            worst = max(worst, abs(lp.logprob - ref_lp[i, len(p) - 1 + t, lp.token_id].item()))
    report.check(
        "chosen-token logprobs vs HF (teacher-forced)",
        worst < tol,
        f"max |d logprob| {worst:.3g} (tolerance {tol:.3g})",
        max_abs=worst,
    )


def check_paging_variants(
    base: Any, runner: Any, model_dir: Path, plan: Plan, dtype_name: str, vocab: int, tol: float, report: Report
) -> None:
    """Prefix-cached, chunked and preempted runs must reproduce the baseline engine's tokens."""
    from runtime.capacity import kv_bytes_per_token
    from scheduler.engine import Engine

    bs = runner.block_size
    gen = torch.Generator().manual_seed(11)
    prefix_len = max(plan.prefix_blocks * bs, 16 if plan.prompt_len < 64 else 512)
    prefix = random_prompts(1, prefix_len, vocab, gen)[0]
    prompts = [prefix + s for s in random_prompts(plan.num_prompts, plan.suffix_len, vocab, gen)]
    steps = plan.greedy_tokens
    ref_res = base.generate(prompts, greedy_params(steps))
    ref = [r.outputs[0].token_ids for r in ref_res]
    ref_gaps = our_gaps(ref_res)
    seq_len = prefix_len + plan.suffix_len + steps
    max_len = -(-seq_len // bs) * bs

    def engine(**over: Any) -> tuple[Any, CountingObserver]:
        # The runner's whole pool unless a smaller budget is asked for (the preemption run).
        base = {"block_size": bs, "max_model_len": max_len, "kv_cache_memory": runner.kv_pool.nbytes}
        cfg = engine_config(model_dir, runner.device, dtype_name, plan, **{**base, **over})
        obs = CountingObserver()
        return Engine(cfg, obs, runner=runner), obs

    # Prefix caching: the second pass must hit the shared prefix and still give the same tokens.
    eng, obs = engine(enable_prefix_caching=True)
    first = eng.generate(prompts, greedy_params(steps))
    obs.reset()
    second = eng.generate(prompts, greedy_params(steps))
    compare_runs("prefix cache: first pass vs baseline", ref, ref_gaps, [r.outputs[0].token_ids for r in first], tol, report)
    compare_runs("prefix cache: cached pass vs baseline", ref, ref_gaps, [r.outputs[0].token_ids for r in second], tol, report)
    report.check("prefix cache hits on the second pass", obs.prefix_hits > 0, f"{obs.prefix_hits} prompt tokens hit")
    assert eng.block_manager.num_used_blocks == 0

    # Chunked prefill under a small token budget.
    eng, obs = engine(max_num_batched_tokens=plan.chunk_tokens)
    got = eng.generate(prompts, greedy_params(steps))
    compare_runs(f"chunked prefill ({plan.chunk_tokens}-token steps) vs baseline", ref, ref_gaps, [r.outputs[0].token_ids for r in got], tol, report)
    biggest = max((s.num_prompt_tokens for s in obs.steps), default=0)
    report.check("chunked steps stay under the budget", biggest <= plan.chunk_tokens, f"largest prefill step {biggest} tokens")

    # Preemption: prompts of whole blocks, in a pool that holds every prompt but room to grow for
    # only half of them, so the first decode steps must preempt (and later recompute) some.
    whole = (len(prompts[0]) // bs) * bs
    cut = [p[:whole] for p in prompts]
    cut_res = base.generate(cut, greedy_params(steps))
    cut_ref, cut_gaps = [r.outputs[0].token_ids for r in cut_res], our_gaps(cut_res)
    blocks_needed = plan.num_prompts * -(-(whole + steps) // bs)
    small_blocks = plan.num_prompts * (whole // bs) + plan.num_prompts // 2
    per_token = kv_bytes_per_token(runner.model_config, runner.dtype)
    eng, obs = engine(kv_cache_memory=small_blocks * bs * per_token, max_model_len=-(-(whole + steps) // bs) * bs)
    got = eng.generate(cut, greedy_params(steps))
    compare_runs(
        f"preempted run ({small_blocks} of {blocks_needed} blocks) vs baseline",
        cut_ref,
        cut_gaps,
        [r.outputs[0].token_ids for r in got],
        tol,
        report,
    )
    report.check("preemption happened", obs.preemptions > 0, f"{obs.preemptions} preemptions")
    report.check("blocks all free at the end", eng.block_manager.num_used_blocks == 0, f"{eng.block_manager.num_used_blocks} in use")


def decode_inputs(runner: Any, batch: int, context: int, vocab: int, seed: int) -> Any:
    """A fabricated decode step: ``batch`` sequences with ``context`` tokens on scattered blocks."""
    from runtime.batch import BatchItem
    from scheduler.sampling_params import SamplingParams

    bs = runner.block_size
    per_seq = -(-context // bs)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(runner.kv_pool.num_blocks, generator=gen)[: batch * per_seq].tolist()
    ids = torch.randint(3, vocab, (batch, context), generator=gen).tolist()
    params = SamplingParams(temperature=0.0)
    items = [
        BatchItem(SeqView(i, ids[i], context - 1, context - 1, blocks[i * per_seq : (i + 1) * per_seq], params), 1, True)
        for i in range(batch)
    ]
    return runner.prepare(items)


def check_cuda_graphs(runner: Any, plan: Plan, vocab: int, tol: float, report: Report) -> None:
    from runtime.cuda_graphs import CudaGraphRunner

    bs = runner.block_size
    graphs = CudaGraphRunner(
        runner.model,
        runner.backend,
        max_num_seqs=plan.graph_max_batch,
        max_blocks_per_seq=-(-plan.graph_context // bs) + 1,
        block_size=bs,
        device=runner.device,
    )
    t0 = time.perf_counter()
    graphs.capture()
    report.row("CUDA graph capture", time.perf_counter() - t0, "s", f"sizes {graphs.sizes}")
    for batch in sorted({1, 3, plan.graph_max_batch}):
        with torch.inference_mode():
            inputs = decode_inputs(runner, batch, plan.graph_context, vocab, seed=batch)
            # prepare() leaves the metadata raw where the runner's own graphs would replay the step.
            m = runner.backend.build_metadata(inputs.meta) if inputs.graph else inputs.meta
            # The model itself, not runner.forward: that may already replay the runner's own graphs.
            eager = runner.model(inputs.input_ids, inputs.positions, m)
            replay = graphs.run(inputs.input_ids, inputs.positions, m.slot_mapping, m.seq_lens, m.block_tables)
            # Padding changes the matmul shapes (3 rows run as 4), so allow bf16 rounding; an argmax
            # flip counts only where the eager logits' top two are not a near-tie.
            top2 = runner.model.compute_logits(eager).float().topk(2, dim=-1)
            flips = runner.model.compute_logits(replay).float().argmax(-1) != top2.indices[:, 0]
            real_flips = int((flips & (top2.values[:, 0] - top2.values[:, 1] >= tol)).sum())
            eager, replay = eager.float(), replay.float()
            diff = (eager - replay).abs().max().item()
            scale = eager.abs().max().item()
            t_eager = timed(lambda: runner.model(inputs.input_ids, inputs.positions, m), runner.device, plan.timing_iters)
            t_graph = timed(
                lambda: graphs.run(inputs.input_ids, inputs.positions, m.slot_mapping, m.seq_lens, m.block_tables),
                runner.device,
                plan.timing_iters,
            )
        report.check(
            f"CUDA graph replay == eager decode (batch {batch})",
            diff <= 0.02 * max(scale, 1e-6) and real_flips == 0,
            f"max |d hidden| {diff:.3g} (max |hidden| {scale:.3g}); argmax differs in {int(flips.sum())} of {batch} "
            f"rows, {real_flips} outside near-ties",
        )
        report.row(
            f"decode forward, batch {batch}, context {plan.graph_context}: eager / graph",
            t_eager * 1e3,
            "ms eager",
            f"graph {t_graph * 1e3:.2f} ms, x{t_eager / t_graph:.2f}",
            graph_ms=t_graph * 1e3,
        )


class unfused:
    """Within the block, ``runner``'s model runs without the fused Triton ops."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def __enter__(self) -> None:
        from runtime.models.llama import MLP, RMSNorm

        self.saved = [(m, "fused", m.fused) for m in self.runner.model.modules() if isinstance(m, RMSNorm)]
        self.saved += [(m, "act_mul", m.act_mul) for m in self.runner.model.modules() if isinstance(m, MLP)]
        self.saved.append((self.runner.backend, "fused_rope", getattr(self.runner.backend, "fused_rope", False)))
        for obj, name, _ in self.saved:
            setattr(obj, name, False if name == "fused_rope" else None)

    def __exit__(self, *exc: Any) -> None:
        for obj, name, value in self.saved:
            setattr(obj, name, value)


def profile_decode(runner: Any, plan: Plan, vocab: int, report: Report) -> None:
    """Where a decode step's time goes: kernels per forward and the costliest ones (eager), and the
    host-side phases of a runner step (prepare, forward, LM head, sampling), for batch 1 and a full batch."""
    from torch.profiler import ProfilerActivity, profile

    from runtime.batch import BatchItem

    dev = runner.device
    for batch in sorted({1, plan.graph_max_batch, plan.concurrent}):
        with torch.inference_mode():
            inputs = decode_inputs(runner, batch, plan.graph_context, vocab, seed=100 + batch)
            meta = runner.backend.build_metadata(inputs.meta) if inputs.graph else inputs.meta
            runner.model(inputs.input_ids, inputs.positions, meta)
            sync(dev)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.model(inputs.input_ids, inputs.positions, meta)
                sync(dev)
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        total_us = sum(e.device_time_total for e in kernels)
        top = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:12]
        print(f"  eager decode forward, batch {batch}: {len(kernels)} GPU kernels, {total_us / 1e3:.2f} ms of kernel time")
        for e in top:
            t = getattr(e, "self_device_time_total", 0)
            if t <= 0:
                continue
            print(f"    {t / 1e3:8.3f} ms  x{e.count:<5} {e.key[:110]}")
        report.row(f"eager decode forward, batch {batch}: GPU kernels", float(len(kernels)), "kernels", f"{total_us / 1e3:.2f} ms kernel time")
        if batch == 1 and getattr(runner, "fused_ops", False):
            # The same eager forward without the fused Triton ops (plain torch norms, SiLU, RoPE, store).
            with torch.inference_mode():
                t_fused = timed(lambda: runner.model(inputs.input_ids, inputs.positions, meta), dev, plan.timing_iters)
                with unfused(runner):
                    t_plain = timed(lambda: runner.model(inputs.input_ids, inputs.positions, meta), dev, plan.timing_iters)
            report.row(
                "eager decode forward, batch 1: fused Triton ops vs plain torch",
                t_fused * 1e3,
                "ms fused",
                f"plain {t_plain * 1e3:.2f} ms, x{t_plain / t_fused:.2f}",
                plain_ms=t_plain * 1e3,
            )

        # Phases of runner.execute for the same step (each synchronised, medians).
        seqs = []
        ctx = plan.graph_context
        per_seq = -(-ctx // runner.block_size)
        blocks = torch.randperm(runner.kv_pool.num_blocks, generator=torch.Generator().manual_seed(7))[: batch * per_seq].tolist()
        ids = torch.randint(3, vocab, (batch, ctx), generator=torch.Generator().manual_seed(8)).tolist()
        params = greedy_params(1, logprobs=None)  # type: ignore[arg-type]
        items = [
            BatchItem(SeqView(i, ids[i], ctx - 1, ctx - 1, blocks[i * per_seq : (i + 1) * per_seq], params), 1, True)
            for i in range(batch)
        ]
        phases: dict[str, list[float]] = {"prepare": [], "forward": [], "lm head": [], "sample": [], "execute": []}
        with torch.inference_mode():
            for _ in range(plan.timing_iters + 1):
                t0 = time.perf_counter()
                inp = runner.prepare(items)
                sync(dev)
                t1 = time.perf_counter()
                hidden = runner.forward(inp)
                sync(dev)
                t2 = time.perf_counter()
                logits = runner.model.compute_logits(hidden.index_select(0, inp.sample_rows)).float()
                sync(dev)
                t3 = time.perf_counter()
                runner._sample(logits, [it.seq for it in items])
                t4 = time.perf_counter()
                runner.execute(items)
                t5 = time.perf_counter()
                for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    phases[k].append(dt)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in phases.items()}
        print(
            f"  runner step, batch {batch} (graph={inp.graph}): "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
        )
        report.row(
            f"runner.execute, batch {batch}, context {ctx}",
            med["execute"],
            "ms",
            ", ".join(f"{k} {v:.3f}" for k, v in med.items() if k != "execute") + f" (graph={inp.graph})",
            **{k.replace(" ", "_") + "_ms": v for k, v in med.items()},
        )


def engine_config(model_dir: Path, device: torch.device, dtype_name: str, plan: Plan, **over: Any) -> Any:
    """The check's engine settings (the plan's lengths and batch limits, its KV bytes, no prefix
    caching); ``over`` replaces any of them."""
    from scheduler.config import EngineConfig

    cfg: dict[str, Any] = dict(
        model=str(model_dir),
        device=str(device),
        dtype=dtype_name,
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        kv_cache_memory=plan.kv_bytes,
        enable_prefix_caching=False,
    )
    cfg.update(over)
    return EngineConfig(**cfg)


def check_measured_budget(
    model_dir: Path, plan: Plan, dtype_name: str, vocab: int, device: torch.device, report: Report
) -> None:
    """Engine start-up as `servelm serve` does it on CUDA: weights, warm-up, measured pool, graphs."""
    from scheduler.engine import Engine

    util = 0.5
    total = torch.cuda.get_device_properties(device).total_memory
    t0 = time.perf_counter()
    eng = Engine(engine_config(model_dir, device, dtype_name, plan, kv_cache_memory=None, gpu_memory_utilization=util))
    start_s = time.perf_counter() - t0
    used = torch.cuda.memory_reserved(device)
    r = eng.runner
    report.row("Engine start-up, measured KV budget + graph capture", start_s, "s", eng.capacity.describe())
    report.check(
        f"measured KV pool fits gpu_memory_utilization={util}",
        eng.capacity.num_blocks > 0 and used <= util * total,
        f"{r.kv_pool!r}; torch reserved {used / GiB:.1f} of {util * total / GiB:.1f} GiB allowed",
    )
    graphs = r.graph_runner
    report.check("the runner captured its decode graphs", graphs is not None and graphs.captured, f"{graphs and graphs.sizes}")
    gen = torch.Generator().manual_seed(5)
    prompts = random_prompts(4, 32, vocab, gen)
    res = eng.generate(prompts, greedy_params(8))
    report.check(
        "generate on the measured pool",
        all(len(x.outputs[0].token_ids) == 8 for x in res) and eng.block_manager.num_used_blocks == 0,
        f"{[len(x.outputs[0].token_ids) for x in res]} tokens, {eng.block_manager.num_used_blocks} blocks in use after",
    )
    del eng, r, graphs


def run_requests(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Add every request at once and step until all finish; returns wall seconds."""
    params = greedy_params(max_tokens, logprobs=None)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"tp-{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def measure_throughput(
    runner: Any, model_dir: Path, plan: Plan, dtype_name: str, vocab: int, device: torch.device, report: Report
) -> None:
    from runtime.capacity import flops_per_token
    from scheduler.engine import Engine

    obs = CountingObserver()
    engine = Engine(
        engine_config(model_dir, device, dtype_name, plan, block_size=runner.block_size),
        obs,
        runner=runner,
    )
    gen = torch.Generator().manual_seed(21)
    mc = runner.model_config

    # Batch 1: decode-only step time against the time to read every weight once.
    run_requests(engine, random_prompts(1, plan.single_prompt, vocab, gen), 4)  # warm-up
    obs.reset()
    run_requests(engine, random_prompts(1, plan.single_prompt, vocab, gen), plan.single_tokens)
    decode_steps = [s.duration_s for s in obs.steps if s.num_prompt_tokens == 0 and s.num_generation_tokens > 0]
    ms_tok = statistics.median(decode_steps) * 1e3
    floor = runner.weight_bytes / H200_BANDWIDTH * 1e3
    # The bandwidth this card really gives a plain copy (bytes read + written), for a second floor.
    n_copy = (1 << 30) if device.type == "cuda" else (1 << 20)
    src = torch.empty(n_copy, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), device, plan.timing_iters)
    copy_bw = 2 * src.numel() * src.element_size() / t_copy
    del src, dst
    floor_measured = runner.weight_bytes / copy_bw * 1e3
    report.row("device copy bandwidth (read + write)", copy_bw / 1e12, "TB/s", f"{2 * n_copy * 2 / 1e9:.1f} GB per copy")
    report.row(
        "batch 1: ms per output token",
        ms_tok,
        "ms",
        f"floor {floor:.2f} ms = weights / 4.8 TB/s; x{ms_tok / floor:.2f}; "
        f"x{ms_tok / floor_measured:.2f} of weights / measured copy bandwidth ({floor_measured:.2f} ms)",
        floor_ms=floor,
        floor_measured_ms=floor_measured,
    )

    # Concurrency: N requests of P -> T at once.
    obs.reset()
    prompts = random_prompts(plan.concurrent, plan.concurrent_prompt, vocab, gen)
    wall = run_requests(engine, prompts, plan.concurrent_tokens)
    out_tokens = plan.concurrent * plan.concurrent_tokens
    full = [s.duration_s for s in obs.steps if s.num_prompt_tokens == 0 and s.num_generation_tokens == plan.concurrent]
    full_ms = statistics.median(full) * 1e3 if full else float("nan")
    kinds: dict[str, list[float]] = {"with prompt tokens": [], "decode only": []}
    for st in obs.steps:
        kinds["with prompt tokens" if st.num_prompt_tokens else "decode only"].append(st.duration_s)
    stepped = sum(sum(v) for v in kinds.values())
    print(
        "  steps: "
        + "; ".join(f"{k}: {len(v)} steps, {sum(v):.2f} s" for k, v in kinds.items())
        + f"; outside steps {wall - stepped:.2f} s"
    )
    report.row(
        f"{plan.concurrent} concurrent {plan.concurrent_prompt} -> {plan.concurrent_tokens}: output tok/s",
        out_tokens / wall,
        "tok/s",
        f"{wall:.2f} s wall; full-batch decode step {full_ms:.2f} ms = {plan.concurrent / (full_ms / 1e3):,.0f} tok/s",
        wall_s=wall,
        full_batch_step_ms=full_ms,
    )

    # One long prefill in a single step, against a measured matmul rate.
    n = plan.prefill_tokens
    run_requests(engine, random_prompts(1, 512, vocab, gen), 1)  # warm-up of the prefill kernels
    obs.reset()
    run_requests(engine, random_prompts(1, n, vocab, gen), 1)
    step = max(obs.steps, key=lambda s: s.num_prompt_tokens)
    flops = flops_per_token(mc, 0) * n + 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * n * (n + 1) / 2
    achieved = flops / step.duration_s
    m, k, nn_ = min(n, 8192), mc.hidden_size, mc.intermediate_size
    a = torch.randn(m, k, device=device, dtype=runner.dtype)
    b = torch.randn(k, nn_, device=device, dtype=runner.dtype)
    t_mm = timed(lambda: a @ b, device, plan.timing_iters)
    mm_rate = 2.0 * m * k * nn_ / t_mm
    report.row(
        f"prefill of one {n}-token prompt",
        step.duration_s * 1e3,
        "ms",
        f"{n / step.duration_s:,.0f} tok/s, {achieved / 1e12:.1f} TFLOP/s = {achieved / mm_rate:.0%} of a measured "
        f"{runner.dtype} matmul ({mm_rate / 1e12:.1f} TFLOP/s at {m}x{k}x{nn_})",
        tflops=achieved / 1e12,
        matmul_tflops=mm_rate / 1e12,
    )
    report.check("throughput engine left no blocks in use", engine.block_manager.num_used_blocks == 0, "")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the real check) or cpu (plumbing only)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the Llama-3-8B shape")
    p.add_argument("--dry-run", action="store_true", help="toy workload sizes (plumbing check)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder for the saved model (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the saved model folder")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["logits", "greedy", "paging", "graphs", "profile", "throughput", "budget"],
        help="skip a section (repeatable)",
    )
    return p.parse_args(argv)


def environment(device: torch.device) -> dict[str, Any]:
    import importlib.util

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("transformers", "triton", "flash_attn"):
        if importlib.util.find_spec(name) is None:
            env[name] = None
        else:
            env[name] = getattr(__import__(name), "__version__", "?")
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GiB, 1)
        env["cuda"] = torch.version.cuda
    return env


def section(title: str, report: Report, fn: Callable[[], Any]) -> Any:
    print(f"\n== {title}", flush=True)
    t0 = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # one broken section must not hide the others
        traceback.print_exc()
        report.check(title, False, f"raised {type(e).__name__}: {e}")
        return None
    finally:
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu --tiny --dry-run for the plumbing check", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and args.tiny:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and they thrash on a busy machine
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    shape = TINY if args.tiny else LLAMA3_8B
    plan = Plan.dry() if args.dry_run else Plan()
    vocab = int(shape["vocab_size"])
    report = Report(environment(device))
    print("environment:", json.dumps(report.environment), flush=True)
    started = time.perf_counter()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="servelm-device-check-"))
    model_dir = workdir / "model"
    hf = engine = exact = None
    try:
        def build() -> Any:
            t0 = time.perf_counter()
            model = build_hf_model(shape, dtype, device, args.seed)
            t1 = time.perf_counter()
            model_dir.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(model_dir))
            build_tokenizer(vocab).save_pretrained(str(model_dir))
            params = sum(p.numel() for p in model.parameters())
            print(f"  HF model: {params / 1e9:.2f} B params, built in {t1 - t0:.1f} s, saved in {time.perf_counter() - t1:.1f} s")
            return model

        hf = section("build a random-weight model (transformers) and save it", report, build)
        if hf is None:
            return finish(report, args, started)

        def load(name: str, **over: Any) -> Any:
            from scheduler.engine import Engine

            eng = Engine(engine_config(model_dir, device, name, plan, **over))
            mc = eng.model_config
            assert (mc.num_layers, mc.hidden_size, mc.num_kv_heads, mc.rope_theta) == (
                shape["num_hidden_layers"],
                shape["hidden_size"],
                shape["num_key_value_heads"],
                shape["rope_theta"],
            ), mc
            r = eng.runner
            report.environment.update(backend=r.backend.name, block_size=r.block_size, kv_pool=repr(r.kv_pool))
            print(f"  {name}: backend {r.backend.name}, block size {r.block_size}, {eng.capacity.describe()}")
            return eng

        gen = torch.Generator().manual_seed(args.seed + 1)
        prompts = random_prompts(plan.num_prompts, plan.prompt_len, vocab, gen)
        low = dtype != torch.float32

        # Exactness is checked in float32, where two correct implementations agree to ~1e-6 per op:
        # HF's model upcast in place is the reference, and our float32 engine must match it closely,
        # token for token. In bf16 neither is exact, so there our logits are compared with HF's bf16
        # by their distance from that float32 reference.
        def references() -> tuple[torch.Tensor | None, torch.Tensor]:
            hf_low = hf_logits(hf, prompts, device) if low else None
            hf.float()
            return hf_low, hf_logits(hf, prompts, device)

        refs = section("HF reference logits" + (f" ({dtype_name}, then float32)" if low else ""), report, references)
        if refs is None:
            return finish(report, args, started)
        hf_low, ref = refs
        exact = section("load it into servelm in float32 (Engine)", report, lambda: load("float32", kv_cache_memory=plan.exact_kv_bytes))
        if exact is None:
            return finish(report, args, started)
        tol = 1e-3
        if "logits" not in args.skip:
            tol = section("float32 prefill logits vs HF", report, lambda: check_logits_exact(exact.runner, ref, prompts, report)) or tol
        print(f"   near-tie tolerance for float32 token comparisons: {tol:.3g}")
        if "greedy" not in args.skip:
            section(
                "float32 greedy decoding vs HF generate",
                report,
                lambda: check_greedy_vs_hf(exact, hf, prompts, plan.greedy_tokens, tol, device, report),
            )
        del hf
        hf = None
        free_memory(device)
        if "paging" not in args.skip:
            section(
                "float32 paged / prefix-cached / chunked / preempted runs",
                report,
                lambda: check_paging_variants(exact, exact.runner, model_dir, plan, "float32", vocab, tol, report),
            )
        if low:
            del exact
            exact = None
            free_memory(device)
            engine = section(f"load it into servelm in {dtype_name} (Engine)", report, lambda: load(dtype_name))
            if engine is None:
                return finish(report, args, started)
            if "logits" not in args.skip:
                section(
                    f"{dtype_name} prefill logits vs HF",
                    report,
                    lambda: check_logits_bf16(engine.runner, ref, hf_low, prompts, report),
                )
            # Argmax flips in the graph check are excused below this logit gap.
            tol = 0.25
        else:
            engine, exact = exact, None
        del ref, hf_low
        runner = engine.runner
        if "graphs" not in args.skip:
            if device.type == "cuda":
                section("CUDA graphs (runtime.cuda_graphs)", report, lambda: check_cuda_graphs(runner, plan, vocab, tol, report))
            else:
                print("\n== CUDA graphs: skipped (no CUDA device)")
        if "profile" not in args.skip:
            section("where a decode step's time goes", report, lambda: profile_decode(runner, plan, vocab, report))
        if "throughput" not in args.skip:
            section(
                "throughput",
                report,
                lambda: measure_throughput(runner, model_dir, plan, dtype_name, vocab, device, report),
            )
        if "budget" not in args.skip and device.type == "cuda":
            del runner, engine
            engine = runner = None
            free_memory(device)
            section(
                "KV pool sized from GPU memory (kv_cache_memory unset) + the runner's own graphs",
                report,
                lambda: check_measured_budget(model_dir, plan, dtype_name, vocab, device, report),
            )
        return finish(report, args, started)
    finally:
        del hf, engine, exact
        free_memory(device)
        if not args.keep:
            shutil.rmtree(workdir if args.workdir is None else model_dir, ignore_errors=True)


def finish(report: Report, args: argparse.Namespace, started: float) -> int:
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in SERVER_ONLY)
    report.check("imports nothing the GPU machine lacks", not leaked, ", ".join(leaked) or "none of " + ", ".join(SERVER_ONLY))
    elapsed = time.perf_counter() - started
    print(f"\n== summary ({elapsed:.0f} s)")
    for r in report.throughput:
        print(f"  {r['name']:<72} {r['value']:>12,.2f} {r['unit']:<8} {r['reference']}")
    failed = [c["name"] for c in report.checks if not c["ok"]]
    print(f"  checks: {len(report.checks) - len(failed)}/{len(report.checks)} passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(report), "elapsed_s": elapsed, "ok": report.ok}, indent=2, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
