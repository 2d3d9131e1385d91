#!/usr/bin/env python3
"""One GPU check of servelm's CUDA path, sized to finish in well under 8 minutes on one H200.

It needs only torch, triton, transformers (+ tokenizers, safetensors) and this repo's ``runtime``,
``scheduler`` and ``metrics`` packages: no network, no fastapi/uvicorn/pydantic.

1. A Llama-3-8B-shaped model (32 layers, hidden 4096, 32/8 heads, intermediate 14336, vocab 128256,
   rope_theta 500000) with random bf16 weights is built on the device with transformers and saved,
   with a word-level tokenizer over its vocabulary, to a scratch folder; servelm loads that folder.
2. Exactness, in float32 (HF's model upcast is the reference): our prefill logits, 32 greedy tokens
   per prompt batched through ``Engine.generate`` against HF ``generate`` (a divergence is excused
   only at a near-tie of HF's own logits), our logprobs, and prefix-cached, chunked-prefill and
   preempted runs against the baseline's tokens.
3. bf16: our logits' distance from the float32 reference next to HF bf16's own distance.
4. CUDA graphs: ``runtime.cuda.graphs.CudaGraphRunner`` replays equal eager decode steps; timings.
5. Profile: kernels per decode forward, the costliest ones, host phases of a runner step, fused vs
   plain ops.
6. Throughput: ms per output token at batch 1 vs the weight-read floor, output tok/s for 256
   concurrent 128 -> 128 requests, one 8k-token prefill vs a measured bf16 matmul rate.
7. Probe: a Triton GEMV against cuBLAS on the projection shapes (an experiment; the engine uses cuBLAS).
8. Start-up as ``servelm serve`` does it: the KV pool sized from GPU memory, the runner's own graphs.

The parts live in ``scripts/device_checks/`` (common, correctness, performance); this file runs them
in order and prints the summary. ``--dry-run --device cpu --tiny`` runs the same plumbing with a tiny model and toy sizes on CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import checkout

REPO = checkout.use_checkout()

import torch  # noqa: E402
from device_checks.common import (  # noqa: E402  (scripts/ is on sys.path: this file's folder)
    LLAMA3_8B,
    SERVER_ONLY,
    TINY,
    GiB,
    Plan,
    Report,
    build_hf_model,
    engine_config,
    free_memory,
    is_cuda,
    random_prompts,
    save_model_folder,
)
from device_checks.correctness import (  # noqa: E402
    check_cuda_graphs,
    check_few_row_kernels,
    check_greedy_vs_hf,
    check_logits_bf16,
    check_logits_exact,
    check_measured_budget,
    check_paging_variants,
    hf_logits,
)
from device_checks.performance import (  # noqa: E402
    batch1_with_tiles,
    measure_throughput,
    probe_gemv,
    profile_decode,
    sweep_gemv,
    tiles_to_add,
)

from servelm.runtime.platform import platform_of  # noqa: E402

# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda (the real check) or cpu (plumbing only)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the Llama-3-8B shape")
    p.add_argument("--dry-run", action="store_true", help="toy workload sizes (plumbing check)")
    p.add_argument(
        "--workdir", type=Path, default=None, help="scratch folder for the saved model (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the saved model folder")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=[
            "exact",
            "logits",
            "greedy",
            "paging",
            "graphs",
            "profile",
            "throughput",
            "gemv",
            "sweep",
            "budget",
            "rerun",
        ],
        help="skip a section (repeatable); exact: the whole float32 engine (its load and checks) of a bf16/fp16 run",
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
    if is_cuda(device):
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
    if is_cuda(device) and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu --tiny --dry-run for the plumbing check", file=sys.stderr)
        return 2
    if is_cuda(device) and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not is_cuda(device) and args.tiny:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and they thrash on a busy machine
    dtype_name = args.dtype or str(platform_of(device).default_dtype).removeprefix("torch.")
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
            save_model_folder(model, model_dir)
            params = sum(p.numel() for p in model.parameters())
            print(
                f"  HF model: {params / 1e9:.2f} B params, built in {t1 - t0:.1f} s, saved in {time.perf_counter() - t1:.1f} s"
            )
            return model

        hf = section("build a random-weight model (transformers) and save it", report, build)
        if hf is None:
            return finish(report, args, started)

        def load(name: str, **over: Any) -> Any:
            from servelm.scheduler.engine import Engine

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
        tol = 1e-3
        if "exact" in args.skip and low:
            print("\n== float32 engine and its checks: skipped (--skip exact)")
        else:
            exact = section(
                "load it into servelm in float32 (Engine)",
                report,
                lambda: load("float32", kv_cache_memory=plan.exact_kv_bytes),
            )
            if exact is None:
                return finish(report, args, started)
            if "logits" not in args.skip:
                tol = (
                    section(
                        "float32 prefill logits vs HF",
                        report,
                        lambda: check_logits_exact(exact.runner, ref, prompts, report),
                    )
                    or tol
                )
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
        if exact is not None and "paging" not in args.skip:
            section(
                "float32 paged / prefix-cached / chunked / preempted runs",
                report,
                lambda: check_paging_variants(exact, exact.runner, model_dir, plan, "float32", vocab, tol, report),
            )
        if exact is not None and "graphs" not in args.skip and is_cuda(device):
            section(
                "float32 fused few-row projections (runtime.cuda.triton_gemv)",
                report,
                lambda: check_few_row_kernels(exact.runner, plan, vocab, tol, report),
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
        ref = hf_low = None
        runner = engine.runner
        if "graphs" not in args.skip:
            if is_cuda(device):
                section(
                    "CUDA graphs (runtime.cuda.graphs)",
                    report,
                    lambda: check_cuda_graphs(runner, plan, vocab, tol, report),
                )
                section(
                    f"{dtype_name} fused few-row projections (runtime.cuda.triton_gemv)",
                    report,
                    lambda: check_few_row_kernels(runner, plan, vocab, tol, report),
                )
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
        if "gemv" not in args.skip and is_cuda(device):
            section(
                "fused few-row projections vs the unfused ops (runtime.cuda.triton_gemv)",
                report,
                lambda: probe_gemv(device, report),
            )
        swept = None
        if "sweep" not in args.skip and is_cuda(device):
            swept = section(
                "one-row tiles of the fused projections (a sweep)", report, lambda: sweep_gemv(device, report)
            )
        if "budget" not in args.skip and is_cuda(device):
            del runner, engine
            engine = runner = None
            free_memory(device)
            section(
                "KV pool sized from GPU memory (kv_cache_memory unset) + the runner's own graphs",
                report,
                lambda: check_measured_budget(model_dir, plan, dtype_name, vocab, device, report),
            )
        if swept and "rerun" not in args.skip:
            engine = runner = None
            free_memory(device)
            section(
                "batch 1 again, the autotuner also offered the sweep's winning tiles",
                report,
                lambda: batch1_with_tiles(tiles_to_add(swept), model_dir, plan, dtype_name, vocab, device, report),
            )
        return finish(report, args, started)
    finally:
        hf = engine = exact = None  # nothing else holds them: their memory can go
        free_memory(device)
        if not args.keep:
            shutil.rmtree(workdir if args.workdir is None else model_dir, ignore_errors=True)


def finish(report: Report, args: argparse.Namespace, started: float) -> int:
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in SERVER_ONLY)
    report.check(
        "imports nothing the GPU machine lacks", not leaked, ", ".join(leaked) or "none of " + ", ".join(SERVER_ONLY)
    )
    elapsed = time.perf_counter() - started
    print(f"\n== summary ({elapsed:.0f} s)")
    for r in report.throughput:
        print(f"  {r['name']:<72} {r['value']:>12,.2f} {r['unit']:<8} {r['reference']}")
    failed = [c["name"] for c in report.checks if not c["ok"]]
    print(
        f"  checks: {len(report.checks) - len(failed)}/{len(report.checks)} passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({**asdict(report), "elapsed_s": elapsed, "ok": report.ok}, indent=2, default=str)
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
