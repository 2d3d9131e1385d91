"""RoPE scaling as GGUF files carry it. Llama 3.1: llama.cpp's converter stores the scaling as
``rope_freqs.weight`` (one divisor per frequency), which transformers' GGUF loader drops. Gemma 3 4B
and larger: linear scaling of the global layers, as ``rope.scaling.type`` / ``rope.scaling.factor``.
Served from such a file, the model must compute what the source Hugging Face model computes, as
llama.cpp does.

The reference is transformers running the source folder; the file is written from it
(``gguf_models.write_tiny_gguf``: F32 weights, the divisors taken from transformers' own rotary
embedding). Without the scaling the logits differ: the control shows the test can fail.
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

# Second tier (docs/testing.md): each case's fixture writes a GGUF file and runs transformers on a wide tiny
# model, 6-7 s before its first test; marking one test of a case would only move that time to the other.
pytestmark = pytest.mark.slow

# original_max_position_embeddings small enough that the tiny model's 8 frequencies fall in all three
# of llama3's bands (kept, interpolated, divided by the factor) within the test's positions
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip


# Gemma 3's global layer (layer 5 of the tiny model) scaled linearly, its sliding layers not.
GEMMA3_LINEAR = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
CASES = {"llama3": ("llama", "llama", False, LLAMA3), "gemma3_linear": ("gemma3", "gemma3", True, GEMMA3_LINEAR)}


@pytest.fixture(scope="module", params=list(CASES))
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from servelm.runtime.gguf.folder import prepare_folder

    variant, arch, wide, rope = CASES[request.param]
    root = tmp_path_factory.mktemp(f"rope-{request.param}")
    hf_dir = save_tiny_model_for_gguf(variant, root / "hf", wide=wide, config={"rope_parameters": rope})
    (root / "file").mkdir()
    path = write_tiny_gguf(hf_dir, root / "file" / f"tiny-{request.param}.gguf", arch=arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    seqs = sequences(model.config.vocab_size)
    with torch.inference_mode():
        reference = [model(torch.tensor([s])).logits[0].float() for s in seqs]
    folder = prepare_folder(path, root / "prepared")
    return {"case": request.param, "folder": folder, "seqs": seqs, "reference": reference}


def scaling_of(config: dict[str, Any]) -> dict[str, Any]:
    """The scaling servelm reads from a prepared config.json (Gemma 3: its global layers')."""
    if "full_attention" in config.get("rope_parameters", {}):
        return config["rope_parameters"]["full_attention"]
    return config["rope_scaling"]


def test_the_file_carries_the_scaling_into_the_config(files: dict[str, Any]) -> None:
    scaling = scaling_of(json.loads((files["folder"] / "config.json").read_text()))
    if files["case"] == "gemma3_linear":
        assert scaling["rope_type"] == "linear" and scaling["factor"] == 8.0
        return
    assert scaling["rope_type"] == "per_frequency"
    factors = scaling["factors"]
    assert factors[0] == 1.0 and factors[-1] == pytest.approx(8.0) and any(1.0 < f < 8.0 for f in factors)


def test_served_as_stored_equals_the_source_model(files: dict[str, Any], build_runner, rt) -> None:
    runner = build_runner(files["folder"], num_blocks=8)
    assert_logits_match(run_ours(runner, rt, files["seqs"]), files["reference"], files["case"])


def test_without_the_scaling_the_logits_differ(files: dict[str, Any], build_runner, rt, tmp_path: Path) -> None:
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(files["folder"], plain)
    cfg = json.loads((plain / "config.json").read_text())
    scaling = scaling_of(cfg)
    for k in [k for k in scaling if k != "rope_theta"]:
        del scaling[k]
    cfg.pop("rope_scaling", None)
    (plain / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssertionError):
        assert_logits_match(
            run_ours(build_runner(plain, num_blocks=8), rt, files["seqs"]), files["reference"], "no scaling"
        )
