"""The JIT-built extensions' names: a function of their source and build flags only."""

from __future__ import annotations

import logging

import pytest

from servelm.runtime.cpu import extension
from servelm.runtime.cpu import gguf_kernels as kernels


def test_loading_an_extension_leaves_the_build_flags_alone() -> None:
    """torch's ``cpp_extension.load`` appends its link flags to the list it is handed: given the module's
    own, every later extension of the process was named (and built) from other flags than the first,
    so a server and a test run built the same source twice under two names."""
    if kernels.load() is None:
        pytest.skip("the GGUF kernels do not build here")
    name = extension.build_name("servelm_check", b"")
    again = extension.CompiledExtension(
        "GGUF block kernels",
        "servelm_gguf_linear",
        lambda: kernels.SOURCE,
        lambda module: None,
        logging.getLogger(__name__),
    )
    assert again.get() is not None
    assert extension.build_name("servelm_check", b"") == name


def test_a_named_cpu_target_builds_under_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVELM_CPU_MARCH compiles for another target than this CPU (the AVX2 code on an AVX-512 host):
    the flag reaches the compiler, and the build is cached apart from the native one, so neither
    target's binary is loaded for the other."""
    monkeypatch.delenv(extension.MARCH_ENV, raising=False)
    assert "-march=native" in extension.cflags()
    native = extension.build_name("servelm_check", b"")
    monkeypatch.setenv(extension.MARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in extension.cflags()
    assert "-march=native" not in extension.cflags()
    assert extension.build_name("servelm_check", b"") != native
