"""Loading a GGUF file into our model: projections kept in their stored blocks, or dequantized.

A GGUF model is served from the small folder ``folder.prepare_folder`` wrote (config, tokenizer, and
where the file is); ``load_gguf_weights`` reads the weights from the memory-mapped file at every start.

Served as stored (``as_stored=True``, CPU float32), every quantized projection weight stays a view of
the file's blocks and runs through a ``projection.GGUFMethod``; the embedding is read per token from its
rows. Float32 projections, the norms and the biases are copied into the model's parameters. Otherwise
each tensor is dequantized into the parameters, the way transformers loads the file.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType as Q

from servelm.runtime.config import UnsupportedModelError

from . import names
from .folder import SOURCE_FILE
from .projection import GGUFEmbedding, GGUFMethod, GGUFShardedMethod
from .reader import GGUFTensor, read_indexed_tensors
from .registry import SUPPORTED, dequantize

log = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"  # an untied head (a tied one is the embedding)


class GGUFLoadError(UnsupportedModelError):
    """The GGUF file does not fit the model, or holds a format servelm cannot decode."""


def _hf_order(tensor: GGUFTensor, hf: str, arch: str, config: dict[str, Any]) -> GGUFTensor:
    """The tensor with llama.cpp's q/k row permutation undone (a copy of those rows' blocks only)."""
    if not names.needs_unpermute(hf, arch):
        return tensor
    rows = tensor.shape[0]
    index = names.unpermute_rows(rows, names.unpermute_heads(hf, config))
    raw = tensor.raw.reshape(rows, -1).index_select(0, index).reshape(tensor.raw.shape)
    return GGUFTensor(name=tensor.name, qtype=tensor.qtype, shape=tensor.shape, raw=raw)


def _dense(tensor: GGUFTensor, gguf_name: str, arch: str) -> torch.Tensor:
    values = dequantize(tensor)
    offset = names.norm_offset(gguf_name, arch)
    # Gemma 3's norms: HF's weight is stored - 1 (the model adds the 1 back in float32, as transformers does).
    return values - 1.0 if offset == -1.0 else values


def load_gguf_weights(model: Any, model_dir: str | Path, *, as_stored: bool) -> dict[str, int]:
    """Fill ``model`` (a ``models.llama.CausalLM``) from the GGUF file of the folder ``prepare_folder`` wrote.

    Returns the bytes held per format, for the log. Raises ``GGUFLoadError`` naming tensors that are
    missing, unexpected, mis-shaped or of a format without a decoder.
    """
    from servelm.runtime.models.layers import Linear

    model_dir = Path(model_dir)
    source = json.loads((model_dir / SOURCE_FILE).read_text())
    config = json.loads((model_dir / "config.json").read_text())
    path, arch = Path(source["path"]), source["architecture"]
    tensors = read_indexed_tensors(path, source["tensors"])
    hf_names = names.hf_tensor_names(list(tensors), arch)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = {(n, s) for n, p in params.items() for s in (list(getattr(p, "shard_slices", None) or [None]))}
    loaded: set[tuple[str, str | None]] = set()
    held: Counter[str] = Counter()
    stored_shards: dict[str, dict[str | None, GGUFTensor]] = {}  # Linear name -> shard -> blocks
    unexpected: list[str] = []
    for gguf_name, hf in hf_names.items():
        tensor = tensors[gguf_name]
        if tensor.qtype not in SUPPORTED:
            raise GGUFLoadError(
                f"{path.name}: tensor {gguf_name} is {tensor.qtype.name}, which servelm does not decode "
                f"(supported: {', '.join(q.name for q in SUPPORTED)})"
            )
        target = model.checkpoint_target(hf)
        if target is None:
            continue
        name, shard = target
        param = params.get(name)
        if param is None or (name, shard) not in expected:
            unexpected.append(gguf_name)
            continue
        tensor = _hf_order(tensor, hf, arch, config)
        dst = param.data if shard is None else param.data[param.shard_slices[shard]]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise GGUFLoadError(
                f"{path.name}: tensor {gguf_name} has shape {list(tensor.shape)}, expected "
                f"{list(dst.shape)} for {name}" + (f" [{shard}]" if shard else "")
            )
        module_name = name.rpartition(".")[0]
        keep = as_stored and len(tensor.shape) == 2 and name.endswith(".weight")
        if keep and (isinstance(modules.get(module_name), Linear) or name in (EMBEDDING, HEAD)):
            stored_shards.setdefault(name, {})[shard] = tensor  # decided below, once all shards are seen
        else:
            dst.copy_(_dense(tensor, gguf_name, arch))
            held["F32 (copied)"] += dst.numel() * 4
        loaded.add((name, shard))
    if unexpected:
        raise GGUFLoadError(f"{path.name}: tensors the model has no place for: {', '.join(sorted(unexpected)[:8])}")
    missing = sorted(f"{n} [{s}]" if s else n for n, s in expected - loaded)
    if missing:
        raise GGUFLoadError(f"{path.name}: tensors missing from the file: {', '.join(missing[:8])}")
    for name, shards in stored_shards.items():
        if all(t.qtype == Q.F32 for t in shards.values()):
            # Float32 in the file: the dense parameter and its tuned kernels serve it as well as any.
            param = params[name]
            for shard, t in shards.items():
                (param.data if shard is None else param.data[param.shard_slices[shard]]).copy_(dequantize(t))
            held["F32 (copied)"] += param.numel() * 4
            continue
        _keep_stored(model, modules, name, shards)
        for t in shards.values():
            held[t.qtype.name] += t.raw.numel()
    return dict(held)


def _keep_stored(model: Any, modules: dict[str, Any], name: str, shards: dict[str | None, GGUFTensor]) -> None:
    """Make the module owning parameter ``name`` compute from the stored blocks instead of the parameter."""
    if name == EMBEDDING:
        model.use_stored_embedding(GGUFEmbedding(shards[None]))
        return
    if name == HEAD:
        model.use_stored_head(GGUFMethod.of(shards[None]))
        return
    linear = modules[name.rpartition(".")[0]]
    if None in shards:
        method: Any = GGUFMethod.of(shards[None])
    else:
        method = GGUFShardedMethod([(linear.shard_rows[s], GGUFMethod.of(shards[s])) for s in linear.shard_rows])
    linear.use_stored(method)
