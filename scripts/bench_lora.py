"""What LoRA adapters cost a decode step: the default model, every request with an adapter on every
projection, against the same requests on the base model.

    .venv/bin/python scripts/bench_lora.py [--batches 1 4 16 32] [--rank 16] [--rounds 3] [--tokens 48]
                                           [--quantization auto] [--num-threads 2] [--adapters DIR ...]

Workloads per batch size B (B requests decoding together, 64-token prompts, ignore_eos):
  off      an engine without --enable-lora (the reference);
  base     an engine with adapters loaded, every request on the base model (what LoRA costs when unused);
  1        every request on one adapter;
  2, 4     requests spread over 2 or 4 adapters (mixed steps: each adapter's rows gathered and added back);
  half     half the requests on the base model, half on one adapter.
Printed: the median duration of the decode-only steps (the engine's own step timer) per round, the
median over rounds, and the ratio to ``off``. Adapters are written with random weights in PEFT's
format unless ``--adapters`` names folders. Rounds alternate the workloads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # checkout.py, also when imported as a module
import checkout

checkout.use_checkout()

from servelm.runtime.config import ModelConfig  # noqa: E402
from servelm.runtime.model_files import ensure_default_model  # noqa: E402
from servelm.scheduler.config import EngineConfig  # noqa: E402
from servelm.scheduler.engine import Engine  # noqa: E402
from servelm.scheduler.sampling_params import SamplingParams  # noqa: E402

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA on every projection, random A and B."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    tensors = {}
    for layer in range(cfg.num_layers):
        for block, names in TARGETS.items():
            for name in names:
                din, dout = shapes[name]
                pre = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{pre}.lora_A.weight"] = 0.05 * torch.randn(rank, din, generator=g)
                tensors[f"{pre}.lora_B.weight"] = 0.05 * torch.randn(dout, rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [n for ns in TARGETS.values() for n in ns],
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


class StepTimes:
    def __init__(self) -> None:
        self.decode: list[float] = []

    def on_step(self, s: Any) -> None:
        if s.num_prompt_tokens == 0 and s.num_generation_tokens:
            self.decode.append(s.duration_s)

    def on_request_finished(self, s: Any) -> None:
        pass

    def on_request_rejected(self) -> None:
        pass


def run(engine: Engine, times: StepTimes, batch: int, names: list[str | None], tokens: int) -> float:
    prompts = [[(17 * r + 29 * k) % 40000 + 100 for k in range(64)] for r in range(batch)]
    loras = [names[r % len(names)] for r in range(batch)]
    times.decode.clear()
    engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), lora_names=loras)
    return statistics.median(times.decode[2:])  # the first steps find cold caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--adapters", nargs="*", default=None, help="4 adapter folders (default: random ones)")
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cfg = ModelConfig.from_dir(ensure_default_model())
    tmp = tempfile.TemporaryDirectory()
    folders = (
        [Path(p) for p in args.adapters]
        if args.adapters
        else [write_adapter(Path(tmp.name) / f"a{k}", cfg, args.rank, k) for k in range(4)]
    )
    common = dict(
        kv_cache_memory=512 * 2**20, max_model_len=1024, max_num_seqs=max(args.batches), quantization=args.quantization
    )
    plain_times, lora_times = StepTimes(), StepTimes()
    plain = Engine(EngineConfig(**common), observer=plain_times)
    lora = Engine(
        EngineConfig(
            **common,
            max_loras=4,
            max_lora_rank=max(args.rank, 64),
            lora_modules=tuple((f"a{k}", str(f)) for k, f in enumerate(folders)),
        ),
        observer=lora_times,
    )
    workloads: dict[str, tuple[Engine, StepTimes, list[str | None]]] = {
        "off": (plain, plain_times, [None]),
        "base": (lora, lora_times, [None]),
        "1": (lora, lora_times, ["a0"]),
        "2": (lora, lora_times, ["a0", "a1"]),
        "4": (lora, lora_times, ["a0", "a1", "a2", "a3"]),
        "half": (lora, lora_times, [None, "a0"]),
    }
    print(
        f"default model, quantization {lora.runner.quantization or 'none'}, rank {args.rank} on every projection, "
        f"{torch.get_num_threads()} threads; decode step median (ms) per round"
    )
    for batch in args.batches:
        # A batch smaller than a workload's mix would repeat another workload.
        runs = {w: v for w, v in workloads.items() if len(v[2]) <= batch}
        got: dict[str, list[float]] = {w: [] for w in runs}
        for _ in range(args.rounds):
            for w, (engine, times, names) in runs.items():
                got[w].append(1e3 * run(engine, times, batch, names, args.tokens))
        off = statistics.median(got["off"])
        for w, vals in got.items():
            med = statistics.median(vals)
            print(
                f"batch {batch:3d}  {w:>4}: {med:7.2f} ms  ({med / off:4.2f}x off)  rounds: {', '.join(f'{v:.2f}' for v in vals)}"
            )
    tmp.cleanup()


if __name__ == "__main__":
    main()
