"""What every part of the device check shares: workload sizes, the report, stand-ins for the
scheduler's views, timing helpers, the random-weight HF model and its tokenizer, engine settings."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from servelm.runtime.platform import platform_of

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
    def dry(cls) -> Plan:
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
        self.__init__()


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
    grammar: Any = None  # runtime.batch.TokenMask


# ----------------------------------------------------------------------------- helpers


def is_cuda(device: torch.device) -> bool:
    """Whether the check runs on a GPU: what it times, sizes or skips depends on it."""
    return platform_of(device).name == "cuda"


def sync(device: torch.device) -> None:
    platform_of(device).synchronize(device)


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
    platform_of(device).release_cached_memory()


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
            bad.append(f"prompt {i} step {d} (gap {gap:.3g}): ref {r[d : d + 4]} got {g[d : d + 4]}")
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


def save_model_folder(model: Any, folder: Path) -> None:
    """``model`` and a word-level tokenizer over its vocabulary, as a folder servelm (and HF) load."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    build_tokenizer(int(model.config.vocab_size)).save_pretrained(str(folder))


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


def greedy_params(n: int, logprobs: int = 2) -> Any:
    from servelm.scheduler.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def decode_inputs(runner: Any, batch: int, context: int, vocab: int, seed: int) -> Any:
    """A fabricated decode step: ``batch`` sequences with ``context`` tokens on scattered blocks."""
    from servelm.runtime.batch import BatchItem
    from servelm.scheduler.sampling_params import SamplingParams

    bs = runner.block_size
    per_seq = -(-context // bs)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(runner.kv_pool.num_blocks, generator=gen)[: batch * per_seq].tolist()
    ids = torch.randint(3, vocab, (batch, context), generator=gen).tolist()
    params = SamplingParams(temperature=0.0)
    items = [
        BatchItem(
            SeqView(i, ids[i], context - 1, context - 1, blocks[i * per_seq : (i + 1) * per_seq], params), 1, True
        )
        for i in range(batch)
    ]
    return runner.prepare(items)


def engine_config(model_dir: Path, device: torch.device, dtype_name: str, plan: Plan, **over: Any) -> Any:
    """The check's engine settings (the plan's lengths and batch limits, its KV bytes, no prefix
    caching); ``over`` replaces any of them."""
    from servelm.scheduler.config import EngineConfig

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


def run_requests(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Add every request at once and step until all finish; returns wall seconds."""
    params = greedy_params(max_tokens, logprobs=None)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"tp-{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0
