"""Makes ``servelm`` importable from this checkout where it is not installed: the device machine runs
these scripts from a copy of the tree with no pip install."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def use_checkout() -> Path:
    """Map ``servelm.<pkg>`` onto this checkout's ``<pkg>/`` folders unless servelm is installed; returns the repo root."""
    if "servelm" not in sys.modules and importlib.util.find_spec("servelm") is None:
        pkg = types.ModuleType("servelm")
        pkg.__path__ = [str(REPO)]  # servelm.runtime -> REPO/runtime, as the wheel's package-dir maps it
        sys.modules["servelm"] = pkg
    return REPO
