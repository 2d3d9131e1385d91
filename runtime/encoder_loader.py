"""Encoder models on disk: a sentence-transformers folder (BERT, MPNet) or a GGUF file (nomic-bert), read
into ``models.encoder.Encoder`` with the pooling their own metadata names.

A sentence-transformers folder says what follows the transformer in ``modules.json`` (Pooling, then
Normalize) and how long a text may be in ``sentence_bert_config.json``; a GGUF file says its pooling in
``<arch>.pooling_type`` and its trained context in ``<arch>.context_length``, and is normalised as
llama.cpp's server normalises it.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from servelm.runtime.config import UnsupportedModelError
from servelm.runtime.models.encoder import Encoder, EncoderBatch, EncoderConfig
from servelm.runtime.models.gemma_encoder import GemmaEncoder, GemmaEncoderConfig

log = logging.getLogger(__name__)

POOLING_MODES = ("mean", "cls", "max", "last", "mean_sqrt_len")
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_*
# Models trained with Matryoshka representation learning: their leading dimensions are an embedding too.
_MATRYOSHKA = {"nomic-embed-text-v1.5": (768, 512, 256, 128, 64), "embeddinggemma": (768, 512, 256, 128)}


@dataclass(frozen=True)
class PoolingSpec:
    """How token states become one embedding, from the model's own files."""

    mode: str  # one of POOLING_MODES
    normalize: bool  # L2-normalise the pooled vector
    max_seq_length: int  # the longest input, in tokens, special tokens included
    matryoshka: tuple[int, ...] | None = None  # dimensions it was trained to truncate to (None: not Matryoshka)


def is_sentence_transformers_folder(path: Path) -> bool:
    return path.is_dir() and (path / "modules.json").is_file() and (path / "config.json").is_file()


# GGUF metadata value types -> their fixed size in bytes (8: string, 9: array, read below).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: Path) -> str | None:
    """A GGUF file's ``general.architecture``, read from its header alone: gguf-py's reader would parse
    every field first (Gemma 3's 262,144-token vocabulary: ~230 MiB at the server's peak, for one name)."""
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    with path.open("rb") as f:

        def take(fmt: str) -> Any:
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(take("Q"), 1)
            elif vtype == 9:
                etype, count = take("I"), take("Q")
                if etype in _GGUF_SIZES:
                    f.seek(_GGUF_SIZES[etype] * count, 1)
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                f.seek(_GGUF_SIZES[vtype], 1)

        if f.read(4) != b"GGUF":
            return None
        take("I")  # version
        take("Q")  # tensors
        for _ in range(take("Q")):
            key = f.read(take("Q")).decode()
            vtype = take("I")
            if key == "general.architecture" and vtype == 8:
                return str(f.read(take("Q")).decode())
            skip(vtype)
    return None


def is_encoder_model(model: str | None) -> bool:
    """Whether ``--model`` names an encoder (served for embeddings, rerank and score, not generation)."""
    if not model:
        return False
    path = Path(model).expanduser()
    return is_sentence_transformers_folder(path) or gguf_architecture(path) == "nomic-bert"


def _st_pooling(folder: Path, name: str) -> PoolingSpec:
    modules = json.loads((folder / "modules.json").read_text())
    types = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if types[0] != "Transformer" or any(t not in ("Transformer", "Pooling", "Dense", "Normalize") for t in types):
        raise UnsupportedModelError(
            f"{folder}: sentence-transformers modules {types} (served: Transformer, Pooling, Dense, Normalize)"
        )
    mode = "mean"
    for m in modules:
        if m["type"].endswith("Pooling"):
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            chosen = [
                k
                for k in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
                if cfg.get(f"pooling_mode_{k}")
            ]
            if len(chosen) != 1:
                raise UnsupportedModelError(f"{folder}: pooling {chosen} (one mode is served)")
            mode = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max", "lasttoken": "last"}.get(
                chosen[0], "mean_sqrt_len"
            )
    st = folder / "sentence_bert_config.json"
    max_len = json.loads(st.read_text()).get("max_seq_length") if st.is_file() else None
    hf = json.loads((folder / "config.json").read_text())
    positions = int(hf["max_position_embeddings"]) - (
        int(hf.get("pad_token_id", 1)) + 1 if hf.get("model_type") == "mpnet" else 0
    )
    matryoshka = next((v for k, v in _MATRYOSHKA.items() if k in name.lower()), None)
    return PoolingSpec(mode, "Normalize" in types, int(max_len or positions), matryoshka)


def _st_dense(folder: Path) -> tuple[torch.Tensor, ...]:
    """The weights of the folder's Dense modules, in order (linear maps: an identity activation, no bias)."""
    from safetensors.torch import load_file

    out = []
    for m in json.loads((folder / "modules.json").read_text()):
        if m["type"].endswith("Dense"):
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            if cfg.get("bias") or not str(cfg.get("activation_function", "")).endswith("Identity"):
                raise UnsupportedModelError(f"{folder}/{m['path']}: a Dense module with a bias or an activation")
            out.append(load_file(str(folder / m["path"] / "model.safetensors"))["linear.weight"])
    return tuple(out)


def _strip_prefix(state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    prefix = f"{arch}."
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{folder}: no *.safetensors weights")
    src: dict[str, torch.Tensor] = {}
    for f in files:
        src.update(load_file(str(f)))
    return src


def _hf_state(folder: Path, cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    src = _strip_prefix(_read_safetensors(folder), cfg.architecture)
    out = {
        "embed.weight": src["embeddings.word_embeddings.weight"],
        "position.weight": src["embeddings.position_embeddings.weight"],
    }
    for p in ("weight", "bias"):
        out[f"embed_norm.{p}"] = src[f"embeddings.LayerNorm.{p}"]
    if cfg.type_vocab_size:
        out["token_type.weight"] = src["embeddings.token_type_embeddings.weight"]
    if cfg.relative_buckets:
        out["relative.weight"] = src["encoder.relative_attention_bias.weight"]
    bert = cfg.architecture == "bert"
    names = {
        "qkv": ("attention.self.query", "attention.self.key", "attention.self.value")
        if bert
        else ("attention.attn.q", "attention.attn.k", "attention.attn.v"),
        "out": ("attention.output.dense" if bert else "attention.attn.o",),
        "attn_norm": ("attention.output.LayerNorm" if bert else "attention.LayerNorm",),
        "up": ("intermediate.dense",),
        "down": ("output.dense",),
        "ffn_norm": ("output.LayerNorm",),
    }
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            for p in ("weight", "bias"):
                out[f"layers.{i}.{ours}.{p}"] = torch.cat([src[f"encoder.layer.{i}.{t}.{p}"] for t in theirs])
    return out


def _gguf_config(fields: dict[str, Any], arch: str) -> tuple[EncoderConfig, PoolingSpec, str]:
    def get(key: str) -> Any:
        return fields[f"{arch}.{key}"]

    cfg = EncoderConfig(
        architecture=arch,
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=int(get("embedding_length")),
        num_layers=int(get("block_count")),
        num_heads=int(get("attention.head_count")),
        intermediate_size=int(get("feed_forward_length")),
        max_position_embeddings=int(get("context_length")),
        layer_norm_eps=float(get("attention.layer_norm_epsilon")),
        type_vocab_size=int(fields.get("tokenizer.ggml.token_type_count", 0)),
        rope_theta=float(get("rope.freq_base")),
        gated=True,
    )
    pooling = int(fields.get(f"{arch}.pooling_type", 1))
    if pooling not in _GGUF_POOLING:
        raise UnsupportedModelError(f"{arch} GGUF with pooling_type {pooling} (served: {sorted(_GGUF_POOLING)})")
    name = str(fields.get("general.name", ""))
    matryoshka = next((v for k, v in _MATRYOSHKA.items() if k in name.lower()), None)
    return cfg, PoolingSpec(_GGUF_POOLING[pooling], True, cfg.max_position_embeddings, matryoshka), name


def _gguf_fields(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if len(f.types) > 1 or key in ("tokenizer.ggml.tokens",):  # arrays
            if key == "tokenizer.ggml.tokens":
                out[key] = [bytes(f.parts[i]).decode() for i in f.data]
            continue
        value = f.parts[f.data[0]]
        out[key] = bytes(value).decode() if f.types[0].name == "STRING" else value.tolist()[0]
    return out


def _gguf_state(reader: Any, cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """The file's tensors under the encoder's names: float16 and float32 as stored, others dequantized."""
    from gguf import GGMLQuantizationType, dequantize

    t = {x.name: x for x in reader.tensors}
    as_stored = (GGMLQuantizationType.F16, GGMLQuantizationType.F32)

    def w(name: str) -> torch.Tensor:
        x = t[name]
        data = np.array(x.data) if x.tensor_type in as_stored else dequantize(x.data, x.tensor_type).astype(np.float32)
        return torch.from_numpy(data).reshape([int(d) for d in reversed(x.shape)])

    out = {"embed.weight": w("token_embd.weight"), "token_type.weight": w("token_types.weight")}
    for p in ("weight", "bias"):
        out[f"embed_norm.{p}"] = w(f"token_embd_norm.{p}")
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        out[f"layers.{i}.qkv.weight"] = w(b + "attn_qkv.weight")
        out[f"layers.{i}.out.weight"] = w(b + "attn_output.weight")
        out[f"layers.{i}.up.weight"] = torch.cat([w(b + "ffn_gate.weight"), w(b + "ffn_up.weight")])
        out[f"layers.{i}.down.weight"] = w(b + "ffn_down.weight")
        for p in ("weight", "bias"):
            out[f"layers.{i}.attn_norm.{p}"] = w(b + f"attn_output_norm.{p}")
            out[f"layers.{i}.ffn_norm.{p}"] = w(b + f"layer_output_norm.{p}")
    return out


def gguf_vocabulary(path: Path) -> tuple[list[str], dict[str, Any]]:
    """The GGUF file's tokens and its metadata fields (the tokenizer is built from them)."""
    from gguf import GGUFReader

    fields = _gguf_fields(GGUFReader(path))
    return fields["tokenizer.ggml.tokens"], fields


@dataclass
class LoadedEncoder:
    """An encoder ready to run: its network, its pooling, and what it is called."""

    config: EncoderConfig | GemmaEncoderConfig
    model: Encoder | GemmaEncoder
    pooling: PoolingSpec
    name: str
    dense: tuple[torch.Tensor, ...] = ()  # sentence-transformers Dense modules after pooling
    gguf_fields: dict[str, Any] | None = None  # a GGUF file's metadata (its tokenizer is built from it)

    @property
    def dimensions(self) -> int:
        return self.dense[-1].shape[0] if self.dense else self.config.hidden_size

    def embed(self, batch: EncoderBatch) -> torch.Tensor:
        """The step's pooled (and, where the model says so, normalised) vectors, float32."""
        return pool(self.model(batch), batch, self.pooling, self.dense)


def load_encoder(model: str, device: torch.device, dtype: torch.dtype) -> LoadedEncoder:
    """Read ``--model`` (a sentence-transformers folder or a nomic-bert GGUF file) onto ``device``."""
    path = Path(model).expanduser()
    cfg: EncoderConfig | GemmaEncoderConfig
    dense: tuple[torch.Tensor, ...] = ()
    fields: dict[str, Any] | None = None
    if (
        is_sentence_transformers_folder(path)
        and json.loads((path / "config.json").read_text()).get("model_type") == "gemma3_text"
    ):
        cfg = GemmaEncoderConfig.from_hf(json.loads((path / "config.json").read_text()))
        pooling, dense, name = _st_pooling(path, path.name), _st_dense(path), path.name
        flat = {k.replace(".self_attn.", ".").replace(".mlp.", "."): v for k, v in _read_safetensors(path).items()}
        state = _strip_prefix(flat, "model")
    elif is_sentence_transformers_folder(path):
        cfg = EncoderConfig.from_hf(json.loads((path / "config.json").read_text()))
        pooling = _st_pooling(path, path.name)
        state, name = _hf_state(path, cfg), path.name
    elif gguf_architecture(path) == "nomic-bert":
        from gguf import GGUFReader

        reader = GGUFReader(path)
        fields = _gguf_fields(reader)
        cfg, pooling, name = _gguf_config(fields, "nomic-bert")
        state = _gguf_state(reader, cfg)
    else:
        raise UnsupportedModelError(f"--model {model}: not a sentence-transformers folder or a nomic-bert GGUF file")
    if pooling.max_seq_length > cfg.max_tokens:
        pooling = PoolingSpec(pooling.mode, pooling.normalize, cfg.max_tokens, pooling.matryoshka)
    with torch.device("meta"):
        net = GemmaEncoder(cfg) if isinstance(cfg, GemmaEncoderConfig) else Encoder(cfg)
    net.load_state_dict(state, assign=True, strict=True)
    net = _place(net, device, dtype)
    dense = tuple(d.to(device=device, dtype=torch.float32) for d in dense)
    log.info("encoder %s: %s, %d layers, %d dimensions, %s pooling%s, up to %d tokens", name, cfg.architecture,
             cfg.num_layers, cfg.hidden_size, pooling.mode, " + normalize" if pooling.normalize else "", pooling.max_seq_length)  # fmt: skip
    return LoadedEncoder(cfg, net, pooling, name or path.stem, dense, fields)


def _place(net: Encoder | GemmaEncoder, device: torch.device, dtype: torch.dtype) -> Encoder | GemmaEncoder:
    """``net`` on ``device`` in ``dtype``, but for the matrices of an ``Encoder`` stored in 16 bits under a
    wider ``dtype`` (a GGUF file's float16): they stay as stored and are widened per use, which holds half
    the bytes and computes the same (every float16 value is exactly a float32 one)."""
    net = net.to(device=device)
    narrow = (torch.float16, torch.bfloat16)
    with torch.no_grad():
        for p in net.parameters():
            if not (isinstance(net, Encoder) and p.dim() == 2 and p.dtype in narrow and dtype.itemsize > 2):
                p.data = p.data.to(dtype)
    return net.eval()


def pool(
    hidden: torch.Tensor, batch: EncoderBatch, spec: PoolingSpec, dense: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """One float32 vector per sequence from its tokens' last hidden states ``[T, H]`` (then ``dense``'s maps)."""
    hidden = hidden.float()
    lens = torch.tensor(batch.seq_lens, device=hidden.device)
    if spec.mode == "cls":
        out = hidden.index_select(0, batch.starts)
    elif spec.mode == "last":
        out = hidden.index_select(0, batch.starts + lens - 1)
    else:
        seq = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        if spec.mode == "max":
            index = seq[:, None].expand_as(hidden)
            out = hidden.new_full((len(lens), hidden.shape[1]), float("-inf")).scatter_reduce_(0, index, hidden, "amax")
        else:
            out = hidden.new_zeros(len(lens), hidden.shape[1]).index_add_(0, seq, hidden)
            out = out / (lens[:, None].float() if spec.mode == "mean" else lens[:, None].float().sqrt())
    for w in dense:
        out = out @ w.T
    return torch.nn.functional.normalize(out, dim=-1) if spec.normalize else out
