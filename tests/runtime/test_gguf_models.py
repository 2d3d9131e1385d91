"""Tiny GGUF models of every architecture servelm serves from GGUF, in every block format it decodes,
written as llama.cpp's converter writes them (``gguf_models.write_tiny_gguf``) and checked against
transformers' GGUF loader as the reference: the config, every parameter (bit for bit against our
dequantizers and names, and close to the source weights), and the tokenizer (issue 22)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_models import (
    ALL_FORMATS,
    K_FORMATS,
    Case,
    conftest_module,
    gguf_tensor_name,
    quantize,
    save_tiny_model_for_gguf,
    tensor_format,
    write_tiny_gguf,
)

from servelm.runtime.config import ModelConfig
from servelm.runtime.gguf.names import (
    hf_config_from_gguf,
    hf_name,
    hf_tensor_names,
    needs_unpermute,
    norm_offset,
    unpermute,
    unpermute_heads,
)
from servelm.runtime.gguf.reader import read_gguf_tensors
from servelm.runtime.gguf.registry import dequantize

transformers = pytest.importorskip("transformers")


CASES: dict[str, Case] = {
    # llama.cpp's q/k row permutation over 32- and 256-element blocks alike; an untied head
    "llama_untied-q4_0-q4_1-q4_k-q6_k": Case(
        "llama_untied",
        "llama",
        True,
        {
            "attn_q": Q.Q4_0,
            "attn_k": Q.Q4_K,
            "attn_v": Q.Q6_K,
            "attn_output": Q.Q4_1,
            "ffn": Q.Q4_K,
            "token_embd": Q.Q8_0,
            "output": Q.Q6_K,
        },
    ),
    "mistral-q5_0-q5_1-f16-bf16": Case(
        "mistral", "llama", False, {"attn": Q.Q5_0, "ffn": Q.Q5_1, "token_embd": Q.F16, "output": Q.BF16}
    ),
    "qwen2-q8_0-bf16-f32": Case(
        "qwen2", "qwen2", False, {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "ffn": Q.BF16, "*": Q.F32}
    ),
    "qwen3-q5_k-q6_k-f16": Case(
        "qwen3", "qwen3", True, {"attn": Q.Q5_K, "ffn_down": Q.Q6_K, "ffn": Q.Q4_K, "token_embd": Q.F16}
    ),
    "gemma3-q5_k-q4_0-q8_0": Case(
        "gemma3", "gemma3", True, {"*": Q.Q5_K, "attn_output": Q.Q4_0, "ffn_up": Q.Q8_0, "token_embd": Q.Q6_K}
    ),
}
# transformers builds the tokenizer by ``tokenizer.ggml.model`` ("gpt2" here), whatever the architecture,
# and every file carries the same tokenizer keys: two architectures show it.
TOKENIZER_CASES = ["llama_untied-q4_0-q4_1-q4_k-q6_k", "gemma3-q5_k-q4_0-q8_0"]

# Largest relative RMS error (per tensor) of a stored format against the source float32 weights.
TOLERANCE = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 0.01, Q.Q5_0: 0.06, Q.Q5_1: 0.06, Q.Q4_0: 0.12,
    Q.Q4_1: 0.12, Q.Q4_K: 0.12, Q.Q5_K: 0.06, Q.Q6_K: 0.035,
}  # fmt: skip

CONFIG_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
)  # fmt: skip
TEXTS = [
    "Hello, world! How are you doing today?",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "def square(x: int) -> int:\n    return x ** 2  # 平方\n",
    "  leading spaces,\ttabs and émojis 🙂 <|im_start|>",
]


@pytest.fixture(scope="module", autouse=True)
def _plain_array_gguf_reader():
    """gguf-py's reader parses the 98k tokenizer strings through ``np.memmap`` slicing, ~3x slower than
    through a plain array; every file here carries the default vocabulary and is read ~5 times, so the
    reader gets the file's bytes as an in-memory array for this module (the parse is the same)."""
    import gguf.gguf_reader as gguf_reader

    fake_np = types.ModuleType("numpy_plain_map")
    fake_np.__dict__.update(np.__dict__)
    fake_np.memmap = lambda path, mode="r", **_: np.fromfile(path, dtype=np.uint8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_reader, "np", fake_np)
        yield


@dataclass
class Built:
    case: Case
    hf_dir: Path
    path: Path
    source_config: dict[str, Any]
    source_state: dict[str, torch.Tensor]
    config: dict[str, Any]  # transformers' config of the GGUF file
    state: dict[str, torch.Tensor]  # transformers' parameters of the GGUF file

    @functools.cached_property
    def names_config(self) -> dict[str, Any]:
        return hf_config_from_gguf(self.path)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """``built(case_id)``: the case's HF folder, its GGUF file, and transformers' load of that file (once)."""
    cache: dict[str, Built] = {}

    def get(case_id: str) -> Built:
        if case_id not in cache:
            case = CASES[case_id]
            root = tmp_path_factory.mktemp(case_id)
            hf_dir = save_tiny_model_for_gguf(case.variant, root / "hf", wide=case.wide)
            path = write_tiny_gguf(hf_dir, root / f"{case_id}.gguf", arch=case.arch, qtype=case.qtype)
            source = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(root), gguf_file=path.name, dtype=torch.float32
            )
            cache[case_id] = Built(
                case, hf_dir, path, source.config.to_dict(), _detached(source), model.config.to_dict(), _detached(model)
            )
        return cache[case_id]

    return get


def _detached(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta"), "rope_type": "default"}
    return {k: v for k, v in params.items() if k in ("rope_theta", "rope_type", "full_attention", "sliding_attention")}


def _assert_same_model_config(theirs: dict[str, Any], source: dict[str, Any], arch: str) -> None:
    for field in CONFIG_FIELDS:
        assert theirs[field] == source[field], field
    assert _head_dim(theirs) == _head_dim(source)
    assert theirs["rms_norm_eps"] == float(np.float32(source["rms_norm_eps"]))  # stored as float32
    assert _rope(theirs) == _rope(source)
    if arch == "gemma3":
        for field in ("sliding_window", "layer_types", "query_pre_attn_scalar"):
            assert theirs[field] == source[field], field


@pytest.mark.slow  # a GGUF file written and read back by transformers: 2-4 s a case (docs/testing.md)
@pytest.mark.parametrize("case_id", list(CASES))
def test_transformers_config_is_the_source_config(case_id: str, built: Callable[[str], Built]) -> None:
    b = built(case_id)
    _assert_same_model_config(b.config, b.source_config, b.case.arch)


@pytest.mark.slow  # a GGUF file written and read back by transformers: 2-4 s a case (docs/testing.md)
@pytest.mark.parametrize("case_id", list(CASES))
def test_names_config_agrees_with_transformers(case_id: str, built: Callable[[str], Built]) -> None:
    b = built(case_id)
    ours = b.names_config
    theirs = dict(b.config)
    for field in (*CONFIG_FIELDS, "rms_norm_eps"):
        assert ours[field] == theirs[field], field
    assert ours["head_dim"] == _head_dim(theirs)
    assert ours["rope_parameters"] == theirs["rope_parameters"]
    assert ours["model_type"] == theirs["model_type"]
    if b.case.arch == "gemma3":
        assert ours["sliding_window"] == theirs["sliding_window"]
        assert ours["query_pre_attn_scalar"] == theirs["query_pre_attn_scalar"]
    theirs["architectures"] = ours["architectures"]  # transformers' GGUF config names no class
    assert ModelConfig.from_hf_dict(ours) == ModelConfig.from_hf_dict(theirs)
    # and servelm reads the source folder's config as the same model (eps aside: the file holds float32;
    # the class aside: llama.cpp writes Mistral as llama)
    source = {**b.source_config, "rms_norm_eps": ours["rms_norm_eps"], "architectures": ours["architectures"]}
    assert ModelConfig.from_hf_dict(ours) == ModelConfig.from_hf_dict(source)


@pytest.mark.slow  # a GGUF file written and read back by transformers: 2-4 s a case (docs/testing.md)
@pytest.mark.parametrize("case_id", list(CASES))
def test_state_dict_is_our_dequantization_and_close_to_source(case_id: str, built: Callable[[str], Built]) -> None:
    """transformers' parameters equal our names + un-permutation + dequantizers bit for bit, and each
    stored tensor is within its format's error of the source weight."""
    b = built(case_id)
    arch = b.case.arch
    config = b.names_config
    tensors = read_gguf_tensors(b.path)
    names = hf_tensor_names(list(tensors), arch)
    expected_names = set(names.values()) | ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert expected_names == set(b.state) == set(b.source_state)
    for gguf_name, name in names.items():
        tensor = tensors[gguf_name]
        assert tensor.qtype == tensor_format(gguf_name, tensor.shape, b.case.qtype), gguf_name
        assert gguf_tensor_name(name, arch) == gguf_name
        values = dequantize(tensor) + norm_offset(gguf_name, arch)
        if needs_unpermute(name, arch):
            values = unpermute(values, unpermute_heads(name, config))
        assert torch.equal(values, b.state[name]), name
        source = b.source_state[name]
        error = (values - source).pow(2).mean().sqrt() / source.pow(2).mean().sqrt()
        bound = TOLERANCE[tensor.qtype] if norm_offset(gguf_name, arch) == 0 else 1e-6  # (1 + w) - 1 rounds
        assert error <= bound, (name, tensor.qtype.name, float(error))
    if config["tie_word_embeddings"]:
        assert torch.equal(b.state["lm_head.weight"], b.state["model.embed_tokens.weight"])


@pytest.mark.slow  # a GGUF file written and read back by transformers: 2-4 s a case (docs/testing.md)
@pytest.mark.parametrize("case_id", TOKENIZER_CASES)
def test_tokenizer_is_the_default_models(case_id: str, built: Callable[[str], Built]) -> None:
    from servelm.runtime.model_files import ensure_default_model

    b = built(case_id)
    ours = transformers.AutoTokenizer.from_pretrained(str(b.path.parent), gguf_file=b.path.name)
    ref = transformers.AutoTokenizer.from_pretrained(str(ensure_default_model()))
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"]) == text
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.chat_template == ref.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_cases_cover_every_architecture_and_format() -> None:
    assert {c.arch for c in CASES.values()} == {"llama", "qwen2", "qwen3", "gemma3"}
    assert {c.variant for c in CASES.values()} == {"llama_untied", "mistral", "qwen2", "qwen3", "gemma3"}
    assert {q for c in CASES.values() for q in c.qtype.values()} == set(ALL_FORMATS)


@pytest.mark.parametrize("qtype", K_FORMATS, ids=lambda q: q.name)
def test_k_quantizers_make_valid_close_blocks(qtype: Q) -> None:
    """Our K-quant packers: gguf-py decodes them exactly as our dequantizers do, close to the input,
    and edge rows (zeros, one sign, constants, large and tiny scales) come back sensibly."""
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((40, 512)).astype(np.float32) * rng.uniform(0.001, 30.0, (40, 1)).astype(np.float32)
    x[0] = 0.0
    x[1] = np.abs(x[1])
    x[2] = -np.abs(x[2])
    x[3] = 0.25
    x[4, :256] = 0.0  # one zero super-block next to a normal one
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (40, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
    ours = dequantize((torch.from_numpy(raw.copy()).reshape(-1), qtype, x.shape)).numpy()
    theirs = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.all(ours[0] == 0.0) and np.all(ours[4, :256] == 0.0)
    if qtype != Q.Q6_K:  # the offset formats hold a constant row up to fp16 rounding of their scales
        np.testing.assert_allclose(ours[3], 0.25, rtol=2e-3)
    error = np.sqrt(np.mean((ours - x) ** 2, axis=1)) / np.sqrt(np.mean(x**2, axis=1) + 1e-30)
    assert np.all(error[1:] <= TOLERANCE[qtype] * 0.8), error.max()


def test_format_choice_by_name() -> None:
    spec = {"attn": Q.Q4_0, "attn_output": Q.Q8_0, "output": Q.Q6_K, "*": Q.F16}
    assert tensor_format("blk.0.attn_q.weight", (64, 64), spec) == Q.Q4_0
    assert tensor_format("blk.0.attn_output.weight", (64, 64), spec) == Q.Q8_0  # exact part beats substring
    assert tensor_format("output.weight", (64, 64), spec) == Q.Q6_K
    assert tensor_format("blk.0.ffn_up.weight", (64, 64), spec) == Q.F16
    assert tensor_format("blk.0.attn_norm.weight", (64,), spec) == Q.F32
    assert tensor_format("blk.0.attn_q.bias", (64,), spec) == Q.F32
    assert tensor_format("blk.0.ffn_up.weight", (64, 64), Q.Q5_1) == Q.Q5_1
    assert tensor_format("blk.0.ffn_up.weight", (64, 64), {"attn": Q.Q4_0}) == Q.F32
    with pytest.raises(ValueError):
        quantize(np.zeros((4, 64), np.float32), Q.Q4_K)  # 64 is not a whole 256-element super-block


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tensor_names_invert_names_py(arch: str) -> None:
    hf_names = [
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.bias",
        "model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight",
        "model.layers.3.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight",
    ]  # fmt: skip
    if arch in ("qwen3", "gemma3"):
        hf_names += ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"]
    if arch == "gemma3":
        hf_names += [
            "model.layers.1.pre_feedforward_layernorm.weight",
            "model.layers.1.post_feedforward_layernorm.weight",
        ]
    for name in hf_names:
        assert hf_name(gguf_tensor_name(name, arch), arch) == name


def test_unrepresentable_configs_are_refused(tmp_path: Path) -> None:
    """conftest's own gemma3 (query_pre_attn_scalar 24, a global middle layer) and qwen3 (head_dim 16)
    would load from GGUF as other models: the converter refuses them rather than write a wrong file."""
    conftest = conftest_module()
    for variant, arch in (("gemma3", "gemma3"), ("qwen3", "qwen3"), ("mistral_window", "llama")):
        cfg_name, extra = conftest.TINY_VARIANTS[variant]
        folder = tmp_path / variant
        folder.mkdir()
        getattr(transformers, cfg_name)(**{**conftest.TINY_SHAPES, **extra}).to_json_file(str(folder / "config.json"))
        with pytest.raises(ValueError, match="not representable"):
            write_tiny_gguf(folder, tmp_path / f"{variant}.gguf", arch=arch)
    with pytest.raises(ValueError):
        write_tiny_gguf(folder, tmp_path / "x.gguf", arch="qwen2")  # mistral is written as llama


def test_non_strict_writes_what_llama_cpp_would(tmp_path: Path) -> None:
    """conftest's qwen3 (head_dim 16 of hidden 64) as llama.cpp writes it: names.py reads the head dim from
    ``attention.key_length`` (transformers would take 128), and the weights come back exactly (F32)."""
    hf_dir = conftest_module().save_tiny_model("qwen3", tmp_path / "hf")
    path = write_tiny_gguf(hf_dir, tmp_path / "qwen3.gguf", arch="qwen3", strict=False)
    config = hf_config_from_gguf(path)
    assert (config["head_dim"], config["hidden_size"], config["num_attention_heads"]) == (16, 64, 4)
    tensors = read_gguf_tensors(path)
    from safetensors.torch import load_file

    source = load_file(str(hf_dir / "model.safetensors"))
    for gguf_name, name in hf_tensor_names(list(tensors), "qwen3").items():
        assert torch.equal(dequantize(tensors[gguf_name]), source[name]), name
