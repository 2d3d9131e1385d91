"""argparse value types for ``servelm serve``: sizes, bounded numbers and the JSON configs, each refused with
the reason at parse time."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1.5GB, 1073741824)")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return v


def parsed_by(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that checks a JSON flag with its config class's parser and keeps the text."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return check


def speculative_config(text: str) -> str:
    from servelm.scheduler.speculative import parse_speculative_config

    return parsed_by(parse_speculative_config)(text)


def kv_events_config(text: str) -> str:
    from servelm.scheduler.kv_events import KVEventsConfig

    return parsed_by(KVEventsConfig.parse)(text)


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}`` -> (name, path)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj: Any = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError('the JSON form needs string "name" and "path"')
        name, path = obj["name"], obj["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"expected name=path, got {text!r}")
    if not name or not path:
        raise ValueError(f"empty name or path in {text!r}")
    return name, path


def lora_module(text: str) -> tuple[str, str]:
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return v


def fraction(text: str) -> float:
    v = float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return v
