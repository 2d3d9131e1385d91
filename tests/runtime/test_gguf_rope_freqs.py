"""Llama 3.1 files: llama.cpp's converter stores the RoPE scaling as ``rope_freqs.weight`` (one divisor per
frequency), which transformers' GGUF loader drops. Served from such a file, the model must compute what
the source Hugging Face model (``rope_type: llama3``) computes, as llama.cpp does.

The reference is transformers running the source folder; the file is written from it
(``gguf_models.write_tiny_gguf``: F32 weights, the divisors taken from transformers' own rotary
embedding). Without the factors the logits differ: the control shows the test can fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_models import save_tiny_model_for_gguf, write_tiny_gguf
from test_gguf_vs_transformers import assert_logits_match, run_ours, sequences

transformers = pytest.importorskip("transformers")

# original_max_position_embeddings small enough that the tiny model's 8 frequencies fall in all three
# of llama3's bands (kept, interpolated, divided by the factor) within the test's positions
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from servelm.runtime.gguf.folder import prepare_folder

    root = tmp_path_factory.mktemp("rope-freqs")
    hf_dir = save_tiny_model_for_gguf("llama", root / "hf", config={"rope_parameters": LLAMA3})
    (root / "file").mkdir()
    path = write_tiny_gguf(hf_dir, root / "file" / "tiny-llama31.gguf", arch="llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    seqs = sequences(model.config.vocab_size)
    with torch.inference_mode():
        reference = [model(torch.tensor([s])).logits[0].float() for s in seqs]
    return {"folder": prepare_folder(path, root / "prepared"), "seqs": seqs, "reference": reference}


def test_the_file_carries_the_factors_into_the_config(files: dict[str, Any]) -> None:
    scaling = json.loads((files["folder"] / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "per_frequency"
    factors = scaling["factors"]
    assert factors[0] == 1.0 and factors[-1] == pytest.approx(8.0) and any(1.0 < f < 8.0 for f in factors)


def test_served_as_stored_equals_the_source_model(files: dict[str, Any], build_runner, rt) -> None:  # type: ignore[no-untyped-def]
    runner = build_runner(files["folder"], num_blocks=8)
    assert_logits_match(run_ours(runner, rt, files["seqs"]), files["reference"], "llama3 rope_freqs")


def test_without_the_factors_the_logits_differ(files: dict[str, Any], build_runner, rt, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(files["folder"], plain)
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["rope_scaling"]
    (plain / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssertionError):
        assert_logits_match(run_ours(build_runner(plain, num_blocks=8), rt, files["seqs"]), files["reference"], "no factors")
