"""Our model through the paged pool equals Hugging Face transformers' logits, however the prompt is fed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from servelm.runtime.batch import BatchItem
from servelm.runtime.cpu.torch_backend import TorchAttentionBackend
from servelm.runtime.runner import ModelRunner

# How a prompt is fed: one prefill, chunks of 5 tokens, or one token per step (decode path).
MODES = {"prefill": None, "chunks5": 5, "decode": 1}


def feed(runner: ModelRunner, rt: SimpleNamespace, ids: list[int], chunk: int | None, seed: int = 0) -> torch.Tensor:
    """Feed ``ids`` as one sequence in chunks of ``chunk`` tokens over scattered blocks: all logits ``[len, V]``."""
    blocks = rt.ScatteredBlocks(runner.kv_pool.num_blocks, runner.block_size, seed=seed)
    seq = rt.FakeSeq(seq_id=0, token_ids=list(ids))
    blocks.grow(seq, len(ids))
    assert seq.block_table != sorted(seq.block_table)  # really scattered
    chunk = chunk or len(ids)
    parts = []
    while seq.num_computed_tokens < len(ids):
        n = min(chunk, len(ids) - seq.num_computed_tokens)
        parts.append(rt.step_logits(runner, [BatchItem(seq, n, sample=False)])[0])
    return torch.cat(parts)


_HF_LOGITS: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    key = (str(model_dir), tuple(ids))
    if key not in _HF_LOGITS:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            _HF_LOGITS[key] = hf(torch.tensor([ids])).logits[0].float()
    return _HF_LOGITS[key]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "variant",
    [
        "llama",
        "llama_untied",
        "qwen2",
        "qwen3",
        "llama3_rope",
        "mistral",
        "smollm3",
        "granite",
        "mistral_window",
        "qwen2_window",
        "gemma3",
    ],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_models_match_hf(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Callable[..., ModelRunner],
    rt: SimpleNamespace,
    variant: str,
    mode: str,
) -> None:
    model_dir = tiny_model_dir(variant)
    # 70 tokens over 16-token blocks: several blocks, the last one partly filled.
    ids = random_ids(70, seed=len(variant))
    ref = hf_logits(model_dir, ids)
    runner = build_runner(model_dir, num_blocks=64)
    ours = feed(runner, rt, ids, MODES[mode], seed=3)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # The test model is not degenerate: its predictions vary along the prompt.
    assert len(set(ref.argmax(-1).tolist())) > 10


@pytest.mark.parametrize("mode", ["chunks5", "decode"])
def test_torch_decode_fallback_matches_hf(
    tiny_llama_dir: Path, build_runner: Callable[..., ModelRunner], rt: SimpleNamespace, mode: str
) -> None:
    """The same with the C++ decode kernel switched off (the path taken where it cannot be built)."""
    ids = random_ids(70, seed=0)
    runner = build_runner(tiny_llama_dir, num_blocks=64, backend=TorchAttentionBackend(16, use_kernel=False))
    assert runner.backend.name == "torch"
    torch.testing.assert_close(
        feed(runner, rt, ids, MODES[mode], seed=4), hf_logits(tiny_llama_dir, ids), atol=1e-4, rtol=0
    )


def test_llama3_rope_scaling_is_applied(tiny_model_dir: Callable[[str], Path], build_runner: Any, rt: Any) -> None:
    """The llama3 variant really takes the scaled path (same weights with default RoPE would differ)."""
    from servelm.runtime.models.layers import rope_inv_freq

    runner = build_runner(tiny_model_dir("llama3_rope"), num_blocks=16)
    cfg = runner.model_config
    plain = rope_inv_freq(type(cfg)(**{**cfg.__dict__, "rope_scaling": None}))
    scaled = rope_inv_freq(cfg)
    assert scaled[0] == plain[0]  # highest frequency untouched
    assert torch.isclose(scaled[-1], plain[-1] / 8)  # lowest divided by factor
    assert ((scaled != plain) & (scaled != plain / 8)).any()  # some interpolated


@pytest.fixture(scope="module")
def default_runner(default_model_dir: Path, build_runner: Callable[..., ModelRunner]) -> ModelRunner:
    return build_runner(default_model_dir, num_blocks=64)


@pytest.fixture(scope="module")
def default_prompt_and_ref(default_model_dir: Path) -> tuple[list[int], torch.Tensor]:
    from servelm.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    msgs = [
        {
            "role": "user",
            "content": "Explain in two short sentences why the sky is blue, and then say why sunsets look red.",
        }
    ]
    ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    return ids, hf_logits(default_model_dir, ids)


@pytest.mark.slow  # the default model against transformers
@pytest.mark.parametrize("mode", list(MODES))
def test_default_model_matches_hf(
    default_runner: ModelRunner, default_prompt_and_ref: tuple[list[int], torch.Tensor], rt: Any, mode: str
) -> None:
    ids, ref = default_prompt_and_ref
    assert len(ids) > 40
    ours = feed(default_runner, rt, ids, MODES[mode], seed=5)
    # 30 layers of float32 sums in another order (oneDNN's blocked matmuls, not MKL's as in HF) move
    # logits of magnitude ~20 by up to ~1.5e-4 (measured); HF's own batched-vs-single shift is ~1e-4.
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# (steps of (sequence, new tokens)) for sequences of 70 / 40 / 12 / 55 tokens; a sequence absent from a
# step waits. Prefill chunks of several sequences at once (similar lengths: the padded layout; one long
# beside short ones: the flat layout), decodes beside them, contexts crossing the 16-token window.
WINDOW_PLANS = {
    "padded-then-decode": [[(0, 30), (1, 30), (3, 30)], [(0, 30), (1, 9), (3, 24), (2, 11)]],
    "flat-mixed": [[(0, 60), (2, 5)], [(0, 9), (1, 39), (2, 6), (3, 3)], [(1, 0), (3, 50)]],
    # One prefill a step, fresh or with context: the query bands of TorchAttentionBackend._prefill_in_bands.
    "one-at-a-time": [[(0, 45)], [(0, 25)], [(1, 40)], [(2, 12)], [(3, 20)], [(3, 35)]],
}


@pytest.mark.parametrize("variant", ["mistral_window", "qwen2_window", "gemma3"])
@pytest.mark.parametrize("plan", list(WINDOW_PLANS))
@pytest.mark.parametrize("kernel", [True, False], ids=["cpp-kernel", "torch-decode"])
def test_sliding_window_batches_equal_hf(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Callable[..., ModelRunner],
    rt: SimpleNamespace,
    variant: str,
    plan: str,
    kernel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Several sequences at once under 16-token windows: prefill chunks together, decodes beside prefills,
    then decodes to the end; each sequence's logits equal transformers' for it alone. A lone prefill
    is attended 8 queries a band (256 when served), so these short prompts take the bands too."""
    from servelm.runtime.cpu import torch_backend

    monkeypatch.setattr(torch_backend, "PREFILL_Q_CHUNK", 8)
    model_dir = tiny_model_dir(variant)
    lens = [70, 40, 12, 55]
    ids = [random_ids(n, seed=100 + i) for i, n in enumerate(lens)]
    backend = None if kernel else TorchAttentionBackend(16, use_kernel=False)
    runner = build_runner(model_dir, num_blocks=64, **({"backend": backend} if backend else {}))
    blocks = rt.ScatteredBlocks(64, 16, seed=7)
    seqs = [rt.FakeSeq(seq_id=i, token_ids=list(x)) for i, x in enumerate(ids)]
    for s in seqs:
        blocks.grow(s, len(s.token_ids))
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in WINDOW_PLANS[plan]:
        items = [BatchItem(seqs[i], n, sample=False) for i, n in step if n]
        for (i, _n), out in zip([x for x in step if x[1]], rt.step_logits(runner, items)):
            got[i].append(out)
    while any(s.num_computed_tokens < len(s.token_ids) for s in seqs):
        todo = [s for s in seqs if s.num_computed_tokens < len(s.token_ids)]
        for s, out in zip(todo, rt.step_logits(runner, [BatchItem(s, 1, sample=False) for s in todo])):
            got[s.seq_id].append(out)
    for i, x in enumerate(ids):
        torch.testing.assert_close(
            torch.cat(got[i]), hf_logits(model_dir, x), atol=1e-4, rtol=0, msg=lambda m, i=i: f"seq {i}: {m}"
        )


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(
    tiny_model_dir: Callable[[str], Path], build_runner: Callable[..., ModelRunner], rt: SimpleNamespace, variant: str
) -> None:
    """bfloat16 (Gemma: norms in float32 with 1 + w, the embedding multiplier rounded to bfloat16, as
    transformers does) lands as near transformers' float32 logits as transformers' own bfloat16 run."""
    model_dir = tiny_model_dir(variant)
    ids = random_ids(40, seed=9)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref16 = hf16(torch.tensor([ids])).logits[0].float()
    ref32 = hf_logits(model_dir, ids)
    ours = feed(build_runner(model_dir, num_blocks=16, dtype=torch.bfloat16), rt, ids, 7, seed=3)
    theirs_err = (ref16 - ref32).abs().mean().item()
    ours_err = (ours - ref32).abs().mean().item()
    assert ours_err < 1.5 * theirs_err, (ours_err, theirs_err)
