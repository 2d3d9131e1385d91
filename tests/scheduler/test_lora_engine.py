"""LoRA adapters through the whole engine: greedy tokens equal PEFT's, with adapters and the base model
mixed in the same steps, through chunked prefill, preemption and the prefix cache; ``max_loras``;
loading and unloading while requests run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lora_files import save_lora_adapter
from sched_reference import GreedyReference, assert_matches_reference, hf_greedy_references

from servelm.runtime.cpu import linear as cpu_linear
from servelm.runtime.lora import LoRAError
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import InvalidParameterError, LoRANotFoundError, SamplingParams

MiB = 2**20
MAX_NEW = 24
PROMPTS = [
    [5, 900, 17, 4000, 33, 2, 77, 1200, 8, 64, 19, 300, 41, 7, 4500, 12, 90, 3, 600, 28, 1000, 55, 6, 71, 18, 2000],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444],
    [5, 900, 17, 4000, 33, 2, 77, 1200, 8, 64, 19, 300, 41, 7, 4500, 12, 90, 3, 9, 9, 9],  # shares a block with 0
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("engine-lora")
    return {
        "a": save_lora_adapter(tiny_llama_dir, tmp / "a", seed=11),
        "b": save_lora_adapter(
            tiny_llama_dir, tmp / "b", seed=12, r=4, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
    }


@pytest.fixture(scope="module")
def refs(tiny_llama_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[GreedyReference]]:
    """PEFT's greedy tokens for every prompt under the base model and each adapter."""
    out: dict[str | None, list[GreedyReference]] = {None: hf_greedy_references(tiny_llama_dir, PROMPTS, MAX_NEW)}
    for name, path in adapters.items():
        out[name] = hf_greedy_references(tiny_llama_dir, PROMPTS, MAX_NEW, lora_adapter=path)
    # The adapters change the model's choices, or this test would prove nothing.
    for name in adapters:
        assert all(r.tokens != b.tokens for r, b in zip(out[name], out[None]))
    return out


def lora_engine(model: Path, adapters: dict[str, Path], **cfg: Any) -> Engine:
    cfg.setdefault("kv_cache_memory", 2 * MiB)
    config = EngineConfig(
        model=str(model), max_model_len=256, lora_modules=tuple((k, str(v)) for k, v in adapters.items()), **cfg
    )
    return Engine(config)


# (name, config): plain; 7-token prefill chunks; a pool so small that requests are preempted.
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 7},
    "preempted": {"kv_cache_memory": 2 * 3 * 64 * 4 * 16 * 9},  # 9 blocks of 16 tokens: 3 sequences do not fit
}


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_adapters_equal_peft_greedy(
    tiny_llama_dir: Path, adapters: dict[str, Path], refs: dict[str | None, list[GreedyReference]], case: str
) -> None:
    """Every prompt under the base model and both adapters at once (9 requests in the same steps)."""
    engine = lora_engine(tiny_llama_dir, adapters, **CASES[case])
    jobs = [(p, name) for name in (None, "a", "b") for p in range(len(PROMPTS))]
    results = engine.generate([PROMPTS[p] for p, _ in jobs], GREEDY, lora_names=[n for _, n in jobs])
    for (p, name), res in zip(jobs, results):
        assert_matches_reference(res.outputs[0].token_ids, refs[name][p], f"{case} prompt {p} adapter {name}")
    if case == "preempted":
        assert engine.scheduler.num_preemptions_total > 0
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_prefix_cache_is_per_adapter(
    tiny_llama_dir: Path, adapters: dict[str, Path], refs: dict[str | None, list[GreedyReference]]
) -> None:
    """The same prompt under another adapter finds nothing cached (its K/V differ); under the same
    adapter it finds its own blocks, and the tokens stay PEFT's."""
    engine = lora_engine(tiny_llama_dir, adapters)
    cached = []
    for name in (None, "a", "a", "b", None):
        rid = f"r{len(cached)}"
        engine.add_request(rid, PROMPTS[0], GREEDY, lora_name=name)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        cached.append(outs[-1].num_cached_tokens)
        tokens = [t for o in outs for c in o.outputs for t in c.new_token_ids]
        assert_matches_reference(tokens, refs[name][0], f"adapter {name}")
    assert cached == [0, 0, 16, 0, 16]


def test_max_loras_bounds_the_adapters_of_a_step(
    tiny_llama_dir: Path, adapters: dict[str, Path], refs: dict[str | None, list[GreedyReference]]
) -> None:
    """With max_loras=1, no step mixes two adapters (the base model runs beside either); a request of
    the other adapter waits, but does not block the base-model requests queued behind it."""
    engine = lora_engine(tiny_llama_dir, adapters, max_loras=1, max_cpu_loras=2)  # both stay loaded
    seen: list[set[int]] = []
    execute = engine.runner.launch

    def spy(items: Any) -> Any:
        seen.append({it.seq.lora_id for it in items})
        return execute(items)

    engine.runner.launch = spy
    order = ["a", "b", None, "b", "a", None]
    results = engine.generate([PROMPTS[i % 3] for i in range(len(order))], GREEDY, lora_names=order)
    for i, (name, res) in enumerate(zip(order, results)):
        assert_matches_reference(res.outputs[0].token_ids, refs[name][i % 3], f"request {i} adapter {name}")
    assert all(len(ids - {0}) <= 1 for ids in seen)
    ids = {name: engine.loras.id_of(name) for name in ("a", "b")}
    first_b = next(k for k, s in enumerate(seen) if ids["b"] in s)
    # The base-model request queued after the first "b" started in the very first step, beside "a".
    assert seen[0] == {ids["a"], 0} and first_b > 0
    assert engine.block_manager.num_used_blocks == 0


def test_unload_while_running_and_errors(
    tiny_llama_dir: Path, adapters: dict[str, Path], refs: dict[str | None, list[GreedyReference]]
) -> None:
    engine = lora_engine(tiny_llama_dir, {"a": adapters["a"]})
    assert engine.loras.adapters == {"a": str(adapters["a"])}
    engine.add_request("r0", PROMPTS[1], GREEDY, lora_name="a")
    tokens = [t for o in engine.step() for c in o.outputs for t in c.new_token_ids]
    (adapter_id,) = engine.runner.lora_ids
    engine.loras.remove("a")  # r0 keeps its adapter until it finishes
    with pytest.raises(LoRANotFoundError):
        engine.add_request("r1", PROMPTS[1], GREEDY, lora_name="a")
    assert engine.runner.lora_ids == {adapter_id}
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for c in o.outputs for t in c.new_token_ids]
    assert_matches_reference(tokens, refs["a"][1], "unloaded while running")
    assert engine.runner.lora_ids == set()
    # Loaded again under the same name: a new id, so nothing of the old one is reused.
    new_id = engine.loras.add("a", str(adapters["a"]))
    assert new_id != adapter_id
    with pytest.raises(LoRAError, match="already served"):
        engine.loras.add("a", str(adapters["b"]))
    with pytest.raises(LoRAError, match="already served"):
        engine.loras.add(engine.served_model_name, str(adapters["b"]))
    with pytest.raises(LoRANotFoundError):
        engine.loras.remove("nope")
    with pytest.raises(LoRAError, match="rank 8, more than --max-lora-rank 4"):
        Engine(
            EngineConfig(
                model=str(tiny_llama_dir),
                kv_cache_memory=2 * MiB,
                max_model_len=256,
                lora_modules=(("a", str(adapters["a"])),),
                max_lora_rank=4,
            )
        )
    plain = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=2 * MiB, max_model_len=256))
    with pytest.raises(LoRAError, match="not enabled"):
        plain.loras.add("a", str(adapters["a"]))
    with pytest.raises(LoRANotFoundError):
        plain.add_request("r", PROMPTS[0], GREEDY, lora_name="a")


def test_aborted_and_failed_requests_release_their_adapter(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = lora_engine(tiny_llama_dir, {"a": adapters["a"]})
    engine.add_request("r0", PROMPTS[0], SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=1), lora_name="a")
    engine.add_request("r1", PROMPTS[1], GREEDY, lora_name="a")
    engine.step()
    engine.loras.remove("a")
    engine.abort("r0")
    engine.abort("r1")
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.runner.lora_ids == set() and not engine.loras.in_use
    assert engine.block_manager.num_used_blocks == 0


def test_step_stats_name_running_and_waiting_adapters(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    stats: list[Any] = []

    class Obs:
        def on_step(self, s: Any) -> None:
            stats.append(s.lora_adapters)

        def on_request_finished(self, s: Any) -> None:
            pass

        def on_request_rejected(self) -> None:
            pass

    config = EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=2 * MiB, max_model_len=256, max_loras=1, max_cpu_loras=2,
                          lora_modules=(("a", str(adapters["a"])), ("b", str(adapters["b"]))))  # fmt: skip
    engine = Engine(config, observer=Obs())
    engine.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0.0), lora_names=["a", "b"])
    assert stats[0] == (["a"], ["b"])
    assert (["b"], []) in stats
    plain_stats: list[Any] = []
    Obs.on_step = lambda self, s: plain_stats.append(s.lora_adapters)
    Engine(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=2 * MiB, max_model_len=256), observer=Obs()
    ).generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    assert plain_stats and all(s is None for s in plain_stats)


@pytest.mark.slow  # the default model against PEFT
def test_default_model_int4_with_an_adapter_equals_peft(default_model_dir: Path, tmp_path: Path) -> None:
    """The embedded model served in its own 4-bit format (``--quantization auto``) with an adapter on
    every projection: greedy tokens equal PEFT's float32 ones, and the base model's stay HF's."""
    adapter = save_lora_adapter(default_model_dir, tmp_path / "smol", seed=5, r=8, std=0.05)
    engine = Engine(
        EngineConfig(
            kv_cache_memory=64 * MiB, max_model_len=512, quantization="auto", lora_modules=(("smol", str(adapter)),)
        )
    )
    # auto takes int4 only where its kernels run (AVX-512); elsewhere the same weights stay float32.
    assert engine.runner.quantization == ("int4" if cpu_linear.quantized_kernels() else None)
    tok = engine.tokenizer
    ids = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": "Tell me a short story about a dragon."}],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    )
    n = 16
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ours = engine.generate([ids, ids], params, lora_names=["smol", None])
    ref_lora = hf_greedy_references(default_model_dir, [ids], n, lora_adapter=adapter)[0]
    ref_base = hf_greedy_references(default_model_dir, [ids], n)[0]
    assert ref_lora.tokens != ref_base.tokens
    assert_matches_reference(ours[0].outputs[0].token_ids, ref_lora, "adapter")
    assert_matches_reference(ours[1].outputs[0].token_ids, ref_base, "base")


def test_cache_salt_separates_prefix_caches(
    tiny_llama_dir: Path, adapters: dict[str, Path], refs: dict[str | None, list[GreedyReference]]
) -> None:
    """vLLM's cache_salt: a request shares cached blocks only with requests of the same salt (and the
    same adapter); the tokens do not change."""
    engine = lora_engine(tiny_llama_dir, adapters)
    cached = []
    for salt, name in (
        (None, None),
        ("tenant-1", None),
        ("tenant-1", None),
        ("tenant-2", None),
        (None, None),
        ("tenant-1", "a"),
        ("tenant-1", "a"),
    ):
        rid = f"r{len(cached)}"
        engine.add_request(rid, PROMPTS[0], GREEDY, lora_name=name, cache_salt=salt)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        cached.append(outs[-1].num_cached_tokens)
        assert_matches_reference(
            [t for o in outs for c in o.outputs for t in c.new_token_ids], refs[name][0], f"{salt} {name}"
        )
    assert cached == [0, 0, 16, 0, 16, 0, 16]


def test_priority_policy_keeps_tokens_exact(
    tiny_llama_dir: Path, adapters: dict[str, Path], refs: dict[str | None, list[GreedyReference]]
) -> None:
    """--scheduling-policy priority with adapters, under preemption: tokens are PEFT's, higher
    priorities start first; a priority under fcfs is refused by name."""
    engine = lora_engine(tiny_llama_dir, adapters, scheduling_policy="priority", **CASES["preempted"])
    jobs = [(p, name, prio) for prio, name in ((3, None), (0, "a"), (1, "b")) for p in range(len(PROMPTS))]
    tokens: dict[str, list[int]] = {}
    for k, (p, name, prio) in enumerate(jobs):
        engine.add_request(f"j{k}", PROMPTS[p], GREEDY, lora_name=name, priority=prio)
        tokens[f"j{k}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] += [t for c in o.outputs for t in c.new_token_ids]
    for k, (p, name, _) in enumerate(jobs):
        assert_matches_reference(tokens[f"j{k}"], refs[name][p], f"job {k}")
    assert engine.scheduler.num_preemptions_total > 0
    plain = lora_engine(tiny_llama_dir, adapters)
    with pytest.raises(InvalidParameterError, match="scheduling-policy priority") as e:
        plain.add_request("x", PROMPTS[0], GREEDY, priority=1)
    assert e.value.param == "priority"


def test_speculative_drafts_are_verified_with_the_adapter(
    tiny_llama_dir: Path, adapters: dict[str, Path], refs: dict[str | None, list[GreedyReference]]
) -> None:
    """n-gram drafts of an adapter's request are computed as its decode rows, with its update: the
    tokens stay PEFT's while drafts are kept and thrown away."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    engine = lora_engine(tiny_llama_dir, adapters, speculative_config=spec)
    for p in range(len(PROMPTS)):
        for name in ("a", "b"):
            (res,) = engine.generate([PROMPTS[p]], GREEDY, lora_names=name)
            assert_matches_reference(res.outputs[0].token_ids, refs[name][p], f"prompt {p} adapter {name}")
    assert engine.drafts_verified > 10 and 0 < engine.num_accepted_drafts < engine.drafts_verified
