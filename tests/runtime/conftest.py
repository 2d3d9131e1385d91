"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from types import ModuleType

import pytest

from servelm.runtime.cpu import gguf_kernels as kernels


@pytest.fixture(scope="module")
def module() -> ModuleType:
    """The compiled GGUF kernels, or a skip where they cannot be built."""
    m = kernels.load()
    if m is None:
        pytest.skip("the GGUF kernel extension cannot be built here (no compiler or self-check failed)")
    return m
