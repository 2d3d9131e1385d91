"""The device check's correctness parts: logits and greedy tokens against Hugging Face, paged /
prefix-cached / chunked / preempted runs, CUDA-graph replay, and the pool sized from GPU memory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from device_checks.common import (
    CountingObserver,
    GiB,
    Plan,
    Report,
    SeqView,
    compare_runs,
    decode_inputs,
    engine_config,
    greedy_params,
    random_prompts,
    timed,
)


def our_prefill_logits(runner: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Our prefill logits for every prompt position (float32, ``[n * len, vocab]``), on scattered blocks."""
    from servelm.runtime.batch import BatchItem
    from servelm.scheduler.sampling_params import SamplingParams

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


def check_logits_bf16(
    runner: Any, ref: torch.Tensor, hf_low: torch.Tensor, prompts: list[list[int]], report: Report
) -> None:
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


def hf_greedy(
    hf: Any, prompts: list[list[int]], steps: int, device: torch.device
) -> tuple[list[list[int]], list[list[float]]]:
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


def check_greedy_vs_hf(
    engine: Any, hf: Any, prompts: list[list[int]], steps: int, tol: float, device: torch.device, report: Report
) -> None:
    hf_tokens, hf_gaps = hf_greedy(hf, prompts, steps, device)
    params = greedy_params(steps)
    params.prompt_logprobs = 1  # the prompt scored in the same run (echo + logprobs on /v1/completions)
    results = engine.generate(prompts, params)
    ours = [r.outputs[0].token_ids for r in results]
    compare_runs(
        f"greedy {steps} tokens x {len(prompts)} prompts (batched) vs HF generate",
        hf_tokens,
        hf_gaps,
        ours,
        tol,
        report,
    )
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
    # Prompt logprobs: token j of each prompt from HF's row j - 1 (the first has none).
    worst, complete = 0.0, True
    for i, (p, r) in enumerate(zip(prompts, results)):
        lps = r.prompt_logprobs
        if lps is None or len(lps) != len(p) or lps[0] is not None:
            complete = False
            continue
        for j in range(1, len(p)):
            e = lps[j]
            complete &= e is not None and e.token_id == p[j]
            if e is not None:
                worst = max(worst, abs(e.logprob - ref_lp[i, j - 1, p[j]].item()))
    report.check(
        "prompt logprobs vs HF (prefill rows scored)",
        complete and worst < tol,
        f"{'every prompt token scored' if complete else 'MISSING or misplaced entries'}; max |d logprob| {worst:.3g} (tolerance {tol:.3g})",
        max_abs=worst,
    )


def check_paging_variants(
    base: Any, runner: Any, model_dir: Path, plan: Plan, dtype_name: str, vocab: int, tol: float, report: Report
) -> None:
    """Prefix-cached, chunked and preempted runs must reproduce the baseline engine's tokens."""
    from servelm.runtime.capacity import kv_bytes_per_token
    from servelm.scheduler.engine import Engine

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
    compare_runs(
        "prefix cache: first pass vs baseline", ref, ref_gaps, [r.outputs[0].token_ids for r in first], tol, report
    )
    compare_runs(
        "prefix cache: cached pass vs baseline", ref, ref_gaps, [r.outputs[0].token_ids for r in second], tol, report
    )
    report.check("prefix cache hits on the second pass", obs.prefix_hits > 0, f"{obs.prefix_hits} prompt tokens hit")
    assert eng.block_manager.num_used_blocks == 0

    # Chunked prefill under a small token budget.
    eng, obs = engine(max_num_batched_tokens=plan.chunk_tokens)
    got = eng.generate(prompts, greedy_params(steps))
    compare_runs(
        f"chunked prefill ({plan.chunk_tokens}-token steps) vs baseline",
        ref,
        ref_gaps,
        [r.outputs[0].token_ids for r in got],
        tol,
        report,
    )
    biggest = max((s.num_prompt_tokens for s in obs.steps), default=0)
    report.check(
        "chunked steps stay under the budget", biggest <= plan.chunk_tokens, f"largest prefill step {biggest} tokens"
    )

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
    report.check(
        "blocks all free at the end",
        eng.block_manager.num_used_blocks == 0,
        f"{eng.block_manager.num_used_blocks} in use",
    )


def check_cuda_graphs(runner: Any, plan: Plan, vocab: int, tol: float, report: Report) -> None:
    from servelm.runtime.cuda.graphs import CudaGraphRunner

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
            t_eager = timed(
                lambda: runner.model(inputs.input_ids, inputs.positions, m), runner.device, plan.timing_iters
            )
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


def check_few_row_kernels(runner: Any, plan: Plan, vocab: int, tol: float, report: Report) -> None:
    """The fused few-row projections (``runtime.cuda.triton_gemv``) against the plain path, eager, on
    decode steps of 1 and 3 rows; then what the runner's graph capture measured and chose per size."""
    k = getattr(runner, "few_rows", None)
    if k is None:
        print("  the runner has no few-row kernels (SERVELM_DECODE_GEMV=off or fused ops disabled)")
        return
    dtype = str(runner.dtype).replace("torch.", "")
    from servelm.runtime.cuda.graph_variants import few_row_tolerance

    # The capture-time A/B's own limit (float32: tighter, the kernels must match to ~1e-6 per op).
    limit = 1e-4 if runner.dtype == torch.float32 else few_row_tolerance(runner.dtype)
    saved = k.max_rows
    try:
        for batch in (1, 3):
            with torch.inference_mode():
                inputs = decode_inputs(runner, batch, plan.graph_context, vocab, seed=40 + batch)
                m = runner.backend.build_metadata(inputs.meta) if inputs.graph else inputs.meta
                outs, times = [], []
                for rows in (batch, 0):
                    k.max_rows = rows
                    outs.append(runner.model(inputs.input_ids, inputs.positions, m))
                    times.append(
                        timed(
                            lambda: runner.model(inputs.input_ids, inputs.positions, m),
                            runner.device,
                            plan.timing_iters,
                        )
                    )
                fused, plain = outs
                top2 = runner.model.compute_logits(plain).float().topk(2, dim=-1)
                flips = runner.model.compute_logits(fused).float().argmax(-1) != top2.indices[:, 0]
                real_flips = int((flips & (top2.values[:, 0] - top2.values[:, 1] >= tol)).sum())
                rel = ((fused.float() - plain.float()).norm() / plain.float().norm()).item()
            report.check(
                f"{dtype} few-row projections == plain projections (eager decode, batch {batch})",
                rel <= limit and real_flips == 0,
                f"hidden states differ by {rel:.2e} (limit {limit:g}); argmax differs in {int(flips.sum())} of {batch} rows, "
                f"{real_flips} outside near-ties; eager {times[0] * 1e3:.2f} ms fused vs {times[1] * 1e3:.2f} ms plain",
            )
    finally:
        k.max_rows = saved
    from servelm.runtime.cuda import triton_gemv

    for line in triton_gemv.tuned_tiles():
        print(f"  autotuned: {line}")
    graphs = runner.graph_runner
    for bs, v in sorted(graphs.variants.items() if graphs is not None else []):
        plain = f"plain {v.plain_ms:.3f} ms, x{v.plain_ms / v.fused_ms:.2f}; " if v.plain_ms is not None else ""
        report.row(
            f"{dtype} decode graph, batch {bs}: fused few-row projections vs plain (capture-time A/B)",
            v.fused_ms,
            "ms fused",
            f"{plain}outputs differ by {v.rel_diff:.1e}; kept {v.chosen}",
            plain_ms=v.plain_ms,
            chosen=v.chosen,
        )
        if v.pdl_ms is not None:
            report.row(
                f"{dtype} decode graph, batch {bs}: fused, launched with PDL vs without (capture-time A/B)",
                v.pdl_ms,
                "ms PDL",
                f"without {v.fused_ms:.3f} ms, x{v.fused_ms / v.pdl_ms:.3f}",
                fused_ms=v.fused_ms,
            )
            report.check(
                f"{dtype} decode graph, batch {bs}: PDL launches give the fused graph's outputs bit for bit",
                v.pdl_identical,
                "4 decodes, each storing a new token's K/V at a slot no replay wrote before",
            )
    if graphs is not None and graphs.few_rows_max and not any(v.pdl_ms is not None for v in graphs.variants.values()):
        from servelm.runtime.cuda import pdl

        print(f"  PDL not tried: {pdl.unavailable_reason(runner.device) or 'its capture failed (see the log)'}")


def check_measured_budget(
    model_dir: Path, plan: Plan, dtype_name: str, vocab: int, device: torch.device, report: Report
) -> None:
    """Engine start-up as `servelm serve` does it on CUDA: weights, warm-up, measured pool, graphs."""
    from servelm.scheduler.engine import Engine

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
    report.check(
        "the runner captured its decode graphs", graphs is not None and graphs.captured, f"{graphs and graphs.sizes}"
    )
    gen = torch.Generator().manual_seed(5)
    prompts = random_prompts(4, 32, vocab, gen)
    res = eng.generate(prompts, greedy_params(8))
    report.check(
        "generate on the measured pool",
        all(len(x.outputs[0].token_ids) == 8 for x in res) and eng.block_manager.num_used_blocks == 0,
        f"{[len(x.outputs[0].token_ids) for x in res]} tokens, {eng.block_manager.num_used_blocks} blocks in use after",
    )
    del eng, r, graphs
