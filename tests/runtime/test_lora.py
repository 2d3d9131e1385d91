"""LoRA adapters in the runner: PEFT's own adapter files, checked against PEFT's (unmerged) forward."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lora_files import peft_model, save_lora_adapter
from safetensors.torch import load_file, save_file

from servelm.runtime.batch import BatchItem
from servelm.runtime.cpu import ops as cpu_ops
from servelm.runtime.lora import LoRAError, load_lora_adapter

IDS = [5, 900, 17, 4000, 33, 2, 77, 1200, 8, 64, 19, 300, 41, 7, 4500, 12, 90, 3, 600, 28, 1000, 55, 6]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters for the tiny Llama: every projection (two seeds), q/v only with rsLoRA and patterns, one layer."""
    base = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("lora")
    return {
        "all": save_lora_adapter(base, tmp / "all", seed=1),
        "all2": save_lora_adapter(base, tmp / "all2", seed=2, r=4, lora_alpha=8),
        "qv": save_lora_adapter(
            base,
            tmp / "qv",
            seed=3,
            r=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            use_rslora=True,
            rank_pattern={"down_proj": 4},
            alpha_pattern={"v_proj": 32},
        ),
        "layer1": save_lora_adapter(base, tmp / "layer1", seed=4, layers_to_transform=[1]),
    }


_REF: dict[tuple[str, str | None], torch.Tensor] = {}


def ref_logits(model_dir: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    key = (str(model_dir), str(adapter) if adapter else None)
    if key not in _REF:
        with torch.no_grad():
            _REF[key] = peft_model(model_dir, adapter)(torch.tensor([IDS])).logits[0].float()
    assert ids == IDS[: len(ids)]
    return _REF[key][: len(ids)]


def test_loader_lays_shards_side_by_side(
    tiny_model_dir: Callable[[str], Path], build_runner: Any, adapters: dict[str, Path]
) -> None:
    runner = build_runner(tiny_model_dir("llama"), num_blocks=16)
    ad = load_lora_adapter(adapters["all"], runner.model, max_rank=16)
    assert ad.rank == 8
    assert len(ad.modules) == 3 * 4  # per layer: qkv, o, gate_up, down
    raw = load_file(str(adapters["all"] / "adapter_model.safetensors"))
    qkv = ad.modules["model.layers.0.self_attn.qkv_proj"]
    assert qkv.a.shape == (24, 64) and qkv.bt.numel() == 8 * (64 + 32 + 32)  # no zero blocks
    assert qkv.shards.tolist() == [[0, 64, 8], [64, 32, 8], [96, 32, 8]]
    pre = "base_model.model.model.layers.0.self_attn."
    scale = 16 / 8
    for j, (shard, (out, ranks, bt)) in enumerate(zip("qkv", qkv.blocks)):
        assert ranks == slice(8 * j, 8 * (j + 1)) and out == [slice(0, 64), slice(64, 96), slice(96, 128)][j]
        torch.testing.assert_close(qkv.a[ranks], raw[f"{pre}{shard}_proj.lora_A.weight"])
        torch.testing.assert_close(bt, scale * raw[f"{pre}{shard}_proj.lora_B.weight"].t())
    down = ad.modules["model.layers.2.mlp.down_proj"]
    assert down.shards.tolist() == [[0, 64, 8]] and down.blocks[0][2].shape == (8, 64)
    one = load_lora_adapter(adapters["layer1"], runner.model, max_rank=16)
    assert sorted({k.split(".")[2] for k in one.modules}) == ["1"]


@pytest.mark.parametrize("name", ["all", "qv", "layer1"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_adapter_logits_equal_peft(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Any,
    rt: SimpleNamespace,
    adapters: dict[str, Path],
    name: str,
    chunk: int | None,
) -> None:
    """Prefill (whole or in chunks) then decode steps, through the packed CPU projections."""
    base = tiny_model_dir("llama")
    runner = build_runner(base, num_blocks=32)
    runner.add_lora(7, load_lora_adapter(adapters[name], runner.model, max_rank=16))
    seq = rt.FakeSeq(seq_id=0, token_ids=list(IDS), lora_id=7)
    rt.ScatteredBlocks(32, 16, seed=1).grow(seq, len(IDS))
    parts = []
    prompt = len(IDS) - 4
    step = chunk or prompt
    while seq.num_computed_tokens < prompt:
        n = min(step, prompt - seq.num_computed_tokens)
        parts += rt.step_logits(runner, [BatchItem(seq, n, sample=False)])
    while seq.num_computed_tokens < len(IDS):
        parts += rt.step_logits(runner, [BatchItem(seq, 1, sample=True)])
    ours = torch.cat(parts)
    ref = ref_logits(base, adapters[name], IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # The adapter matters: the base model's logits are far from these.
    assert (ref_logits(base, None, IDS) - ref).abs().max() > 0.5


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp-kernel", "torch"])
def test_mixed_step_each_row_gets_its_own_adapter(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Any,
    rt: SimpleNamespace,
    adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    kernel: bool,
) -> None:
    """Two adapters and the base model in the same steps (prefills and decodes mixed), each sequence
    equal to its own reference; then the adapters are removed and the same rows are the base model's.
    Decode steps go through the compiled kernel, or (without the CPU ops) the torch path."""
    base = tiny_model_dir("llama")
    if not kernel:
        monkeypatch.setenv("SERVELM_DISABLE_CPU_OPS", "1")
    runner = build_runner(base, num_blocks=64)
    runner.add_lora(99, load_lora_adapter(adapters["qv"], runner.model, max_rank=16))
    assert (runner.lora_context.kernel is not None) == (kernel and cpu_ops.load_avx512() is not None)
    if kernel and runner.lora_context.kernel is None:
        pytest.skip("no compiled CPU ops here")
    runner.add_lora(1, load_lora_adapter(adapters["all"], runner.model, max_rank=16))
    runner.add_lora(2, load_lora_adapter(adapters["all2"], runner.model, max_rank=16))
    blocks = rt.ScatteredBlocks(64, 16, seed=5)
    lens = [len(IDS), len(IDS) - 3, len(IDS) - 6, len(IDS) - 1]
    ids_of = {0: 1, 1: 0, 2: 2, 3: 1}  # seq -> adapter
    seqs = [rt.FakeSeq(seq_id=i, token_ids=IDS[:n], lora_id=ids_of[i]) for i, n in enumerate(lens)]
    for s in seqs:
        blocks.grow(s, len(s.token_ids))
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    # Step 1: seqs 0 and 1 prefill 10 tokens; step 2: they continue while 2 and 3 start; then decodes.
    plan = [[(0, 10), (1, 10)], [(0, 6), (2, 9), (1, 4), (3, 12)]]
    for step in plan:
        outs = rt.step_logits(runner, [BatchItem(seqs[i], n, sample=False) for i, n in step])
        for (i, _), o in zip(step, outs):
            got[i].append(o)
    while any(s.num_computed_tokens < len(s.token_ids) for s in seqs):
        todo = [s for s in seqs if s.num_computed_tokens < len(s.token_ids)]
        items = [BatchItem(s, max(1, len(s.token_ids) - s.num_computed_tokens - 3), sample=False) for s in todo]
        for s, o in zip(todo, rt.step_logits(runner, items)):
            got[s.seq_id].append(o)
    refs = {0: None, 1: adapters["all"], 2: adapters["all2"]}
    for i, s in enumerate(seqs):
        ref = ref_logits(base, refs[s.lora_id], IDS)[: len(s.token_ids)]
        torch.testing.assert_close(torch.cat(got[i]), ref, atol=1e-4, rtol=0, msg=lambda m, i=i: f"seq {i}: {m}")

    runner.remove_lora(1)
    runner.remove_lora(2)
    seq = rt.FakeSeq(seq_id=9, token_ids=IDS[:12])
    blocks.grow(seq, 12)
    torch.testing.assert_close(
        rt.step_logits(runner, [BatchItem(seq, 12, sample=False)])[0],
        ref_logits(base, None, IDS)[:12],
        atol=1e-4,
        rtol=0,
    )
    seq = rt.FakeSeq(seq_id=10, token_ids=IDS[:12], lora_id=1)
    blocks.grow(seq, 12)
    with pytest.raises(ValueError, match="not loaded"):
        runner.prepare([BatchItem(seq, 12, sample=False)])


def test_torch_projections_and_int8_take_the_update(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Any,
    rt: SimpleNamespace,
    adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The update is added whatever computes the base projection: plain F.linear (with the split
    gate/up of few rows), or the int8 few-row kernel (compared with its own dequantized base + PEFT's update)."""
    base = tiny_model_dir("llama")
    monkeypatch.setenv("SERVELM_CPU_LINEAR", "torch")
    runner = build_runner(base, num_blocks=32)
    assert not runner.packed_linears
    runner.add_lora(3, load_lora_adapter(adapters["all"], runner.model, max_rank=16))
    seq = rt.FakeSeq(seq_id=0, token_ids=IDS[:8], lora_id=3)
    rt.ScatteredBlocks(32, 16).grow(seq, 8)
    out = rt.step_logits(runner, [BatchItem(seq, 6, sample=False)]) + rt.step_logits(
        runner, [BatchItem(seq, 2, sample=False)]
    )
    torch.testing.assert_close(torch.cat(out), ref_logits(base, adapters["all"], IDS)[:8], atol=1e-4, rtol=0)
    monkeypatch.delenv("SERVELM_CPU_LINEAR")

    q = build_runner(base, num_blocks=32, quantization="int8")
    if not q.quantization:
        pytest.skip("no int8 kernels on this CPU")
    q.add_lora(3, load_lora_adapter(adapters["all"], q.model, max_rank=16))
    seqs = [rt.FakeSeq(seq_id=i, token_ids=IDS[:8], lora_id=3 * i) for i in range(2)]  # base and adapter
    blocks = rt.ScatteredBlocks(32, 16)
    for s in seqs:
        blocks.grow(s, 8)
    rt.step_logits(q, [BatchItem(s, 7, sample=False) for s in seqs])
    base_row, lora_row = rt.step_logits(q, [BatchItem(s, 1, sample=True) for s in seqs])  # 2 rows: the int8 kernel
    delta = ref_logits(base, adapters["all"], IDS)[7] - ref_logits(base, None, IDS)[7]
    # int8 moves the base; the adapter's effect on top of it is PEFT's within int8's error.
    assert torch.nn.functional.cosine_similarity(lora_row[0] - base_row[0], delta, dim=0) > 0.99


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: _config(d, use_dora=True), "use_dora"),
        (lambda d: _config(d, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda d: _config(d, bias="lora_only"), "bias"),
        (lambda d: _config(d, peft_type="IA3"), "peft_type"),
        (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter weights"),
        (lambda d: _tensors(d, drop="lora_B"), "not its partner"),
        (lambda d: _tensors(d, rename=("self_attn.q_proj", "self_attn.rotary")), "not a projection"),
        (lambda d: _tensors(d, rename=("self_attn.q_proj", "embed_tokens")), "not a projection"),
        (lambda d: _tensors(d, extra="base_model.model.lm_head.lora_embedding_A"), "not a LoRA A/B weight"),
        (lambda d: _tensors(d, widen=True), "another model"),
    ],
)
def test_bad_adapters_are_refused_by_name(
    tiny_model_dir: Callable[[str], Path],
    build_runner: Any,
    adapters: dict[str, Path],
    tmp_path: Path,
    edit: Callable[[Path], Any],
    match: str,
) -> None:
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(adapters["all"], d)
    edit(d)
    runner = build_runner(tiny_model_dir("llama"), num_blocks=16)
    with pytest.raises(LoRAError, match=match):
        load_lora_adapter(d, runner.model, max_rank=16)


def test_rank_limit_and_missing_folder(
    tiny_model_dir: Callable[[str], Path], build_runner: Any, adapters: dict[str, Path], tmp_path: Path
) -> None:
    runner = build_runner(tiny_model_dir("llama"), num_blocks=16)
    with pytest.raises(LoRAError, match="rank 8, more than --max-lora-rank 4"):
        load_lora_adapter(adapters["all"], runner.model, max_rank=4)
    with pytest.raises(LoRAError, match="is not a folder"):
        load_lora_adapter(tmp_path / "nowhere", runner.model, max_rank=16)
    with pytest.raises(ValueError, match="already in use"):
        ad = load_lora_adapter(adapters["all"], runner.model, max_rank=16)
        runner.add_lora(1, ad)
        runner.add_lora(1, ad)


def _config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _tensors(
    folder: Path,
    drop: str | None = None,
    rename: tuple[str, str] | None = None,
    extra: str | None = None,
    widen: bool = False,
) -> None:
    path = folder / "adapter_model.safetensors"
    t = load_file(str(path))
    key = next(k for k in t if "layers.0.self_attn.q_proj.lora_A" in k)
    if drop:
        t = {k: v for k, v in t.items() if not ("layers.0.self_attn.q_proj" in k and drop in k)}
    if rename:
        t = {k.replace(*rename) if "layers.0." in k else k: v for k, v in t.items()}
    if extra:
        t[extra] = torch.zeros(8, 4)
    if widen:
        t[key] = torch.zeros(8, 96)
    save_file(t, str(path))
