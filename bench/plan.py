"""``servelm plan``: what a model costs on a device, from its config alone (no weights loaded).

Prints weight bytes, KV bytes per token and per request, how many KV blocks the memory left after
the weights buys, how many requests of the context length fit at once, and roofline lower bounds:
prefill time for one context-length prompt (FLOPs / peak) and time per output token at batch 1
and at ``--batch`` (bytes moved per decode step / bandwidth, or FLOPs / peak if that is larger).
These are bounds: activations, CUDA graphs and allocator slack are not subtracted from memory.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from servelm.runtime.capacity import DEVICE_PRESETS, CapacityError, dtype_bytes, flops_per_token, plan_capacity
from servelm.runtime.config import ModelConfig, UnsupportedModelError

# Hugging Face config.json fields of well-known shapes, so plans need no download.
_LLAMA2 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
PRESET_MODELS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _LLAMA2 | {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32},
    "llama-2-13b": _LLAMA2 | {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40},
    "llama-2-70b": _LLAMA2
    | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama-3-8b": _LLAMA3
    | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-3-70b": _LLAMA3
    | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
}  # fmt: skip

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """``24GiB`` / ``80GB`` / ``512 MiB`` / ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 24GiB, 80GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def load_model_config(model: str | None, preset: str | None) -> tuple[str, ModelConfig]:
    """(display name, config) from ``--preset-model`` or ``--model`` (an HF folder or a config.json)."""
    if preset:
        return preset, ModelConfig.from_hf_dict(PRESET_MODELS[preset])
    if not model:
        raise UnsupportedModelError("give --model (an HF folder or config.json) or --preset-model")
    p = Path(model).expanduser()
    if p.is_file():
        return p.parent.name, ModelConfig.from_hf_dict(json.loads(p.read_text()))
    return p.name, ModelConfig.from_dir(p)


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """FLOPs of one causal prefill: every position through the layers, the LM head on the last only."""
    lm_head = cfg.vocab_size * cfg.hidden_size
    per_token_no_attn = flops_per_token(cfg, 0) - 2.0 * lm_head
    attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len * (prompt_len + 1) / 2
    return per_token_no_attn * prompt_len + 2.0 * lm_head + attn


@dataclass
class DecodeBound:
    batch: int
    bytes_per_step: float
    flops_per_step: float
    seconds_per_token: float  # the larger of the memory and the compute bound
    bound_by: str  # "memory" | "compute" | "n/a"
    tokens_per_s: float  # batch / seconds_per_token


@dataclass
class Plan:
    model: str
    architecture: str
    num_params: int
    dtype: str
    device: str
    memory_bytes: int
    gpu_memory_utilization: float
    bandwidth_bytes_s: float | None
    peak_flops: float | None
    weight_bytes: int
    kv_bytes_per_token: int
    context_len: int
    kv_bytes_per_request: int
    kv_budget_bytes: int
    kv_budget_given: bool  # --kv-cache-memory, rather than what the weights leave
    block_size: int
    num_blocks: int
    max_concurrent_requests: int
    prefill_flops: float
    prefill_seconds: float | None
    decode: list[DecodeBound]


def make_plan(args: argparse.Namespace) -> Plan:
    name, cfg = load_model_config(args.model, args.preset_model)
    preset = DEVICE_PRESETS[args.device] if args.device else None
    if preset is None and args.memory is None:
        preset = DEVICE_PRESETS["cpu"]
    device = preset.name if preset else "custom"
    memory = args.memory if args.memory is not None else (preset or DEVICE_PRESETS["cpu"]).memory_bytes
    bandwidth = args.bandwidth or (preset.bandwidth_bytes_s if preset else None)
    peak = args.peak_flops or (preset.peak_flops if preset else None)
    dtype_name = args.dtype if args.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    dtype = DTYPES[dtype_name]
    ctx = args.context_len or cfg.max_position_embeddings

    usable = int(memory * args.gpu_memory_utilization)
    w_bytes = cfg.num_params * dtype_bytes(dtype)
    budget = args.kv_cache_memory if args.kv_cache_memory is not None else max(0, usable - w_bytes)
    try:
        cap = plan_capacity(cfg, dtype, budget, args.block_size, ctx)
        per_tok, num_blocks, fit = cap.kv_bytes_per_token, cap.num_blocks, cap.max_len_requests
    except CapacityError:
        per_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)
        num_blocks = int(budget // (per_tok * args.block_size))
        fit = 0

    pf = prefill_flops(cfg, ctx)
    prefill_s = None
    if peak:
        prefill_s = pf / peak
        if bandwidth:  # the weights are read at least once even for a short prompt
            prefill_s = max(prefill_s, w_bytes / bandwidth)

    decode = []
    for b in sorted({1, args.batch}):
        moved = w_bytes + b * ctx * per_tok  # every weight once, every request's KV once
        flops = b * flops_per_token(cfg, ctx)
        mem_s = moved / bandwidth if bandwidth else None
        cmp_s = flops / peak if peak else None
        if mem_s is None and cmp_s is None:
            decode.append(DecodeBound(b, moved, flops, float("nan"), "n/a", float("nan")))
            continue
        s, by = max((x, n) for x, n in ((mem_s, "memory"), (cmp_s, "compute")) if x is not None)
        decode.append(DecodeBound(b, moved, flops, s, by, b / s))

    return Plan(
        model=name,
        architecture=cfg.architecture,
        num_params=cfg.num_params,
        dtype=dtype_name,
        device=device,
        memory_bytes=memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        bandwidth_bytes_s=bandwidth,
        peak_flops=peak,
        weight_bytes=w_bytes,
        kv_bytes_per_token=per_tok,
        context_len=ctx,
        kv_bytes_per_request=ctx * per_tok,
        kv_budget_bytes=budget,
        kv_budget_given=args.kv_cache_memory is not None,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_concurrent_requests=fit,
        prefill_flops=pf,
        prefill_seconds=prefill_s,
        decode=decode,
    )


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float | None) -> str:
    if s is None or s != s:
        return "n/a (give --device, or --bandwidth and --peak-flops)"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _rate(x: float, unit: str) -> str:
    return f"{x / 1e12:.2f} T{unit}/s" if x >= 1e12 else f"{x / 1e9:.1f} G{unit}/s"


def format_plan(p: Plan) -> str:
    kv_tok = p.kv_bytes_per_token / 1024
    lines = [
        f"model            {p.model} ({p.architecture}), {p.num_params / 1e9:.2f} B parameters, {p.dtype}",
        f"device           {p.device}: {_bytes(p.memory_bytes)} ({p.memory_bytes / 1e9:.1f} GB)"
        + (f", {_rate(p.bandwidth_bytes_s, 'B')}" if p.bandwidth_bytes_s else "")
        + (f", {_rate(p.peak_flops, 'FLOP')}" if p.peak_flops else ""),
        f"weights          {_bytes(p.weight_bytes)}",
        f"KV per token     {kv_tok:.1f} KiB ({p.kv_bytes_per_token} bytes)",
        f"KV per request   {_bytes(p.kv_bytes_per_request)} for {p.context_len} tokens",
        f"KV pool          {_bytes(p.kv_budget_bytes)} "
        + ("(--kv-cache-memory)" if p.kv_budget_given else f"(memory x {p.gpu_memory_utilization:g} - weights)"),
        f"blocks           {p.num_blocks} x {p.block_size} tokens = {p.num_blocks * p.block_size} tokens",
        f"max concurrent   {p.max_concurrent_requests} requests of {p.context_len} tokens",
        f"prefill >=       {_seconds(p.prefill_seconds)} for one {p.context_len}-token prompt "
        f"({p.prefill_flops / 1e12:.2f} TFLOP)",
    ]
    for d in p.decode:
        note = ""
        if d.batch > p.max_concurrent_requests:
            note = f"; only {p.max_concurrent_requests} fit"
        if d.bound_by == "n/a":
            lines.append(f"decode >=        batch {d.batch}: {_seconds(None)}")
            continue
        lines.append(
            f"decode >=        batch {d.batch}: {_seconds(d.seconds_per_token)} per output token ({d.bound_by}-bound: "
            f"{_bytes(d.bytes_per_step)} read per step), <= {d.tokens_per_s:,.0f} tok/s at {p.context_len} tokens of "
            f"context{note}"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", help="a Hugging Face model folder or its config.json")
    m.add_argument("--preset-model", choices=sorted(PRESET_MODELS), help="a well-known shape")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: float32 on cpu, else bfloat16")
    p.add_argument("--device", choices=sorted(DEVICE_PRESETS), default=None, help="default: cpu unless --memory")
    p.add_argument("--memory", type=parse_size, default=None, help="device memory, e.g. 24GiB (overrides the preset)")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s (overrides the preset)")
    p.add_argument("--peak-flops", type=float, default=None, help="FLOP/s (overrides the preset)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of memory for weights + KV")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV pool size (instead of the fraction)")
    p.add_argument("--context-len", type=int, default=None, help="tokens per request (default: the model's max)")
    p.add_argument("--batch", type=int, default=32, help="concurrent requests for the decode bound")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on a CLI's subparsers (``servelm plan``); sets ``func=run``."""
    p = subparsers.add_parser(
        "plan", help="memory and roofline plan for a model on a device", description=__doc__.split("\n\n")[0]
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 when at least one request of the context length fits, 1 when none does."""
    try:
        plan = make_plan(args)
    except (UnsupportedModelError, OSError, ValueError, KeyError) as e:
        print(f"servelm plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(plan), indent=2, default=lambda x: None))
    else:
        print(format_plan(plan))
    if plan.max_concurrent_requests < 1:
        print(
            f"servelm plan: not even one {plan.context_len}-token request fits: the weights take "
            f"{_bytes(plan.weight_bytes)} of {_bytes(plan.memory_bytes * plan.gpu_memory_utilization)}",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="servelm plan", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
