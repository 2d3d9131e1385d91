"""A GGUF file served as stored: no float32 copy on disk, projections over the file's own memory map,
and the same logits as the dequantized model (which is what transformers loads from the file)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from servelm.runtime.gguf.folder import folder_is_current, gguf_source, stored_weight_bytes
from servelm.runtime.gguf.loader import GGUFLoadError
from servelm.runtime.gguf.projection import GGUFEmbedding, GGUFMethod, GGUFShardedMethod
from servelm.runtime.model_files import default_gguf_file, default_model_dir, resolve_model_path
from servelm.runtime.models.layers import Linear

pytestmark = pytest.mark.slow  # the default model's GGUF file


@pytest.fixture(scope="module")
def gguf_folder() -> Path:
    return resolve_model_path(str(default_gguf_file()))


@pytest.fixture(scope="module")
def stored_runner(build_runner, gguf_folder: Path):
    return build_runner(gguf_folder, num_blocks=64)


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from ``path`` (/proc/self/maps)."""
    ranges = []
    target = str(path.resolve())
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == target:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def test_prepared_folder_holds_no_weights_and_is_reused(gguf_folder: Path) -> None:
    files = {p.name: p.stat().st_size for p in gguf_folder.iterdir()}
    assert not [n for n in files if n.endswith((".safetensors", ".bin", ".pt"))], files
    assert sum(files.values()) < 16 * 2**20, f"the prepared folder holds {sum(files.values())} bytes: {files}"
    assert gguf_source(gguf_folder) == default_gguf_file().resolve()
    start = time.perf_counter()
    assert resolve_model_path(str(default_gguf_file())) == gguf_folder
    assert time.perf_counter() - start < 1.0, "a second start must not parse the file again"


def test_a_changed_file_makes_the_folder_stale(gguf_folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(default_gguf_file().read_bytes())
    folder = tmp_path / "prepared"
    folder.mkdir()
    for f in gguf_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    source = json.loads((folder / "gguf.json").read_text())
    st = copy.stat()
    source.update(path=str(copy), size=st.st_size, mtime_ns=st.st_mtime_ns)
    (folder / "gguf.json").write_text(json.dumps(source))
    assert folder_is_current(folder)
    os.utime(copy, ns=(st.st_mtime_ns + 10**9, st.st_mtime_ns + 10**9))
    assert not folder_is_current(folder)


def test_quantized_weights_are_views_of_the_file(stored_runner, gguf_folder: Path) -> None:
    model = stored_runner.model
    assert stored_runner.weights_as_stored
    mapped = file_mappings(gguf_source(gguf_folder))
    assert mapped, "the GGUF file is not memory-mapped"

    def in_file(t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return any(lo <= ptr < hi for lo, hi in mapped)

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.method.parts.stored is not None for m in linears)
    methods: list[GGUFMethod] = []
    for m in linears:
        methods += (
            [part for _, part in m.method.parts.stored.parts]
            if isinstance(m.method.parts.stored, GGUFShardedMethod)
            else [m.method.parts.stored]
        )
    # llama.cpp permuted q and k rows: those two are copies in HF row order; everything else is the file.
    q_k = {
        id(m.method.parts.stored.parts[i][1])
        for m in linears
        if isinstance(m.method.parts.stored, GGUFShardedMethod) and len(m.method.parts.stored.parts) == 3
        for i in (0, 1)
    }
    assert all(in_file(meth.blocks) for meth in methods if id(meth) not in q_k)
    assert isinstance(model.stored_embedding, GGUFEmbedding) and in_file(model.stored_embedding.tensor.raw)
    assert model.model.embed_tokens.weight.numel() == 0  # no dense embedding alongside
    assert model.head_method.parts.stored is model.stored_embedding.head  # tied: the head reads the embedding's blocks


def test_logits_equal_the_dequantized_model(stored_runner, build_runner, rt) -> None:
    # The float32 folder is transformers' own dequantization of this file (runtime.model_files).
    reference = build_runner(default_model_dir(), num_blocks=64)
    steps = [[0, 1, 2], [0, 2], [1]]
    ours = rt.prefill_then_decode(stored_runner, [13, 7, 10], steps)
    theirs = rt.prefill_then_decode(reference, [13, 7, 10], steps)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-4 * theirs.abs().max().item())
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_quantization_none_dequantizes_into_dense_weights(build_runner, gguf_folder: Path, rt) -> None:
    dense = build_runner(gguf_folder, num_blocks=64, quantization="none")
    assert not dense.weights_as_stored
    assert all(m.method.parts.stored is None for m in dense.model.modules() if isinstance(m, Linear))
    reference = build_runner(default_model_dir(), num_blocks=64)
    a = rt.prefill_then_decode(dense, [9], [[0]])
    b = rt.prefill_then_decode(reference, [9], [[0]])
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item())


def test_a_file_that_does_not_fit_the_model_is_refused(build_runner, gguf_folder: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in gguf_folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the file has one layer fewer than this config
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFLoadError, match=r"missing from the file: model\.layers\.30"):
        build_runner(broken, num_blocks=8)


def test_weight_bytes_are_the_files_tensors(stored_runner, gguf_folder: Path) -> None:
    stored = stored_weight_bytes(gguf_folder)
    size = default_gguf_file().stat().st_size
    assert stored is not None and 0.9 * size < stored < size, (stored, size)  # the rest is metadata
    # What a decode step reads: every tensor once (the tied head is the embedding), nothing dense besides.
    assert abs(stored_runner.weight_bytes - stored) < 0.001 * stored, (stored_runner.weight_bytes, stored)
