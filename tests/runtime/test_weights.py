"""Weight loading by name mapping: single and sharded folders, fused shards, clear errors."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from servelm.runtime.config import ModelConfig, UnsupportedModelError
from servelm.runtime.cpu.torch_backend import TorchAttentionBackend
from servelm.runtime.weights import INDEX_FILE, WeightLoadError, checkpoint_files, load_model


def load(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model(model_dir, ModelConfig.from_dir(model_dir), TorchAttentionBackend(16), dtype=dtype, device="cpu")


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as g:
            for k in g.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
                tensors[k] = g.get_tensor(k)
    return tensors


def rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of single-file folder ``src`` whose tensors went through ``edit``."""
    shutil.copytree(src, dst)
    tensors = checkpoint(src)
    edit(tensors)
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_fused_parameters_hold_their_checkpoint_shards(tiny_llama_dir: Path) -> None:
    model = load(tiny_llama_dir)
    ckpt = checkpoint(tiny_llama_dir)
    attn = model.model.layers[1].self_attn
    expected_qkv = torch.cat([ckpt[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    mlp = model.model.layers[2].mlp
    expected_gu = torch.cat([ckpt[f"model.layers.2.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, expected_gu)
    assert torch.equal(model.model.norm.weight, ckpt["model.norm.weight"])
    # Tied: the head is the embedding itself, not a copy.
    assert model.lm_head_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_sharded_folder_loads_the_same_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / INDEX_FILE).is_file()
    assert len(checkpoint_files(sharded)) > 3
    a, b = load(tiny_llama_dir), load(sharded)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name


def test_untied_head_is_loaded(tiny_llama_untied_dir: Path) -> None:
    model = load(tiny_llama_untied_dir)
    ckpt = checkpoint(tiny_llama_untied_dir)
    assert torch.equal(model.lm_head_weight, ckpt["lm_head.weight"])
    assert not torch.equal(model.lm_head_weight, model.model.embed_tokens.weight)


def test_qwen2_biases_land_in_the_fused_bias(tiny_model_dir: Callable[[str], Path]) -> None:
    d = tiny_model_dir("qwen2")
    model = load(d)
    ckpt = checkpoint(d)
    expected = torch.cat([ckpt[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.bias, expected)
    assert model.model.layers[0].self_attn.o_proj.bias is None


def test_loads_into_another_dtype(tiny_llama_dir: Path) -> None:
    model = load(tiny_llama_dir, dtype=torch.bfloat16)
    ckpt = checkpoint(tiny_llama_dir)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"].to(torch.bfloat16))


def test_stored_tied_head_is_ignored(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def add_head(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    model = load(rewrite(tiny_llama_dir, tmp_path / "m", add_head))
    assert model.lm_head_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_missing_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = rewrite(tiny_llama_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing.*model\.layers\.1\.self_attn\.qkv_proj\.weight \[k\]"):
        load(d)


def test_unexpected_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    with pytest.raises(WeightLoadError, match=r"no place for: model\.layers\.0\.mlp\.extra_proj\.weight"):
        load(rewrite(tiny_llama_dir, tmp_path / "m", add))


def test_wrong_shape_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.2.mlp.up_proj.weight"][:-1].clone()

    with pytest.raises(WeightLoadError, match=r"up_proj\.weight has shape \(127, 64\), expected \(128, 64\)"):
        load(rewrite(tiny_llama_dir, tmp_path / "m", shrink))


def test_folder_without_weights_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", d / "config.json")
    with pytest.raises(UnsupportedModelError, match=r"no \*\.safetensors"):
        load(d)


def test_smollm3_and_granite_configs_read_what_transformers_reads(tiny_model_dir: Callable[[str], Path]) -> None:
    smol = ModelConfig.from_dir(tiny_model_dir("smollm3"))
    assert smol.nope_layers == (1,) and smol.rope_theta == 2000000.0  # interval 2 over 3 layers
    assert ModelConfig.from_hf_dict(
        {**_llama_dict(), "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8}
    ).nope_layers == (3, 7)
    flags = {"architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 3, "no_rope_layers": [0, 1, 0]}
    assert ModelConfig.from_hf_dict({**_llama_dict(), **flags}).nope_layers == (0, 2)
    g = ModelConfig.from_dir(tiny_model_dir("granite"))
    assert (g.embedding_multiplier, g.attention_multiplier, g.residual_multiplier, g.logits_scaling) == (
        12.0,
        0.015625,
        0.22,
        8.0,
    )
    plain = ModelConfig.from_hf_dict({**_llama_dict(), "embedding_multiplier": 5.0, "logits_scaling": 3.0})
    assert (plain.embedding_multiplier, plain.attention_multiplier, plain.logits_scaling, plain.nope_layers) == (
        1.0,
        None,
        1.0,
        (),
    )


def _llama_dict() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2}  # fmt: skip


def test_gemma3_config_in_both_transformers_layouts(tiny_model_dir: Callable[[str], Path]) -> None:
    five = ModelConfig.from_dir(tiny_model_dir("gemma3"))  # transformers 5: rope_parameters per layer type
    assert (five.rope_theta, five.local_rope, five.window_layers, five.sliding_window) == (
        1e6,
        (10000.0, None),
        (0, 2),
        16,
    )
    assert five.qk_norm and five.gemma_norms and five.sandwich_norms and five.hidden_act == "gelu_tanh"
    assert five.attention_multiplier == 24**-0.5 and five.embedding_multiplier == 64**0.5
    # transformers 4 (the Hub's gemma-3-1b-it): flat rope fields, a window pattern instead of layer_types
    four = {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 12, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
    }  # fmt: skip
    c = ModelConfig.from_hf_dict(four)
    assert c.window_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and c.sliding_window == 512
    assert (c.rope_theta, c.rope_scaling, c.local_rope) == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
        (10000.0, None),
    )
    for bad in (
        {"final_logit_softcapping": 30.0},
        {"attn_logit_softcapping": 50.0},
        {"use_bidirectional_attention": True},
    ):
        with pytest.raises(UnsupportedModelError):
            ModelConfig.from_hf_dict({**four, **bad})
    with pytest.raises(UnsupportedModelError, match="activation"):
        ModelConfig.from_hf_dict({**four, "hidden_activation": "relu"})


def test_gemma3_is_refused_on_cuda_before_touching_it(tiny_model_dir: Callable[[str], Path]) -> None:
    from servelm.runtime.runner import ModelRunner

    d = tiny_model_dir("gemma3")
    with pytest.raises(UnsupportedModelError, match="CPU only"):
        ModelRunner(d, ModelConfig.from_dir(d), device=torch.device("cuda"), dtype=torch.bfloat16, block_size=16,
                    num_blocks=4, max_num_batched_tokens=64, max_num_seqs=4)  # fmt: skip
