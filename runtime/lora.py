"""LoRA adapters served beside the base model, chosen per request (multi-LoRA).

An adapter is a folder written by PEFT's ``save_pretrained``: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``), with ``lora_A`` ``[r, in]`` and ``lora_B``
``[out, r]`` for each targeted projection. Its update is ``y += s * x A^T B^T`` with ``s = alpha / r``
(``alpha / sqrt(r)`` under rsLoRA), on the rows of the requests that use it; the base weights are never
touched, so requests of several adapters and of the base model share every step.

Loading maps the checkpoint's projections onto ours (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``): a fused projection gets one ``A`` ``[r_q + r_k + r_v, in]`` (the shards' A rows one
after the other) and each shard's ``(s B)^T`` for its own outputs (``LoRAModule``). ``s`` is folded
into ``B`` at load.

Each step the runner sets the ``LoRAContext`` (which adapter owns which rows) before the forward;
every projection with an update reads it (``Linear.lora``). Steps of a few float32 rows on a CPU with
the compiled ops go through one call per projection (``lora_apply`` in ``runtime/cpu/csrc/cpu_ops.cpp``:
each adapter's weights read once for its rows, whatever the mix); otherwise torch ops, per adapter
in the step: its rows gathered (or all rows when it owns the step), ``x A^T``, one ``addmm_`` per
shard, added back. A loop over the step's distinct adapters, never over requests. Steps without
adapter rows cost one attribute check per projection.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from servelm.runtime.lora_updates import LoRAContext, LoRAKernel, LoRAModule, LoRAProjection

if TYPE_CHECKING:
    from servelm.runtime.models.llama import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT saves a LoRA of ``model`` under ``base_model.model.<the model's own parameter names>``.
_PEFT_PREFIX = "base_model.model."
_TENSOR_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# adapter_config.json keys whose feature we do not implement: refused when set to anything but these.
_UNSUPPORTED_CONFIG: dict[str, tuple[Any, ...]] = {
    "use_dora": (None, False),
    "fan_in_fan_out": (None, False),
    "lora_bias": (None, False),
    "modules_to_save": (None, [], ()),
    "layer_replication": (None, [], ()),
    "trainable_token_indices": (None, [], {}, ()),
    "target_parameters": (None, [], ()),
    "alora_invocation_tokens": (None, [], ()),
    "use_qalora": (None, False),
    "use_bdlora": (None, False),
}


class LoRAError(ValueError):
    """An adapter that cannot be served on this model; the message says why."""


@dataclass
class LoRAAdapter:
    """A loaded adapter: the updates of every projection it targets, by our module name."""

    path: str
    rank: int  # the largest rank of any of its projections
    modules: dict[str, LoRAModule]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.modules.values())

    def to(self, device: torch.device, dtype: torch.dtype) -> LoRAAdapter:
        return LoRAAdapter(self.path, self.rank, {k: m.to(device, dtype) for k, m in self.modules.items()})


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"{folder} is not a LoRA adapter folder: it has no {CONFIG_FILE}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{path} is not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoRAError(f"{path}: peft_type {kind!r} is not supported (only LORA)")
    for key, neutral in _UNSUPPORTED_CONFIG.items():
        if cfg.get(key) not in neutral:
            raise LoRAError(f"{path}: {key}={cfg.get(key)!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{path}: bias={cfg.get('bias')!r} is not supported (only 'none')")
    if not isinstance(cfg.get("r"), int) or not isinstance(cfg.get("lora_alpha"), (int, float)):
        raise LoRAError(f"{path}: 'r' and 'lora_alpha' must be numbers")
    return cfg


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path), device="cpu")
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # any unreadable file is the adapter's fault
            raise LoRAError(f"cannot read {path}: {type(e).__name__}: {e}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise LoRAError(f"{path} does not hold a dict of tensors")
        return state
    raise LoRAError(f"{folder} has no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key matching the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_lora_adapter(path: str | Path, model: CausalLM, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against ``model``'s projections (CPU, float32).

    Raises ``LoRAError`` naming what does not fit: files, unsupported features, a projection the model
    does not have or cannot adapt (embeddings, the LM head), shapes, a rank over ``max_rank``.
    Reads the model's structure only, so it may run beside the engine thread.
    """
    from servelm.runtime.models.layers import Linear

    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter path {str(path)!r} is not a folder")
    cfg = _read_config(folder)
    tensors = _read_tensors(folder)
    if not tensors:
        raise LoRAError(f"{folder} holds no tensors")
    # checkpoint module name (e.g. model.layers.0.self_attn.q_proj) -> {"A": ..., "B": ...}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _TENSOR_NAME.match(name)
        if m is None:
            raise LoRAError(
                f"{folder}: tensor {name!r} is not a LoRA A/B weight (embedding LoRA, DoRA and biases are not supported)"
            )
        module = m.group("module")
        if module.startswith(_PEFT_PREFIX):
            module = module[len(_PEFT_PREFIX) :]
        pairs.setdefault(module, {})[m.group("which")] = t

    use_rslora = bool(cfg.get("use_rslora", False))
    # our module name -> [(output rows, A [r, in], s B [out, r])]
    parts: dict[str, list[tuple[slice, torch.Tensor, torch.Tensor]]] = {}
    largest = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{folder}: {module} has lora_{'A' if 'A' in ab else 'B'} but not its partner")
        target = model.checkpoint_target(f"{module}.weight")
        ours = target[0][: -len(".weight")] if target is not None else None
        try:
            layer = model.get_submodule(ours) if ours is not None else None
        except AttributeError:
            layer = None
        if not isinstance(layer, Linear):
            raise LoRAError(
                f"{folder}: {module} is not a projection of this model that LoRA can adapt (q/k/v/o, gate/up/down)"
            )
        a, b = ab["A"].float(), ab["B"].float()
        shard = target[1] if target is not None else None
        rows = layer.shard_rows[shard] if shard is not None else slice(0, layer.out_features)
        rank = a.shape[0] if a.dim() == 2 else -1
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != layer.in_features
            or tuple(b.shape) != (rows.stop - rows.start, rank)
        ):
            raise LoRAError(
                f"{folder}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model needs "
                f"[r, {layer.in_features}] and [{rows.stop - rows.start}, r] (an adapter for another model?)"
            )
        if rank < 1:
            raise LoRAError(f"{folder}: {module} has rank 0")
        if rank > max_rank:
            raise LoRAError(f"{folder}: {module} has rank {rank}, more than --max-lora-rank {max_rank}")
        largest = max(largest, rank)
        alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"]))
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        parts.setdefault(ours, []).append((rows, a, b * scale))

    modules: dict[str, LoRAModule] = {}
    for ours, shards in parts.items():
        shards.sort(key=lambda p: p[0].start)  # the A rows and the B^T blocks in one shard order
        a_all = torch.cat([a for _, a, _ in shards]).contiguous()
        bt_all = torch.cat([b.t().contiguous().view(-1) for _, _, b in shards])
        layout = [(rows.start, rows.stop - rows.start, a.shape[0]) for rows, a, _ in shards]
        modules[ours] = LoRAModule(a_all, bt_all, layout)
    return LoRAAdapter(str(folder), largest, modules)


def attach(model: CausalLM, kernel: LoRAKernel | None = None) -> LoRAContext:
    """Give every projection of ``model`` an (empty) ``LoRAProjection`` over one shared context."""
    from servelm.runtime.models.decoder import DecoderLayer
    from servelm.runtime.models.layers import Linear

    ctx = LoRAContext(kernel)
    for module in model.modules():
        if isinstance(module, Linear):
            module.use_parts(lora=LoRAProjection(ctx))
        elif isinstance(module, DecoderLayer):
            module.lora_ctx = ctx
    return ctx


def add_adapter(model: CausalLM, adapter_id: int, adapter: LoRAAdapter) -> None:
    """Install a loaded adapter (already on the model's device and dtype) under ``adapter_id``."""
    for name, update in adapter.modules.items():
        proj = model.get_submodule(name).method.parts.lora
        if proj is None:
            raise RuntimeError("attach() the model before adding adapters")
        proj.updates[adapter_id] = update


def remove_adapter(model: CausalLM, adapter_id: int) -> None:
    from servelm.runtime.models.layers import Linear

    for module in model.modules():
        if isinstance(module, Linear) and module.method.parts.lora is not None:
            module.method.parts.lora.updates.pop(adapter_id, None)
