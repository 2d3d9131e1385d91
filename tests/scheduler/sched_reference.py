"""Hugging Face greedy references for the scheduler tests, and the near-tie rule for comparing with them.

A mismatch with HF's greedy tokens is excused only at a provable near-tie: at the first diverging step
HF's own top-two logit gap is below ``NEAR_TIE`` and the engine picked HF's runner-up. After such a
divergence the continuations legitimately differ, so nothing later is compared.
"""

from __future__ import annotations

import contextlib
import gc
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NEAR_TIE = 1e-3


@dataclass
class GreedyReference:
    tokens: list[int]
    top2_ids: list[tuple[int, int]]  # per step: HF's best and runner-up token
    top2_gap: list[float]  # per step: logit(best) - logit(runner-up)


@contextlib.contextmanager
def fast_gguf_reader() -> Iterator[None]:
    """While transformers loads a GGUF file: gguf-py's reader gets the file's bytes as a plain array rather
    than ``np.memmap`` slices (the same parse, ~3x faster over a large vocabulary's strings), and each file
    is parsed once for transformers' two reads of it (config, then weights). Gemma 3's 262k-token vocabulary
    otherwise takes minutes on a loaded 2-core machine."""
    import gguf
    import gguf.gguf_reader as gguf_reader
    import numpy as np

    plain_np = types.ModuleType("numpy_plain_map")
    plain_np.__dict__.update(np.__dict__)
    plain_np.memmap = lambda path, mode="r", **_: np.fromfile(path, dtype=np.uint8)
    real_reader = gguf.GGUFReader
    readers: dict[tuple[str, int, int], Any] = {}

    def cached_reader(path: Any, mode: str = "r") -> Any:
        p = Path(path).resolve()
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = real_reader(p, mode)
        return readers[key]

    saved = (gguf_reader.np, gguf.GGUFReader)
    gguf_reader.np, gguf.GGUFReader = plain_np, cached_reader
    try:
        yield
    finally:
        gguf_reader.np, gguf.GGUFReader = saved
        readers.clear()


def hf_greedy_references(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    lora_adapter: Path | None = None,
    gguf_file: str | None = None,
) -> list[GreedyReference]:
    """HF ``generate(do_sample=False)`` per prompt (batch 1, no EOS stop), keeping each step's top two;
    with ``lora_adapter``, through PEFT with that adapter applied (unmerged); with ``gguf_file`` (a file
    name inside ``model_dir``), the model transformers loads from that GGUF file (dequantized to float32)."""
    from transformers import AutoModelForCausalLM

    if gguf_file is not None:
        with fast_gguf_reader():
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, gguf_file=gguf_file)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    if lora_adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(lora_adapter)).eval()
    refs: list[GreedyReference] = []
    try:
        with torch.inference_mode():
            for ids in prompts:
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=0,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    eos_token_id=None,  # ignore_eos: always max_new_tokens tokens
                    pad_token_id=0,
                )
                tokens = out.sequences[0, len(ids) :].tolist()
                assert len(tokens) == max_new_tokens
                steps = torch.cat(out.logits, dim=0).float()  # [steps, vocab]
                top = steps.topk(2, dim=-1)
                refs.append(
                    GreedyReference(
                        tokens,
                        [tuple(x) for x in top.indices.tolist()],
                        (top.values[:, 0] - top.values[:, 1]).tolist(),
                    )
                )
    finally:
        del model
        gc.collect()
    return refs


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def assert_matches_reference(ours: list[int], ref: GreedyReference, label: str = "") -> bool:
    """Token-exact, or a provable near-tie at the first divergence. Returns True when a tie was excused."""
    k = first_divergence(ours, ref.tokens)
    if k is None:
        return False
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens vs HF's {len(ref.tokens)}"
    best, second = ref.top2_ids[k]
    gap = ref.top2_gap[k]
    assert gap < NEAR_TIE and ours[k] == second, (
        f"{label}: diverges from HF at step {k}: ours {ours[k]}, HF {best} (runner-up {second}, "
        f"top-two gap {gap:.2e}); ours {ours[: k + 1]} vs HF {ref.tokens[: k + 1]}"
    )
    return True


# One intra-op thread for the greedy tests: on this shared 2-core machine two OpenMP threads competing
# with other processes make steps several times slower and erratic. Exactness does not depend on it.
TEST_THREADS = int(os.environ.get("SERVELM_TEST_THREADS", "1"))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
