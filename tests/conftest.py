"""Shared fixtures: tiny random Llama-family models on disk, the default model, and a runner builder; and
the hooks that split the suite into its two tiers (tests/tiers.py).

The tiny models use the default model's vocabulary size so its tokenizer files can sit beside them
(the folder is then a complete servable model). Seeds are fixed: the same weights every run.
"""

from __future__ import annotations

import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiers import FirstTierClock, ServerGuard, mark_second_tier

from servelm.runtime.batch import SamplingOptions
from servelm.runtime.config import ModelConfig
from servelm.runtime.model_fetch import ensure_gemma3_gguf, ensure_qwen05_gguf
from servelm.runtime.model_files import ensure_default_model

# ---- the two tiers (tests/tiers.py, docs/testing.md) -------------------------------------------------

SERVER_GUARD = ServerGuard()
FIRST_TIER_CLOCK = FirstTierClock()


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(SERVER_GUARD)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_second_tier(items)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start anything
def pytest_runtest_setup(item: pytest.Item) -> None:
    SERVER_GUARD.enter(item)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    FIRST_TIER_CLOCK.add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    FIRST_TIER_CLOCK.summary(terminalreporter.write_line)


# ---- models -------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# Shapes shared by every tiny variant: big enough for GQA (4 heads over 2 KV heads) and several layers.
TINY_SHAPES: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # Larger than HF's 0.02 so attention is far from uniform and the logits spread: a comparison
    # against HF then actually exercises positions, masking and the cache.
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama_untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                # Small, so the wavelengths of a 16-wide head land in all three llama3 bands.
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # For tests run by Triton's interpreter, which executes each program of a launch in Python: a
    # 49,152-row head costs ~70 s a one-row launch there, this one ~1/100 of it. Its ids stop at 511
    # (the default tokenizer is not copied beside it).
    "llama_small_vocab": ("LlamaConfig", dict(tie_word_embeddings=True, vocab_size=512)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    # Sliding windows of 16 tokens: on every layer (Mistral v0.1 style), and on layers 1 and 2 only.
    "mistral_window": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=16)),
    # Gemma 3 text: layers 0 and 2 local (16-token window, RoPE theta 10k), layer 1 global (theta 1M);
    # query_pre_attn_scalar unlike head_dim, so the score scale is its own.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            tie_word_embeddings=True,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            max_position_embeddings=512,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        ),
    ),
    "qwen2_window": (
        "Qwen2Config",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    # RoPE on layers 0 and 2, none on layer 1 (a NoPE layer every 2nd; the real model: every 4th).
    "smollm3": ("SmolLM3Config", dict(tie_word_embeddings=True, no_rope_layer_interval=2, rope_theta=2000000.0)),
    # Granite 3's multipliers (granite-3.1-2b-instruct's values).
    "granite": (
        "GraniteConfig",
        dict(
            tie_word_embeddings=True,
            embedding_multiplier=12.0,
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            logits_scaling=8.0,
        ),
    ),
}


def hf_model_class(config_cls_name: str) -> type:
    import transformers

    if config_cls_name == "Gemma3TextConfig":
        return transformers.Gemma3ForCausalLM
    return getattr(transformers, config_cls_name.replace("Config", "ForCausalLM"))


def save_tiny_model(variant: str, out: Path, *, max_shard_size: str | None = None) -> Path:
    """Build a random HF model of ``variant`` (fixed seed), save it (float32) with the default tokenizer
    (when the variant keeps the tokenizer's vocabulary size)."""
    import transformers

    cfg_name, extra = TINY_VARIANTS[variant]
    cfg = getattr(transformers, cfg_name)(**{**TINY_SHAPES, **extra})
    torch.manual_seed(1234)
    model = hf_model_class(cfg_name)(cfg).to(torch.float32).eval()
    # HF initialises norms to 1 and biases to 0; perturb them so the norm and bias paths are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    if cfg.vocab_size != TINY_SHAPES["vocab_size"]:
        return out
    src = ensure_default_model()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a float32 HF folder."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M (base) as its Q4_K_M GGUF file, stored as shipped (`make test`'s set-up prepares it)."""
    return ensure_gemma3_gguf()


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct as its Q4_K_M GGUF file, stored as shipped (`make model` prepares it)."""
    return ensure_qwen05_gguf()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model_dir(variant)`` -> folder of a tiny random model (one of ``TINY_VARIANTS``), built once."""
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = save_tiny_model(variant, tmp_path_factory.mktemp(f"tiny-{variant}"))
        return built[variant]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    """A tiny random Llama (tied embeddings) with the default model's tokenizer beside it."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_llama_untied_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama_untied")


# ---- driving a ModelRunner without the scheduler ---------------------------------------------------


@dataclass
class GreedySpec(SamplingOptions):
    """A ``runtime.batch.SamplingSpec`` for greedy decoding with nothing else switched on."""

    temperature: float = 0.0


@dataclass
class FakeSeq:
    """A ``runtime.batch.SequenceView`` the tests advance by hand."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    params: GreedySpec = field(default_factory=GreedySpec)
    generator: torch.Generator | None = None
    stop_token_ids_for_min_tokens: tuple[int, ...] = ()
    grammar: Any = None  # runtime.batch.TokenMask
    lora_id: int = 0

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)


class ScatteredBlocks:
    """Hands out pool blocks in a shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free_ids = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_ids)

    def grow(self, seq: FakeSeq, num_tokens: int) -> None:
        """Make ``seq``'s block table hold at least ``num_tokens`` tokens."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self.free_ids.pop())

    def release(self, seq: FakeSeq) -> None:
        self.free_ids.extend(seq.block_table)
        seq.block_table = []


def step_logits(runner: Any, items: list[Any]) -> list[torch.Tensor]:
    """Run one step of ``runner`` over ``items`` (``BatchItem``s) and return, per item in item order,
    the float32 logits of every new token; then advance each item's ``num_computed_tokens``."""
    with torch.inference_mode():
        inputs = runner.prepare(items)
        logits = runner.model.compute_logits(runner.forward(inputs)).float()
    out: list[torch.Tensor] = [torch.empty(0)] * len(items)
    row = 0
    for idx in inputs.order:
        n = items[idx].num_new_tokens
        out[idx] = logits[row : row + n]
        row += n
    for it in items:
        it.seq.num_computed_tokens += it.num_new_tokens
    return out


def prefill_then_decode(runner: Any, lengths: list[int], decode_steps: list[list[int]]) -> torch.Tensor:
    """Sequences of the first ``lengths`` tokens of a fixed prompt, on scattered blocks: one prefill
    step of all but their last ``len(decode_steps)`` tokens, then one decode step per entry of
    ``decode_steps`` (the sequences it holds). Every step's logits, concatenated."""
    from servelm.runtime.batch import BatchItem

    vocab = runner.model_config.vocab_size
    ids = [i % vocab for i in (5, 900, 17, 4000, 33, 2, 77, 1200, 8, 64, 19, 300, 41)]
    blocks = ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=2)
    seqs = [FakeSeq(seq_id=i, token_ids=list(ids[:n])) for i, n in enumerate(lengths)]
    for seq in seqs:
        blocks.grow(seq, len(ids))
    held = len(decode_steps)
    logits = step_logits(runner, [BatchItem(s, len(s.token_ids) - held, sample=False) for s in seqs])
    for step in decode_steps:
        logits += step_logits(runner, [BatchItem(seqs[i], 1, sample=True) for i in step])
    return torch.cat(logits)


@pytest.fixture
def rt() -> SimpleNamespace:
    """Helpers to feed a ModelRunner by hand: ``FakeSeq``, ``GreedySpec``, ``ScatteredBlocks``, ``step_logits``,
    ``prefill_then_decode``."""
    return SimpleNamespace(
        FakeSeq=FakeSeq,
        GreedySpec=GreedySpec,
        ScatteredBlocks=ScatteredBlocks,
        step_logits=step_logits,
        prefill_then_decode=prefill_then_decode,
    )


@pytest.fixture(scope="session")
def build_runner() -> Callable[..., Any]:
    """``build_runner(model_dir, **overrides)`` -> a CPU float32 ``ModelRunner`` with a small pool."""
    from servelm.runtime.runner import ModelRunner

    def build(model_dir: Path, **overrides: Any) -> ModelRunner:
        kwargs: dict[str, Any] = dict(
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=16,
            num_blocks=256,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
        )
        kwargs.update(overrides)
        return ModelRunner(Path(model_dir), ModelConfig.from_dir(model_dir), **kwargs)

    return build
