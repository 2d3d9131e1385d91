"""The LoRA adapters kept loaded are bounded (``max_cpu_loras``): the least recently used one that no
unfinished request uses is unloaded first, its name stays served, and a request naming it brings its
weights back from its folder, read by the caller (never by the engine thread)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from lora_files import save_lora_adapter

from servelm.runtime.lora import LoRAError
from servelm.runtime.models.layers import Linear
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import SamplingParams

MiB = 2**20
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("lora-registry")
    return [save_lora_adapter(tiny_llama_dir, tmp / f"f{i}", seed=40 + i, r=4) for i in range(3)]


def make_engine(model: Path, modules: list[tuple[str, Path]], **cfg: Any) -> Engine:
    config = EngineConfig(
        model=str(model),
        kv_cache_memory=2 * MiB,
        max_model_len=256,
        enable_lora=True,
        lora_modules=tuple((n, str(p)) for n, p in modules),
        **cfg,
    )
    return Engine(config)


def run(engine: Engine, rid: str, name: str | None, adapter: Any = None) -> list[int]:
    """Greedy tokens of PROMPT under ``name`` (``adapter``: its weights, read by the caller)."""
    extra = {"lora_adapter": adapter} if adapter is not None else {}
    engine.add_request(rid, PROMPT, GREEDY, lora_name=name, **extra)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == rid for c in o.outputs for t in c.new_token_ids]
    return tokens


def installed_ids(engine: Engine) -> set[int]:
    """Adapter ids whose weights some projection of the model holds (what memory is really spent on)."""
    return {
        i
        for m in engine.runner.model.modules()
        if isinstance(m, Linear) and m.method.parts.lora is not None
        for i in m.method.parts.lora.updates
    }


def test_loading_many_adapters_keeps_at_most_max_cpu_loras(tiny_llama_dir: Path, folders: list[Path]) -> None:
    """The hostile probe: one folder loaded under many names. With max_cpu_loras left to its default
    (max_loras, 2) at most 2 stay in the runner, the least recently used unloaded first; every name
    is still served."""
    engine = make_engine(tiny_llama_dir, [], max_loras=2)
    for i in range(8):
        engine.loras.add(f"n{i}", str(folders[0]))
        assert len(engine.runner.lora_ids) <= 2 and len(installed_ids(engine)) <= 2, i
    assert set(engine.loras.adapters) == {f"n{i}" for i in range(8)}
    assert set(engine.loras.loaded) == {"n6", "n7"}
    assert installed_ids(engine) == engine.runner.lora_ids == set(engine.loras.loaded.values())
    # A request naming n6 makes it the most recently used: loading another unloads n7.
    run(engine, "r0", "n6")
    engine.loras.add("x", str(folders[1]))
    assert set(engine.loras.loaded) == {"n6", "x"}


def test_an_evicted_adapter_is_read_again_by_the_caller(tiny_llama_dir: Path, folders: list[Path]) -> None:
    """Start-up adapters beyond the limit are all checked and served, the last ones kept loaded; a
    request for an unloaded one is refused by the engine until the caller hands it the weights read
    again from the folder, and it then gets the same tokens as a server that never unloaded it."""
    engine = make_engine(tiny_llama_dir, [("a", folders[0]), ("b", folders[1])], max_loras=1)
    assert set(engine.loras.adapters) == {"a", "b"} and set(engine.loras.loaded) == {"b"}
    tokens_b = run(engine, "r0", "b")
    from servelm.scheduler.lora_registry import LoRANotLoadedError

    with pytest.raises(LoRANotLoadedError) as e:
        engine.add_request("r1", PROMPT, GREEDY, lora_name="a")
    assert e.value.path == str(folders[0]) and e.value.name == "a"
    assert not engine.has_unfinished_requests() and set(engine.loras.loaded) == {"b"}
    old_b = engine.loras.loaded["b"]
    tokens_a = run(engine, "r1", "a", engine.loras.read(e.value.path))  # "b" is not in use: unloaded
    assert set(engine.loras.loaded) == {"a"} and engine.runner.lora_ids == {engine.loras.loaded["a"]}
    assert run(engine, "r2", "b", engine.loras.read(str(folders[1]))) == tokens_b
    assert engine.loras.loaded["b"] != old_b  # a new id: the old copy's prefix-cache blocks are never served
    # Offline, ``generate`` reads an unloaded adapter itself.
    assert engine.generate([PROMPT], GREEDY, lora_names="a")[0].outputs[0].token_ids == tokens_a
    reference = make_engine(tiny_llama_dir, [("a", folders[0])], max_loras=1)
    assert run(reference, "ref", "a") == tokens_a != tokens_b
    assert engine.block_manager.num_used_blocks == 0 and not engine.loras.in_use


def test_adapters_in_use_are_never_evicted(tiny_llama_dir: Path, folders: list[Path]) -> None:
    """An adapter of an unfinished request (running or waiting, or unloaded by name meanwhile) stays
    loaded; when every loaded adapter is in use, a load or a request for an unloaded adapter is
    refused with ``LoRALimitError`` naming --max-cpu-loras, and nothing is queued."""
    from servelm.scheduler.lora_registry import LoRALimitError

    engine = make_engine(
        tiny_llama_dir, [("z", folders[2]), ("a", folders[0]), ("b", folders[1])], max_loras=1, max_cpu_loras=2
    )
    assert set(engine.loras.loaded) == {"a", "b"}
    engine.add_request("ra", PROMPT, GREEDY, lora_name="a")
    engine.add_request("rb", PROMPT, GREEDY, lora_name="b")  # waits (max_loras=1) but holds "b"
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    with pytest.raises(LoRALimitError, match="--max-cpu-loras 2") as e:
        engine.loras.add("c", str(folders[2]))
    assert e.value.limit == 2
    assert "c" not in engine.loras.adapters
    with pytest.raises(LoRALimitError):
        engine.add_request("rz", PROMPT, GREEDY, lora_name="z", lora_adapter=engine.loras.read(str(folders[2])))
    assert engine.num_waiting == 1 and "rz" not in engine._groups
    engine.loras.remove("a")  # still computing "ra": it still counts
    with pytest.raises(LoRALimitError):
        engine.loras.add("c", str(folders[2]))
    assert len(engine.runner.lora_ids) == 2 == len(installed_ids(engine))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.lora_ids == {engine.loras.loaded["b"]}  # "a" went with its last request
    engine.loras.add("c", str(folders[2]))
    engine.add_request("rz", PROMPT, GREEDY, lora_name="z", lora_adapter=engine.loras.read(str(folders[2])))
    assert set(engine.loras.loaded) == {"c", "z"}  # "b", the least recently used, went
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0 and not engine.loras.in_use


def test_max_cpu_loras_must_cover_max_loras(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        make_engine(tiny_llama_dir, [], max_loras=2, max_cpu_loras=1)


def test_a_vanished_folder_fails_alone(tiny_llama_dir: Path, folders: list[Path], tmp_path: Path) -> None:
    """An unloaded adapter whose folder is gone: reading it again raises ``LoRAError``; the name stays
    served (until unloaded), and the other adapters and the base model are untouched."""
    gone = shutil.copytree(folders[0], tmp_path / "gone")
    engine = make_engine(tiny_llama_dir, [("gone", gone), ("b", folders[1])], max_loras=1)
    shutil.rmtree(gone)
    with pytest.raises(LoRAError, match="not a folder"):
        engine.generate([PROMPT], GREEDY, lora_names="gone")
    assert not engine.has_unfinished_requests() and not engine.loras.in_use
    assert run(engine, "rb", "b") and run(engine, "base", None)
    assert "gone" in engine.loras.adapters
    engine.loras.remove("gone")
    assert set(engine.loras.adapters) == {"b"}
