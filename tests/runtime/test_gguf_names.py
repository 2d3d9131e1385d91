"""A GGUF file read as a Hugging Face checkpoint by us gives exactly what transformers' GGUF loader gives:
the same config fields, the same tensor names and the same values once llama.cpp's q/k row permutation
is undone, and that un-permutation moves whole rows, so it applies to raw quantized blocks (issue 22)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from servelm.runtime.config import ModelConfig
from servelm.runtime.gguf.names import (
    hf_config_from_gguf,
    hf_name,
    hf_tensor_names,
    needs_unpermute,
    norm_offset,
    unpermute,
    unpermute_heads,
    unpermute_rows,
)
from servelm.runtime.gguf.reader import read_gguf_tensors
from servelm.runtime.gguf.registry import BLOCK_LAYOUT, dequantize

transformers = pytest.importorskip("transformers")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, CONTEXT = 64, 2, 4, 2, 96, 64, 128
HEAD_DIM = HIDDEN // HEADS
BOS, EOS = 3, 5  # not LlamaConfig's defaults (1, 2), so a match means transformers read them from the file
Q8_TENSOR = "blk.1.attn_q.weight"  # stored as Q8_0: un-permuting must work on raw blocks too
CONFIG_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
    "bos_token_id", "eos_token_id",
)  # fmt: skip


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``: HF's half-split RoPE rows to interleaved pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _write_header(writer: gguf.GGUFWriter, arch: str, *, vocab: int = VOCAB, head_dim: int | None = None) -> None:
    """The metadata llama.cpp's converter writes for a llama-family model, with a tiny SentencePiece vocabulary."""
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50000.0)
    if arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_weights(seed: int) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face's layout, keyed by GGUF name (the test's own name table)."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF file as llama.cpp's converter writes one: q/k rows permuted, one tensor Q8_0."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_header(writer, "llama")
    for name, w in _hf_weights(seed=0).items():
        if ".attn_q." in name:
            w = llama_cpp_permute(w, HEADS)
        elif ".attn_k." in name:
            w = llama_cpp_permute(w, KV_HEADS)
        if name == Q8_TENSOR:
            writer.add_tensor(name, gguf.quants.quantize(w, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, w)
    _finish(writer)
    return path


@pytest.fixture(scope="module")
def transformers_state(llama_gguf: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(llama_gguf.parent), gguf_file=llama_gguf.name, dtype=torch.float32
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _transformers_config(path: Path) -> dict[str, Any]:
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    return config.to_dict()


def _assert_config_matches(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    # Configs without a head_dim field (Qwen2) derive it as transformers' models do.
    theirs = {"head_dim": theirs["hidden_size"] // theirs["num_attention_heads"], **theirs}
    for field in CONFIG_FIELDS:
        assert ours[field] == theirs[field], field
    assert ours["rope_parameters"] == theirs["rope_parameters"]
    assert ours["rope_theta"] == 50000.0
    assert ours["model_type"] == theirs["model_type"]


def test_llama_config_matches_transformers(llama_gguf: Path) -> None:
    ours = hf_config_from_gguf(llama_gguf)
    _assert_config_matches(ours, _transformers_config(llama_gguf))
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert (ours["bos_token_id"], ours["eos_token_id"], ours["tie_word_embeddings"]) == (BOS, EOS, False)
    assert ours["rope_theta"] == 50000.0 and ours["num_key_value_heads"] == KV_HEADS


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_config_matches_transformers_per_architecture(arch: str, tmp_path: Path) -> None:
    """Metadata-only files (tied embeddings: no ``output.weight``) of each mapped architecture."""
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    # A head_dim other than hidden / heads shows it was read from key_length, not derived. transformers
    # reads key_length for gemma3 only and takes Qwen3Config's default 128 for qwen3, so qwen3 gets 128;
    # gemma3 gets 256, the head dim of its released sizes, which transformers' query_pre_attn_scalar assumes.
    head_dim = {"qwen3": 128, "gemma3": 256}.get(arch)
    _write_header(writer, arch, vocab=48, head_dim=head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(16)
    writer.add_tensor("token_embd.weight", np.zeros((48, HIDDEN), np.float32))
    _finish(writer)
    ours = hf_config_from_gguf(path)
    theirs = _transformers_config(path)
    _assert_config_matches(ours, theirs)
    assert ours["tie_word_embeddings"] is True and ours["vocab_size"] == 48
    if head_dim is not None:
        assert ours["head_dim"] == head_dim
    # servelm's own model config comes out the same from either dict
    theirs["architectures"] = ours["architectures"]  # transformers' GGUF config names no class
    assert ModelConfig.from_hf_dict(ours) == ModelConfig.from_hf_dict(theirs)
    if arch == "gemma3":
        assert ours["sliding_window"] == theirs["sliding_window"] == 16


def test_state_dict_matches_transformers(llama_gguf: Path, transformers_state: dict[str, torch.Tensor]) -> None:
    """Our names + un-permutation + dequantizers reproduce transformers' loaded parameters bit for bit."""
    config = hf_config_from_gguf(llama_gguf)
    tensors = read_gguf_tensors(llama_gguf)
    assert tensors[Q8_TENSOR].qtype == Q.Q8_0
    names = hf_tensor_names(list(tensors), "llama")
    assert sorted(names.values()) == sorted(transformers_state)
    for gguf_name, name in names.items():
        values = dequantize(tensors[gguf_name])
        if needs_unpermute(name, "llama"):
            values = unpermute(values, unpermute_heads(name, config))
        assert torch.equal(values, transformers_state[name]), name


def test_q_k_weights_come_back_in_hf_order(llama_gguf: Path) -> None:
    """Un-permuting what the converter permuted gives the original HF float weights (F32 tensors)."""
    original = _hf_weights(seed=0)
    tensors = read_gguf_tensors(llama_gguf)
    for gguf_name, heads in (("blk.0.attn_q.weight", HEADS), ("blk.0.attn_k.weight", KV_HEADS)):
        restored = unpermute(dequantize(tensors[gguf_name]), heads)
        assert torch.equal(restored, torch.from_numpy(original[gguf_name]))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.F16])
@pytest.mark.parametrize("n_head", [1, 2, 8])
def test_row_permutation_applies_to_raw_blocks(qtype: Q, n_head: int) -> None:
    """Permuting raw block rows then dequantizing equals dequantizing then un-permuting: no decode needed."""
    n_out, n_in = n_head * 32, 256
    rng = np.random.default_rng(n_head)
    stored = llama_cpp_permute(rng.standard_normal((n_out, n_in)).astype(np.float32), n_head)
    raw = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(stored, qtype)).view(np.uint8).copy())
    raw_rows = raw.reshape(n_out, -1)  # one row of blocks per output feature
    assert raw_rows.shape[1] == n_in // BLOCK_LAYOUT[qtype][0] * BLOCK_LAYOUT[qtype][1]
    shape = (n_out, n_in)
    reordered_raw = dequantize((unpermute(raw_rows, n_head), qtype, shape))
    reordered_values = unpermute(dequantize((raw_rows, qtype, shape)), n_head)
    assert torch.equal(reordered_raw, reordered_values)


@pytest.mark.parametrize("n_out,n_head", [(64, 4), (32, 2), (128, 1), (48, 3)])
def test_unpermute_rows_is_transformers_reverse_permute(n_out: int, n_head: int) -> None:
    """The row index equals transformers' own ``_reverse_permute_weights`` and inverts llama.cpp's permute."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(n_out * 3, dtype=np.float32).reshape(n_out, 3)
    theirs = LlamaTensorProcessor()._reverse_permute_weights(rows, n_head)
    index = unpermute_rows(n_out, n_head)
    assert index.dtype == torch.int64 and sorted(index.tolist()) == list(range(n_out))
    assert np.array_equal(rows[index.numpy()], theirs)
    assert np.array_equal(llama_cpp_permute(rows, n_head)[index.numpy()], rows)
    bias = torch.arange(n_out, dtype=torch.float32)  # biases (1-D) move the same way
    assert torch.equal(unpermute(torch.from_numpy(llama_cpp_permute(bias.numpy(), n_head)), n_head), bias)


def test_unpermute_rows_rejects_rows_that_are_not_head_pairs() -> None:
    with pytest.raises(ValueError):
        unpermute_rows(30, 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_names_match_transformers_gguf_map(arch: str) -> None:
    """Every GGUF name transformers maps for a tiny model of ``arch`` maps to the same HF name here."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    kwargs = dict(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model_type = "gemma3_text" if arch == "gemma3" else arch
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = get_gguf_hf_weights_map(model, TensorProcessor(), model_type=arch)
    # transformers also maps the HF names it walks through submodules; keep the full names only
    theirs = {g: h for g, h in theirs.items() if h in model.state_dict()}
    assert any(".attn_q." in g for g in theirs) and "token_embd.weight" in theirs
    for gguf_name, name in theirs.items():
        assert hf_name(gguf_name, arch) == name, gguf_name
    # every checkpoint parameter of the model has a GGUF name we map
    assert sorted(theirs.values()) == sorted(k for k in model.state_dict() if "rotary" not in k)


@pytest.mark.parametrize(
    "gguf_name",
    [
        "blk.0.attn_norm.weight",
        "blk.1.post_ffw_norm.weight",
        "output_norm.weight",
        "blk.0.attn_q_norm.weight",
        "blk.0.ffn_up.weight",
    ],
)
def test_gemma3_norm_offset_is_transformers(gguf_name: str) -> None:
    """llama.cpp stores Gemma 3's norms as 1 + w; the offset we apply is the one transformers applies."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    stored = np.linspace(0.5, 2.0, 8, dtype=np.float32)
    theirs = TENSOR_PROCESSORS["gemma3"]().process(weights=stored, name=gguf_name).weights
    assert np.array_equal(stored + np.float32(norm_offset(gguf_name, "gemma3")), theirs)
    assert norm_offset(gguf_name, "llama") == 0.0


def test_needs_unpermute_only_llama_q_and_k() -> None:
    assert needs_unpermute("model.layers.0.self_attn.q_proj.weight", "llama")
    assert needs_unpermute("model.layers.3.self_attn.k_proj.weight", "llama")
    assert not needs_unpermute("model.layers.0.self_attn.v_proj.weight", "llama")
    assert not needs_unpermute("model.layers.0.self_attn.q_proj.weight", "qwen2")  # NEOX RoPE: stored as HF
    config = {"num_attention_heads": 8, "num_key_value_heads": 2}
    assert unpermute_heads("model.layers.0.self_attn.q_proj.weight", config) == 8
    assert unpermute_heads("model.layers.0.self_attn.k_proj.weight", config) == 2


def test_unknown_names_and_architectures_raise() -> None:
    with pytest.raises(KeyError):
        hf_name("blk.0.ffn_gate_exps.weight", "llama")
    with pytest.raises(KeyError):
        hf_name("token_embd.weight", "falcon")
    assert hf_tensor_names(["rope_freqs.weight", "output.weight"], "llama") == {"output.weight": "lm_head.weight"}
    assert hf_name("blk.7.ffn_norm.weight", "gemma3") == "model.layers.7.pre_feedforward_layernorm.weight"
    assert hf_name("blk.7.attn_q.bias", "qwen2") == "model.layers.7.self_attn.q_proj.bias"
