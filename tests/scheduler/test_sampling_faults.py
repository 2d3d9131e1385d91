"""A request whose sampling raises fails alone: its batch's other requests get exactly their tokens, the
engine keeps serving and frees every block (tiny model, real runner; synchronous and scheduling ahead)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.runtime.batch import SequenceView
from servelm.runtime.sampler import Sampler
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

MiB = 2**20
FAULTY_SEED = 424242  # the request whose rows the injected fault hits


def inject_fault(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """The sampler raises for the whole batch whenever it holds the faulty request's row, once that
    request has ``after`` output tokens (as a broken grammar matcher, or the overflow that raised in
    the top-p histogram, did)."""
    real = Sampler.process_logits

    def process_logits(self: Sampler, logits: torch.Tensor, seqs: Sequence[SequenceView]) -> None:
        for s in seqs:
            if getattr(s.params, "seed", None) == FAULTY_SEED and len(s.token_ids) - s.num_prompt_tokens >= after:
                raise RuntimeError("sampler fault injected")
        real(self, logits, seqs)

    monkeypatch.setattr(Sampler, "process_logits", process_logits)


def _tokens(result: Any) -> list[int]:
    return result.outputs[0].token_ids


@pytest.mark.parametrize("after", [0, 3], ids=["at-first-token", "mid-decode"])
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async-scheduling"])
def test_a_request_whose_sampling_raises_fails_alone(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, ahead: bool, after: int
) -> None:
    e = Engine(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 * MiB, max_model_len=256, async_scheduling=ahead)
    )
    prompts = [[1, 5, 900, 17, 4000], [1, 33, 2, 77, 1200, 8], [1, 64, 19]]
    good = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    ]
    alone = [e.generate([p], sp)[0] for p, sp in zip(prompts, good)]
    assert len(set(_tokens(alone[1]))) > 3  # the seeded request really samples

    inject_fault(monkeypatch, after)
    bad = SamplingParams(max_tokens=10, temperature=0.8, seed=FAULTY_SEED, ignore_eos=True)
    failed, *others = e.generate([prompts[2], *prompts[:2]], [bad, *good])

    assert failed.outputs[0].finish_reason == "error"
    assert "sampler fault injected" in (failed.outputs[0].error or "")
    assert len(_tokens(failed)) == after
    for got, want in zip(others, alone):
        assert _tokens(got) == _tokens(want)
        assert got.outputs[0].finish_reason == "length"
    assert [lp.token_id for lp in others[0].outputs[0].logprobs or []] == _tokens(alone[0])
    assert e.block_manager.num_used_blocks == 0

    # The engine goes on: the same batch once more (the faulty request fails again), then a request alone.
    failed, *others = e.generate([prompts[2], *prompts[:2]], [bad, *good])
    assert failed.outputs[0].finish_reason == "error" and [_tokens(r) for r in others] == [_tokens(r) for r in alone]
    assert _tokens(e.generate([prompts[1]], good[1])[0]) == _tokens(alone[1])
    assert e.block_manager.num_used_blocks == 0 and not e.has_unfinished_requests()
