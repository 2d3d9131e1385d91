"""nomic-embed-text-v1.5 (F16 GGUF) against transformers' own ``NomicBertModel``: the file's tensors read with
gguf-py, mapped by name onto transformers' modules, its configuration from the file's metadata, and
sentence-transformers' pooling for this model (mean over the attention mask, then L2 normalise) on the
same token ids; servelm's embeddings equal it to cosine >= 0.9999 on varied texts with nomic's prefixes.

The tokenizer and a document at the 2,048-token limit are checked against llama.cpp in the second tier
(test_encoder_gguf.py); this module keeps to short texts so that it stays in the first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from encoder_cases import TEXTS, cosines

from servelm.runtime.model_fetch import ensure
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.encoder_engine import EncoderEngine

# Every text once, half with each of nomic's task prefixes (the model was trained with them).
PREFIXED = [f"search_query: {t}" for t in TEXTS[:5]] + [f"search_document: {t}" for t in TEXTS[5:]]


@pytest.fixture(scope="module")
def nomic() -> Path:
    return ensure("nomic")


@pytest.fixture(scope="module")
def engine(nomic: Path) -> EncoderEngine:
    return EncoderEngine(EngineConfig(model=str(nomic), max_num_seqs=16))


def gguf_onto_nomic_bert(path: Path) -> tuple[Any, dict[str, torch.Tensor], set[str]]:
    """transformers' config and state dict for the GGUF file, and the names of the file's tensors it left out."""
    from gguf import GGUFReader
    from transformers import NomicBertConfig

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str) -> Any:
        return reader.fields[f"{arch}.{key}"].contents()

    tensors = {t.name: torch.from_numpy(np.array(t.data)).float() for t in reader.tensors}
    cfg = NomicBertConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=meta("embedding_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=meta("attention.head_count"),
        intermediate_size=meta("feed_forward_length"),
        max_position_embeddings=meta("context_length"),
        layer_norm_eps=meta("attention.layer_norm_epsilon"),
        type_vocab_size=reader.fields["tokenizer.ggml.token_type_count"].contents(),
        rope_parameters={"rope_type": "default", "rope_theta": meta("rope.freq_base")},
        hidden_act="silu",
    )
    used: set[str] = set()

    def t(name: str) -> torch.Tensor:
        used.add(name)
        return tensors[name]

    state = {
        "embeddings.word_embeddings.weight": t("token_embd.weight"),
        "embeddings.token_type_embeddings.weight": t("token_types.weight"),
        "embeddings.LayerNorm.weight": t("token_embd_norm.weight"),
        "embeddings.LayerNorm.bias": t("token_embd_norm.bias"),
    }
    for i in range(cfg.num_hidden_layers):
        b, h = f"blk.{i}.", f"layers.{i}."
        # llama.cpp's converter writes nomic's fused Wqkv as attn_qkv, fc11 as ffn_up and fc12 as ffn_gate;
        # transformers' conversion maps Wqkv to q/k/v by thirds, fc11 to up_proj and fc12 to gate_proj.
        q, k, v = t(b + "attn_qkv.weight").chunk(3)
        state |= {
            h + "self_attn.q_proj.weight": q,
            h + "self_attn.k_proj.weight": k,
            h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": t(b + "attn_output.weight"),
            h + "mlp.up_proj.weight": t(b + "ffn_up.weight"),
            h + "mlp.gate_proj.weight": t(b + "ffn_gate.weight"),
            h + "mlp.down_proj.weight": t(b + "ffn_down.weight"),
        }
        for p in ("weight", "bias"):
            state[h + f"post_attention_layernorm.{p}"] = t(b + f"attn_output_norm.{p}")
            state[h + f"post_mlp_layernorm.{p}"] = t(b + f"layer_output_norm.{p}")
    return cfg, state, set(tensors) - used


@pytest.fixture(scope="module")
def reference(nomic: Path) -> Any:
    """transformers' NomicBertModel holding the GGUF file's weights (loaded strictly: every name and shape)."""
    from transformers import NomicBertModel
    from transformers.initialization import no_init_weights

    cfg, state, unused = gguf_onto_nomic_bert(nomic)
    with no_init_weights():  # every weight is assigned below: skip the random initialisation of 137M
        model = NomicBertModel(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), unused


def st_mean_normalize(model: Any, ids: list[list[int]]) -> torch.Tensor:
    """sentence-transformers' Pooling(mean) + Normalize over a padded batch with its attention mask."""
    longest = max(map(len, ids))
    pad = model.config.pad_token_id
    input_ids = torch.tensor([s + [pad] * (longest - len(s)) for s in ids])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in ids])
    with torch.inference_mode():
        hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    m = mask[..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def test_reads_the_files_metadata(engine: EncoderEngine) -> None:
    enc = engine.encoder
    assert enc.config.architecture == "nomic-bert" and enc.config.rope_theta == 1000.0 and enc.config.gated
    assert (enc.pooling.mode, enc.pooling.normalize, enc.pooling.max_seq_length) == ("mean", True, 2048)
    assert enc.pooling.matryoshka is not None and 256 in enc.pooling.matryoshka
    assert engine.max_model_len == 2048 and engine.dimensions == 768
    # The file's float16 matrices are held as stored (half the bytes of float32), its norms in float32.
    assert enc.model.layers[0].qkv.weight.dtype == torch.float16 and enc.model.embed.weight.dtype == torch.float16
    assert enc.model.layers[0].attn_norm.weight.dtype == torch.float32
    assert engine.runner.weight_bytes < 0.55 * sum(p.numel() * 4 for p in enc.model.parameters())


def test_the_file_maps_whole_onto_transformers_nomic_bert(reference: tuple[Any, set[str]]) -> None:
    from transformers import NomicBertConfig

    model, unused = reference
    assert unused == set()
    # transformers' defaults are nomic-embed-text-v1.5's; the file drops the vocabulary's 6 padding rows.
    defaults, got = NomicBertConfig().to_dict(), model.config.to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "type_vocab_size",
                "max_position_embeddings", "rope_parameters", "hidden_act"):  # fmt: skip
        assert got[key] == defaults[key], key
    assert got["vocab_size"] == 30522 and got["layer_norm_eps"] == pytest.approx(1e-12)


def test_equals_transformers_nomic_bert(engine: EncoderEngine, reference: tuple[Any, set[str]]) -> None:
    ids = [engine.tokenizer(t)["input_ids"] for t in PREFIXED]
    assert all(i[0] == engine.tokenizer.cls_token_id and i[-1] == engine.tokenizer.sep_token_id for i in ids)
    ref = st_mean_normalize(reference[0], ids)
    got = engine.embed(ids)  # one step: padded attention, as the reference's batch is padded
    assert min(cosines(got, ref)) >= 0.9999
    assert engine.block_manager.num_used_blocks == 0
