"""What one served model is before it loads: its id, its engine's configuration, its aliases, its
keep-alive and the memory it is expected to take (``ModelSpec``), from repeated ``--model`` flags
or a models file (YAML; docs/models-several.md)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelm.scheduler.config import EngineConfig

# The serving options a model may set for itself (the CLI flags of the same names, per model).
SERVING_OPTIONS = ("tool_call_parser", "reasoning_parser", "enable_auto_tool_choice", "chat_template")
# Keys of a models-file entry that are not EngineConfig fields.
_ENTRY_KEYS = {"id", "path", "aliases", "keep_alive", *SERVING_OPTIONS}
# EngineConfig fields a models-file entry may set (the rest are the server's, or derived from the entry).
_CONFIG_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {
    "model",
    "served_model_name",
    "host",
    "lora_modules",
}
_SIZE_KEYS = {"kv_cache_memory"}
# File names whose bytes are a model's weights (an HF folder's shards, or a GGUF file).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# The KV pool a CPU engine allocates without --kv-cache-memory (the CPU platform's default).
DEFAULT_KV_BYTES = 2 * 2**30
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ModelSpecError(ValueError):
    """A models file or flag that does not describe a servable set of models."""


@dataclass
class ModelSpec:
    """One model of a server: loaded on demand from ``config`` and named ``id`` (or an alias)."""

    id: str
    config: EngineConfig
    aliases: tuple[str, ...] = ()
    # Seconds it stays loaded once idle; None: kept (until the memory budget needs its room).
    keep_alive_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)  # SERVING_OPTIONS set for this model
    memory_bytes: int = 0  # its expected footprint: weights + KV pool (``estimate_memory``)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's ``keep_alive``: seconds as a number, or a Go duration (``"5m"``, ``"1h30m"``, ``"0"``);
    a negative value keeps the model loaded (None)."""
    if isinstance(value, bool) or value is None:
        raise ModelSpecError(f"keep_alive must be a duration or a number of seconds, not {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ModelSpecError(
                    f"keep_alive {value!r} is not a duration (examples: 5m, 1h30m, 30s, 0, -1)"
                ) from None
            seconds = sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    return None if seconds < 0 else seconds


def model_id_of(path: str | None) -> str:
    """The id a model is served under without one given: the GGUF file's stem or the folder's name."""
    if path is None:
        from servelm.runtime.model_files import default_model_dir

        return default_model_dir().name
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


def estimate_memory(config: EngineConfig, is_encoder: Callable[[str | None], bool]) -> int:
    """Bytes a model is expected to take loaded: its weight files, plus its KV pool for a generative
    model (``kv_cache_memory``, else the CPU default). An estimate from files: float32 serving of a
    bfloat16 checkpoint takes more, a quantized load less."""
    path = Path(config.model) if config.model is not None else None
    if path is None:
        from servelm.runtime.model_files import default_model_dir

        path = default_model_dir()
    files: Iterable[Path] = (
        [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    )
    weights = sum(p.stat().st_size for p in files if p.suffix in _WEIGHT_SUFFIXES)
    try:
        encoder = is_encoder(config.model)
    except Exception:  # an unreadable file: its load will fail and say why; count it as generative
        encoder = False
    if encoder:
        return weights
    return weights + (config.kv_cache_memory or DEFAULT_KV_BYTES)


def _entry_config(base: EngineConfig, entry: Mapping[str, Any], where: str) -> EngineConfig:
    from servelm.server.cli_types import parse_size

    changes: dict[str, Any] = {}
    for key, value in entry.items():
        if key in _ENTRY_KEYS:
            continue
        if key not in _CONFIG_KEYS:
            known = ", ".join(sorted(_ENTRY_KEYS | _CONFIG_KEYS))
            raise ModelSpecError(f"{where}: unknown key {key!r} (known: {known})")
        if key in _SIZE_KEYS and isinstance(value, str):
            try:
                value = parse_size(value)
            except Exception as e:
                raise ModelSpecError(f"{where}: {key}: {e}") from None
        changes[key] = value
    return dataclasses.replace(base, **changes)


def specs_from_entries(
    entries: list[Mapping[str, Any]], base: EngineConfig, base_options: Mapping[str, Any]
) -> list[ModelSpec]:
    """One spec per entry of a models file (``{"id", "path", "aliases", "keep_alive", ...flags}``),
    each over the server's ``base`` configuration and serving options."""
    specs: list[ModelSpec] = []
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        if not isinstance(entry, Mapping):
            raise ModelSpecError(f"{where} must be a mapping with at least 'path' or 'id'")
        path = entry.get("path")
        path = None if path in (None, "default") else str(Path(str(path)).expanduser())
        model_id = str(entry.get("id") or model_id_of(path))
        config = _entry_config(base, entry, where)
        config = dataclasses.replace(config, model=path, served_model_name=model_id)
        aliases = entry.get("aliases") or ()
        if isinstance(aliases, str):
            aliases = (aliases,)
        keep = parse_keep_alive(entry["keep_alive"]) if "keep_alive" in entry else None
        options = {**base_options, **{k: entry[k] for k in SERVING_OPTIONS if k in entry}}
        specs.append(ModelSpec(model_id, config, tuple(str(a) for a in aliases), keep, options))
    check_unique(specs)
    return specs


def specs_from_paths(paths: list[str | None], base: EngineConfig, base_options: Mapping[str, Any]) -> list[ModelSpec]:
    """One spec per ``--model`` flag, all with the server's flags."""
    return specs_from_entries([{"path": p} for p in paths], base, base_options)


def read_models_file(path: str) -> tuple[list[Mapping[str, Any]], dict[str, Any]]:
    """A models file's entries and its top-level settings (``memory_budget``)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ModelSpecError(f"--models-file {path}: {e}") from None
    if isinstance(data, list):
        data = {"models": data}
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ModelSpecError(f"--models-file {path}: expected a list of models, or a mapping with a 'models' list")
    unknown = set(data) - {"models", "memory_budget"}
    if unknown:
        raise ModelSpecError(
            f"--models-file {path}: unknown top-level key(s) {sorted(unknown)} (known: models, memory_budget)"
        )
    return data["models"], {k: v for k, v in data.items() if k != "models"}


def check_unique(specs: list[ModelSpec]) -> None:
    seen: dict[str, str] = {}
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise ModelSpecError(f"two models are named {name!r} ({seen[name]} and {spec.id}): give each an 'id'")
            seen[name] = spec.id


__all__ = [
    "ModelSpec",
    "ModelSpecError",
    "estimate_memory",
    "model_id_of",
    "parse_keep_alive",
    "read_models_file",
    "specs_from_entries",
    "specs_from_paths",
]
