"""Scheduling ahead (``async_scheduling``): the same outputs as the synchronous engine, no pending
token ever reported, no block leaked, and exactly the documented extra work (tiny model, real runner)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servelm.runtime.batch import PENDING_TOKEN
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams

MiB = 2**20


def engine(tiny_llama_dir: Path, ahead: bool, **cfg: Any) -> Engine:
    base: dict[str, Any] = dict(model=str(tiny_llama_dir), kv_cache_memory=4 * MiB, max_model_len=256)
    return Engine(EngineConfig(**{**base, **cfg}, async_scheduling=ahead))


def drain(e: Engine, max_steps: int = 3000) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in range(max_steps):
        if not e.has_unfinished_requests():
            return outs
        outs.extend(e.step())
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    from servelm.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    texts = ["1 2 3 4 5 6 7 8 9 10 " * 4, "Hello, my name is", "The capital of France", "def fib(n):\n    "]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def workload(prompts: list[list[int]], stop_token: int, stop_text: str) -> list[tuple[list[int], SamplingParams]]:
    """Every way a request can end or be sampled: length, a stop token (mid-batch), a stop string,
    min_tokens, penalties, logprobs, seeded n=2 random sampling."""
    g = dict(temperature=0.0, ignore_eos=True)
    return [
        (prompts[0], SamplingParams(max_tokens=30, **g)),
        (prompts[1], SamplingParams(max_tokens=40, stop_token_ids=[stop_token], **g)),
        (prompts[2], SamplingParams(max_tokens=25, stop=[stop_text], **g)),
        (prompts[3], SamplingParams(max_tokens=20, logprobs=3, frequency_penalty=0.7, presence_penalty=0.3, **g)),
        (
            prompts[1],
            SamplingParams(max_tokens=12, repetition_penalty=1.3, min_tokens=12, stop_token_ids=[stop_token], **g),
        ),
        (prompts[2], SamplingParams(n=2, max_tokens=18, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
        (prompts[0][:5], SamplingParams(max_tokens=1, logprobs=0, **g)),
    ]


def summary(e: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> tuple[list[Any], list[float]]:
    """Per request and choice: tokens, text, finish and stop reasons, logprob token ids and ranks (all
    compared exactly); and every logprob value (batch composition moves them in the last bits)."""
    res = e.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert e.block_manager.num_used_blocks == 0
    exact = [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                c.stop_reason,
                [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in c.logprobs or []],
            )
            for c in r.outputs
        ]
        for r in res
    ]
    values = [
        v for r in res for c in r.outputs for lp in c.logprobs or [] for v in (lp.logprob, *(x for _, x in lp.top))
    ]
    return exact, values


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        dict(max_num_batched_tokens=8),  # chunked prefill
        # 8 blocks of 16 for ~250 tokens of demand: preemption.
        dict(kv_cache_memory=8 * 16 * 768, max_model_len=128, enable_prefix_caching=False),
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_same_outputs_as_synchronous(tiny_llama_dir: Path, prompts: list[list[int]], cfg: dict[str, Any]) -> None:
    sync = engine(tiny_llama_dir, False, **cfg)
    # Pick a stop token and a stop string that the greedy outputs reach mid-way.
    probe = sync.generate(prompts[1:3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stop_token = probe[0].outputs[0].token_ids[5]
    stop_text = probe[1].outputs[0].text[10:14]
    assert stop_text.strip()
    reqs = workload(prompts, stop_token, stop_text)

    expected, expected_lps = summary(sync, reqs)
    ahead = engine(tiny_llama_dir, True, **cfg)
    got, got_lps = summary(ahead, reqs)
    assert got == expected
    assert got_lps == pytest.approx(expected_lps, abs=1e-4) and len(expected_lps) > 40
    assert not ahead.has_unfinished_requests()
    # The workload does stop early: by the stop token, and by the stop string.
    assert expected[1][0][2] == "stop" and len(expected[1][0][0]) < 40
    assert expected[2][0][2] == "stop" and len(expected[2][0][0]) < 25
    if "kv_cache_memory" in cfg:
        assert sync.scheduler.num_preemptions_total > 0 and ahead.scheduler.num_preemptions_total > 0


def test_steps_computed_ahead(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    """A request stopped by a token runs one wasted row in the next step; one that ends by length is not
    scheduled after its last sampling step. Tokens arrive one step late, never as PENDING_TOKEN."""
    sync = engine(tiny_llama_dir, False)
    greedy = sync.generate([prompts[1]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    out = greedy.outputs[0].token_ids
    # The first token from the 4th on that did not occur before: the request stops there.
    stop_at = next(i for i in range(3, len(out)) if out[i] not in out[:i])
    stop_token_id = out[stop_at]

    e = engine(tiny_llama_dir, True)
    launched: list[dict[str, int]] = []
    launch = e.runner.launch

    def spy(items: list[Any]) -> Any:
        launched.append({it.seq.request_id: it.num_new_tokens for it in items})
        return launch(items)

    e.runner.launch = spy
    e.add_request("stop", prompts[1], SamplingParams(max_tokens=50, stop_token_ids=[stop_token_id], temperature=0.0))
    e.add_request("len", prompts[2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    per_step = []
    while e.has_unfinished_requests():
        per_step.append({o.request_id: [t for c in o.outputs for t in c.new_token_ids] for o in e.step()})
    tokens = {rid: [t for step in per_step for t in step.get(rid, [])] for rid in ("stop", "len")}
    assert PENDING_TOKEN not in tokens["stop"] + tokens["len"]
    assert tokens["stop"] == out[: stop_at + 1]
    assert len(tokens["len"]) == 4
    # Step 0: both prompts. "len" samples its 4 tokens in steps 0..3 and is not launched again; "stop"
    # samples its stop token in step stop_at, and is launched once more (wasted: the token is read while
    # that step runs), not after.
    assert [sorted(s) for s in launched] == [
        [rid for rid, last in (("len", 3), ("stop", stop_at + 1)) if k <= last] for k in range(stop_at + 2)
    ]
    assert per_step[0] == {}  # step 0's tokens are read in step 1
    assert e.block_manager.num_used_blocks == 0 and e._in_flight is None


def test_abort_while_a_token_is_pending(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    e = engine(tiny_llama_dir, True)
    e.add_request("x", prompts[0], SamplingParams(n=2, max_tokens=100, temperature=0.8, ignore_eos=True))
    e.add_request("y", prompts[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))
    outs: list[RequestOutput] = []
    while sum(len(c.new_token_ids) for o in outs if o.request_id == "x" for c in o.outputs) < 3:
        outs.extend(e.step())
    x = e._groups["x"].choices
    assert all(r.token_ids[-1] == PENDING_TOKEN for r in x)  # in flight: a step was sampled, not read
    e.abort("x")
    assert all(r.token_ids[-1] != PENDING_TOKEN for r in x)
    outs.extend(drain(e))
    x_out = [c for o in outs if o.request_id == "x" for c in o.outputs]
    assert [c.finish_reason for c in x_out if c.finish_reason] == ["abort", "abort"]
    for i in range(2):
        ids = [t for c in x_out if c.index == i for t in c.new_token_ids]
        assert PENDING_TOKEN not in ids and ids == x[i].output_token_ids
        assert x[i].num_output_tokens == len(ids)
    y = [c for o in outs if o.request_id == "y" for c in o.outputs]
    assert y[-1].finish_reason == "length" and sum(len(c.new_token_ids) for c in y) == 6
    assert sum(len(c.new_logprobs or []) for c in y) == 6
    assert e.block_manager.num_used_blocks == 0 and not e.has_unfinished_requests()


def test_switching_modes_mid_run(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    """The step issued ahead is read by the next step whatever the mode is by then."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=0.5)
    expected = [r.outputs[0].token_ids for r in engine(tiny_llama_dir, False).generate(prompts, params)]
    e = engine(tiny_llama_dir, True)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    outs = [e.step() for _ in range(4)]
    assert e._in_flight is not None
    e.async_scheduling = False
    outs.append(drain(e))
    got = [
        [t for step in outs for o in step if o.request_id == str(i) for c in o.outputs for t in c.new_token_ids]
        for i in range(4)
    ]
    assert got == expected
    assert e.block_manager.num_used_blocks == 0 and e._in_flight is None


def test_unset_means_on_for_cuda_only(tiny_llama_dir: Path) -> None:
    # On CPU the forward does not run in the background: unset leaves the engine synchronous.
    base: dict[str, Any] = dict(model=str(tiny_llama_dir), kv_cache_memory=4 * MiB, max_model_len=256)
    assert Engine(EngineConfig(**base)).async_scheduling is False
    assert Engine(EngineConfig(**base, async_scheduling=True)).async_scheduling is True
