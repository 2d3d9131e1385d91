"""The device check's performance parts: where a decode step's time goes (kernels, host phases,
fused vs plain ops) and the throughput table (batch-1 latency, concurrent requests, a long prefill)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from device_checks.common import (
    H200_BANDWIDTH,
    CountingObserver,
    Plan,
    Report,
    SeqView,
    decode_inputs,
    engine_config,
    greedy_params,
    is_cuda,
    random_prompts,
    run_requests,
    sync,
    timed,
)
from servelm.runtime.cuda.profiling import gpu_kernel_events


class unfused:
    """Within the block, ``runner``'s model runs without the fused Triton ops."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def __enter__(self) -> None:
        from servelm.runtime.models.decoder import MLP
        from servelm.runtime.models.layers import RMSNorm

        self.saved = [(m, "fused", m.fused) for m in self.runner.model.modules() if isinstance(m, RMSNorm)]
        self.saved += [(m, "act_mul", m.act_mul) for m in self.runner.model.modules() if isinstance(m, MLP)]
        self.saved.append((self.runner.backend, "fused_rope", getattr(self.runner.backend, "fused_rope", False)))
        for obj, name, _ in self.saved:
            setattr(obj, name, False if name == "fused_rope" else None)

    def __exit__(self, *exc: Any) -> None:
        for obj, name, value in self.saved:
            setattr(obj, name, value)


def gpu_timeline(fn: Any, device: torch.device) -> tuple[int, float, float] | None:
    """Profile one call of ``fn``: (GPU kernels, their summed time in ms, first start to last end in
    ms). The difference of the last two is the device's idle time: gaps between kernels, host work.
    None off CUDA or when the profiler gives no kernel timings (e.g. inside a CUDA graph)."""
    if not is_cuda(device):
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no host tracing: it would widen the gaps
        fn()
        sync(device)
    kernels = [e for e in gpu_kernel_events(prof) if e.time_range.end > e.time_range.start]
    if not kernels:
        return None
    busy_us = sum(e.time_range.end - e.time_range.start for e in kernels)
    span_us = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    return len(kernels), busy_us / 1e3, span_us / 1e3


def timeline_row(report: Report, name: str, timeline: tuple[int, float, float] | None) -> None:
    if timeline is None:
        print(f"  {name}: no GPU timeline (CPU, or the profiler saw no kernels)")
        return
    n, busy, span = timeline
    report.row(
        name,
        busy / span * 100 if span else float("nan"),
        "% GPU busy",
        f"{n} kernels, {busy:.2f} ms of kernel time over {span:.2f} ms; idle {span - busy:.2f} ms",
        kernels=n,
        kernel_ms=busy,
        span_ms=span,
    )


def profile_decode(runner: Any, plan: Plan, vocab: int, report: Report) -> None:
    """Where a decode step's time goes: kernels per forward and the costliest ones (eager), and the
    host-side phases of a runner step (prepare, forward, LM head, sampling), for batch 1 and a full batch."""
    from torch.profiler import ProfilerActivity, profile

    from servelm.runtime.batch import BatchItem

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
        kernels = gpu_kernel_events(prof)
        total_us = sum(e.device_time_total for e in kernels)
        top = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:12]
        print(
            f"  eager decode forward, batch {batch}: {len(kernels)} GPU kernels, {total_us / 1e3:.2f} ms of kernel time"
        )
        for e in top:
            t = getattr(e, "self_device_time_total", 0)
            if t <= 0:
                continue
            print(f"    {t / 1e3:8.3f} ms  x{e.count:<5} {e.key[:110]}")
        report.row(
            f"eager decode forward, batch {batch}: GPU kernels",
            float(len(kernels)),
            "kernels",
            f"{total_us / 1e3:.2f} ms kernel time",
        )
        if batch == 1 and getattr(runner, "fused_ops", False):
            # The same eager forward without the fused Triton ops (plain torch norms, SiLU, RoPE, store).
            with torch.inference_mode():
                t_fused = timed(lambda: runner.model(inputs.input_ids, inputs.positions, meta), dev, plan.timing_iters)
                with unfused(runner):
                    t_plain = timed(
                        lambda: runner.model(inputs.input_ids, inputs.positions, meta), dev, plan.timing_iters
                    )
            report.row(
                "eager decode forward, batch 1: fused Triton ops vs plain torch",
                t_fused * 1e3,
                "ms fused",
                f"plain {t_plain * 1e3:.2f} ms, x{t_plain / t_fused:.2f}",
                plain_ms=t_plain * 1e3,
            )

        # Phases of runner.execute for the same step (each synchronised, medians).
        ctx = plan.graph_context
        per_seq = -(-ctx // runner.block_size)
        blocks = torch.randperm(runner.kv_pool.num_blocks, generator=torch.Generator().manual_seed(7))[
            : batch * per_seq
        ].tolist()
        ids = torch.randint(3, vocab, (batch, ctx), generator=torch.Generator().manual_seed(8)).tolist()
        params = greedy_params(1, logprobs=None)
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
                logits = runner.sampled_logits(inp, hidden, runner.forward_returns_logits(inp))
                sync(dev)
                t3 = time.perf_counter()
                runner.sampler.sample(logits, [it.seq for it in items])
                t4 = time.perf_counter()
                runner.execute(items)
                t5 = time.perf_counter()
                for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    phases[k].append(dt)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in phases.items()}
        print(
            f"  runner step, batch {batch} (graph={inp.graph}): " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
        )
        report.row(
            f"runner.execute, batch {batch}, context {ctx}",
            med["execute"],
            "ms",
            ", ".join(f"{k} {v:.3f}" for k, v in med.items() if k != "execute") + f" (graph={inp.graph})",
            **{k.replace(" ", "_") + "_ms": v for k, v in med.items()},
        )
        if inp.graph:  # the same forward as a graph replay: what its ~400 kernels leave idle
            with torch.inference_mode():
                timeline_row(report, f"graph replay, batch {batch}", gpu_timeline(lambda: runner.forward(inp), dev))


def copy_bandwidth(n: int, device: torch.device, iters: int) -> float:
    """Bytes per second (read + written) of a device-to-device copy of ``n`` bf16 elements."""
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / timed(lambda: dst.copy_(src), device, iters)


def measure_throughput(
    runner: Any, model_dir: Path, plan: Plan, dtype_name: str, vocab: int, device: torch.device, report: Report
) -> None:
    from servelm.runtime.capacity import flops_per_token
    from servelm.scheduler.engine import Engine

    obs = CountingObserver()
    engine = Engine(
        engine_config(model_dir, device, dtype_name, plan, block_size=runner.block_size),
        obs,
        runner=runner,
    )
    gen = torch.Generator().manual_seed(21)
    mc = runner.model_config

    # Batch 1: decode-only step time against the time to read every weight once.
    floor = runner.weight_bytes / H200_BANDWIDTH * 1e3
    # The bandwidth this card really gives a plain copy (bytes read + written), for a second floor.
    n_copy = (1 << 30) if is_cuda(device) else (1 << 20)
    copy_bw = copy_bandwidth(n_copy, device, plan.timing_iters)
    floor_measured = runner.weight_bytes / copy_bw * 1e3
    report.row(
        "device copy bandwidth (read + write)", copy_bw / 1e12, "TB/s", f"{2 * n_copy * 2 / 1e9:.1f} GB per copy"
    )
    single_prompts = random_prompts(1, plan.single_prompt, vocab, gen)
    concurrent_prompts = random_prompts(plan.concurrent, plan.concurrent_prompt, vocab, gen)
    ms_sync = None
    # Synchronous, then scheduling ahead (step k+1 issued before step k's tokens are read), same engine.
    for ahead in (False, True):
        engine.async_scheduling = ahead
        mode = ", async scheduling" if ahead else ""
        run_requests(engine, random_prompts(1, plan.single_prompt, vocab, gen), 4)  # warm-up
        obs.reset()
        run_requests(engine, single_prompts, plan.single_tokens)
        decode_steps = [s.duration_s for s in obs.steps if s.num_prompt_tokens == 0 and s.num_generation_tokens > 0]
        ms_tok = statistics.median(decode_steps) * 1e3
        report.row(
            f"batch 1{mode}: ms per output token",
            ms_tok,
            "ms",
            f"floor {floor:.2f} ms = weights / 4.8 TB/s; x{ms_tok / floor:.2f}; "
            f"x{ms_tok / floor_measured:.2f} of weights / measured copy bandwidth ({floor_measured:.2f} ms)"
            + (f"; synchronous {ms_sync:.2f} ms" if ms_sync is not None else ""),
            floor_ms=floor,
            floor_measured_ms=floor_measured,
        )
        ms_sync = ms_tok
        timeline_row(report, f"8 engine steps, batch 1{mode}", engine_timeline(engine, single_prompts[0], device))

        # Concurrency: N requests of P -> T at once.
        obs.reset()
        wall = run_requests(engine, concurrent_prompts, plan.concurrent_tokens)
        out_tokens = plan.concurrent * plan.concurrent_tokens
        full = [
            s.duration_s for s in obs.steps if s.num_prompt_tokens == 0 and s.num_generation_tokens == plan.concurrent
        ]
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
            f"{plan.concurrent} concurrent {plan.concurrent_prompt} -> {plan.concurrent_tokens}{mode}: output tok/s",
            out_tokens / wall,
            "tok/s",
            f"{wall:.2f} s wall; full-batch decode step {full_ms:.2f} ms = {plan.concurrent / (full_ms / 1e3):,.0f} tok/s",
            wall_s=wall,
            full_batch_step_ms=full_ms,
        )

    # Scheduling ahead reads each decode's input token from the previous step's device output: the
    # same greedy tokens as the synchronous engine (same batches: every request ends by length).
    sync_vs_ahead = []
    for ahead in (False, True):
        engine.async_scheduling = ahead
        res = engine.generate(concurrent_prompts[:8], greedy_params(32, logprobs=None))
        sync_vs_ahead.append([r.outputs[0].token_ids for r in res])
    same = sum(a == b for a, b in zip(*sync_vs_ahead))
    report.check(
        "async scheduling gives the synchronous engine's tokens", same == 8, f"{same}/8 token-exact, 32 tokens"
    )
    if is_cuda(device):
        # What the overlap rests on: nothing between issuing a step and reading its tokens waits for
        # the device (greedy, with and without logprobs, logit_bias, min_tokens and penalties).
        from servelm.scheduler.sampling_params import SamplingParams

        for label, params in (
            ("greedy", greedy_params(16, logprobs=None)),
            ("greedy + logprobs, logit_bias, min_tokens, penalties", SamplingParams(
                temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5, logit_bias={7: 2.0}, min_tokens=4,
                repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
            )),
        ):  # fmt: skip
            syncs = count_syncs(engine, runner, concurrent_prompts[:8], params)
            report.check(
                f"async scheduling, {label}: no device sync in launch / sample", not syncs, "; ".join(syncs[:3])
            )
    engine.async_scheduling = False

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


def engine_timeline(engine: Any, prompt: list[int], device: torch.device) -> tuple[int, float, float] | None:
    """``gpu_timeline`` of 8 decode steps of one request (after 4 to settle)."""
    if not is_cuda(device):
        return None
    engine.add_request(f"timeline-{time.monotonic_ns()}", prompt, greedy_params(20, logprobs=None))
    for _ in range(4):
        engine.step()
    timeline = gpu_timeline(lambda: [engine.step() for _ in range(8)], device)
    while engine.has_unfinished_requests():
        engine.step()
    return timeline


def is_sync_warning(message: str) -> bool:
    """A warning of sync debug mode about an operation that waited for the device (not the one-off
    notice, on first use, that the mode is a prototype)."""
    return "synchroniz" in message and not message.startswith("Synchronization debug mode is a prototype")


def count_syncs(engine: Any, runner: Any, prompts: list[list[int]], params: Any) -> list[str]:
    """Run the requests to completion with CUDA's sync debug mode on around ``runner.launch`` and
    ``runner.sample``; returns the warnings of the operations that waited for the device there."""
    import warnings

    seen: list[str] = []
    originals = {name: getattr(runner, name) for name in ("launch", "sample")}

    def watched(fn: Any) -> Any:
        def call(*args: Any) -> Any:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    seen.extend(
                        f"{fn.__name__}: {str(w.message)[:120]}" for w in caught if is_sync_warning(str(w.message))
                    )

        return call

    for name, fn in originals.items():
        setattr(runner, name, watched(fn))
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"sync-debug-{time.monotonic_ns()}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        for name in originals:
            delattr(runner, name)  # back to the class's methods
    return seen


def tiles_to_add(results: dict[str, list[tuple[float, Any]]], margin: float = 0.03) -> list[Any]:
    """The sweep's fastest one-row tile of each projection, where it beats the autotuner's tiles (and
    cuBLAS) by more than ``margin``: the tiles a batch-1 rerun should let the autotuner pick."""
    from device_checks.gemv_probe import spec_of, tile_of
    from servelm.runtime.cuda.triton_gemv import ELEMENTWISE_TILES

    tuned = {spec_of(t) for t in ELEMENTWISE_TILES}
    add: list[Any] = []
    for rows in results.values():
        timed_tiles = [(us, t) for us, t in rows if t is not None]
        if not timed_tiles:
            continue
        us, best = min(timed_tiles, key=lambda r: r[0])
        incumbents = [u for u, t in rows if t is None or t in tuned]
        if best in tuned or (incumbents and us > (1 - margin) * min(incumbents)):
            continue
        tile = tile_of(best)
        if tile not in add:
            add.append(tile)
    return add


def batch1_with_tiles(
    tiles: list[Any], model_dir: Path, plan: Plan, dtype_name: str, vocab: int, device: torch.device, report: Report
) -> None:
    """Batch-1 ms per token again, on a fresh engine whose autotuner may also pick ``tiles`` (the
    sweep's winners), so one device run both finds better tiles and measures what they give."""
    from servelm.runtime.cuda import triton_gemv
    from servelm.scheduler.engine import Engine

    if not tiles:
        print("  the sweep found no tile faster than the autotuner's: nothing to rerun")
        return
    saved = list(triton_gemv.ELEMENTWISE_TILES)
    triton_gemv.ELEMENTWISE_TILES[:] = saved + tiles
    triton_gemv._tuned.cache = {}  # tune again, with the added tiles
    try:
        obs = CountingObserver()
        engine = Engine(engine_config(model_dir, device, dtype_name, plan), obs)
        for line in triton_gemv.tuned_tiles():
            print(f"  autotuned: {line}")
        graphs = engine.runner.graph_runner
        for bs, v in sorted(graphs.variants.items() if graphs is not None else []):
            print(f"  decode graph, batch {bs}: {v.describe()}")
        gen = torch.Generator().manual_seed(22)
        run_requests(engine, random_prompts(1, plan.single_prompt, vocab, gen), 4)  # warm-up
        obs.reset()
        run_requests(engine, random_prompts(1, plan.single_prompt, vocab, gen), plan.single_tokens)
        decode = [st.duration_s for st in obs.steps if st.num_prompt_tokens == 0 and st.num_generation_tokens > 0]
        floor = engine.runner.weight_bytes / H200_BANDWIDTH * 1e3
        ms = statistics.median(decode) * 1e3
        mode = "async scheduling" if engine.async_scheduling else "synchronous"
        report.row(
            f"batch 1 ({mode}) with the sweep's tiles added: ms per output token",
            ms,
            "ms",
            f"x{ms / floor:.2f} the floor {floor:.2f} ms; added {', '.join(map(str, tiles))}",
            floor_ms=floor,
        )
        del engine
    finally:
        triton_gemv.ELEMENTWISE_TILES[:] = saved
        triton_gemv._tuned.cache = {}


def sweep_gemv(device: torch.device, report: Report, budget_s: float = 80.0) -> dict[str, list[tuple[float, Any]]]:
    """One-row tiles of the fused few-row kernels, forced one at a time (``device_checks.gemv_probe.sweep``)."""
    from device_checks.gemv_probe import LLAMA3_8B_PROJECTIONS, spec_of, sweep
    from servelm.runtime.cuda.triton_gemv import ELEMENTWISE_TILES

    sizes = {name: n * k * 2 for name, n, k, _ in LLAMA3_8B_PROJECTIONS}
    autotuned = {spec_of(t) for t in ELEMENTWISE_TILES}
    results = sweep(device, budget_s)
    for name, rows in results.items():
        print(
            f"  {name}: "
            + ", ".join(f"{'cuBLAS' if t is None else t} {us:.1f}" for us, t in rows[:8])
            + f" ({len(rows)} timed)"
        )
        if rows:
            us, tile = rows[0]
            tuned = [u for u, t in rows if t is not None and t in autotuned]
            ref = f"{'cuBLAS + unfused op' if tile is None else tile}: {sizes[name] / (us * 1e-6) / 1e12:.2f} TB/s"
            if tuned:
                ref += f"; best autotuner tile {min(tuned):.1f} us"
            report.row(f"{name}, 1 row: fastest tile of the sweep", us, "us", ref, tile=tile)
    return results


def probe_gemv(device: torch.device, report: Report) -> None:
    """The fused few-row projections vs the unfused ops they replace, per shape (``device_checks.gemv_probe``)."""
    from device_checks.gemv_probe import probe

    for r in probe(device):
        report.row(
            f"{r['name']} ({r['op']}), {r['rows']} row(s): fused few-row kernel vs unfused",
            r["fused_us"],
            "us",
            f"{r['fused_tbs']:.2f} TB/s vs {r['plain_tbs']:.2f} TB/s ({r['plain_us']:.1f} us), "
            f"x{r['plain_us'] / r['fused_us']:.2f}; outputs differ by {r['rel_diff']:.1e}"
            + ("" if r.get("pdl_us") is None else f"; with PDL {r['pdl_us']:.1f} us"),
            plain_us=r["plain_us"],
            pdl_us=r.get("pdl_us"),
            fused_tbs=r["fused_tbs"],
            plain_tbs=r["plain_tbs"],
        )
