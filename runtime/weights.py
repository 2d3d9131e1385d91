"""Loading Hugging Face safetensors folders into our model by name mapping.

Tensors are streamed one at a time (``safe_open``) and copied straight into the model's parameters,
converted to their dtype/device on the way, so peak memory stays near the model's own size.
Fused parameters (``qkv_proj``, ``gate_up_proj``) take each checkpoint tensor into their rows through
the ``shard_slices`` the model attaches to them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from servelm.runtime.attention.base import AttentionBackend
from servelm.runtime.config import ModelConfig, UnsupportedModelError
from servelm.runtime.gguf.folder import gguf_source
from servelm.runtime.gguf.loader import load_gguf_weights
from servelm.runtime.model_kernels import LayerOps
from servelm.runtime.models.llama import CausalLM, build_model, param_shards

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(UnsupportedModelError):
    """The checkpoint does not fit the model: missing, unexpected or mis-shaped tensors."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards when sharded, else every ``*.safetensors``."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [d / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightLoadError(f"{d}: {INDEX_FILE} names shard files that are absent: {', '.join(absent)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{d}: no *.safetensors files")
    return files


def _abbrev(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def load_weights(model: CausalLM, model_dir: str | Path) -> int:
    """Fill every parameter of ``model`` from the folder's checkpoint; returns the bytes loaded.

    Raises ``WeightLoadError`` naming the tensors that are missing, unexpected or of the wrong shape.
    """
    params = dict(model.named_parameters())
    expected = {(name, shard) for name, p in params.items() for shard in param_shards(p)}
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    nbytes = 0
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
                target = model.checkpoint_target(ckpt_name)
                if target is None:
                    continue
                name, shard = target
                param = params.get(name)
                if param is None or (name, shard) not in expected:
                    unexpected.append(ckpt_name)
                    continue
                tensor = model.checkpoint_shard(name, shard, f.get_tensor(ckpt_name))
                dst = param.data
                if shard is not None:
                    dst = dst[param.shard_slices[shard]]  # type: ignore[attr-defined]
                if dst.shape != tensor.shape:
                    raise WeightLoadError(
                        f"{path.name}: tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)} for {name}" + (f" [{shard}]" if shard else "")
                    )
                dst.copy_(tensor)
                nbytes += dst.numel() * dst.element_size()
                loaded.add((name, shard))
                del tensor
    if unexpected:
        raise WeightLoadError(
            f"{model_dir}: checkpoint tensors the model has no place for: {_abbrev(sorted(unexpected))}"
        )
    missing = sorted(f"{n} [{s}]" if s else n for n, s in expected - loaded)
    if missing:
        raise WeightLoadError(f"{model_dir}: tensors missing from the checkpoint: {_abbrev(missing)}")
    return nbytes


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    gguf_as_stored: bool = False,
    ops: LayerOps | None = None,
) -> CausalLM:
    """Build the model for ``cfg`` on ``device`` in ``dtype`` and load the folder's weights into it.

    A folder prepared for a GGUF file (``gguf.loader.gguf_source``) loads from that file: with
    ``gguf_as_stored`` its quantized weights stay in their blocks, else they are dequantized.
    """
    model = build_model(cfg, backend, dtype, device, ops)
    source = gguf_source(model_dir)
    if source is not None:
        held = load_gguf_weights(model, model_dir, as_stored=gguf_as_stored)
        model.after_load()
        model.eval()
        formats = ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in sorted(held.items()))
        how = "as stored" if gguf_as_stored else f"dequantized to {dtype}"
        log.info("loaded %s from %s, %s (%s), on %s", cfg.architecture, source, how, formats, device)
        return model
    nbytes = load_weights(model, model_dir)
    model.after_load()
    model.eval()
    log.info("loaded %s (%.1f MiB, %s, %s) from %s", cfg.architecture, nbytes / 2**20, dtype, device, model_dir)
    return model
