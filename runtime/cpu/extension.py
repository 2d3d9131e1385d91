"""JIT-built C++ extensions for the CPU path: build once, cache on disk, check, or fall back quietly.

Each kernel file (``runtime/cpu/csrc/paged_attention_cpu.cpp``, ``runtime/cpu/csrc/*.cpp``) is built
with ``torch.utils.cpp_extension`` on first use, under ``$SERVELM_CACHE/torch_extensions/<name>``, where
the name hashes everything that changes the binary (source, flags, torch, Python, CPU flags). A build
that fails, or whose result needs an instruction the CPU lacks, or that fails its self-check, logs one
warning and yields None: a missing compiler must only cost speed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from servelm.runtime.model_files import cache_dir

LDFLAGS = ["-fopenmp"]
MARCH_ENV = "SERVELM_CPU_MARCH"


def cflags() -> list[str]:
    """The compiler flags: this CPU's instructions, unless SERVELM_CPU_MARCH names another target
    (x86-64-v3 runs the AVX2 code on an AVX-512 host, to measure it or to match older machines)."""
    return ["-O3", f"-march={os.environ.get(MARCH_ENV, '').strip() or 'native'}", "-fopenmp"]


def cpu_flags() -> set[str] | None:
    """The running CPU's feature flags (Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def build_name(prefix: str, source: bytes) -> str:
    """Extension name keyed on everything that changes the binary: source, flags, torch, CPU."""
    h = hashlib.sha256(source)
    flags = cpu_flags()
    for part in (
        cflags(),
        LDFLAGS,
        [torch.__version__, platform.machine(), platform.python_version()],
        sorted(flags or []),
    ):
        h.update("\0".join(part).encode())
    return f"{prefix}_{h.hexdigest()[:16]}"


def one_line(exc: Exception) -> str:
    """The telling line of a build failure: the compiler's first error, else the message's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return errors[0] if errors else (lines[0] if lines else type(exc).__name__)


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Held while this process builds into ``build_dir``: other processes wait. The kernel drops it when its
    holder dies, so a torch ``lock`` file found under it was left by a build that was killed (torch's own
    check waits for that file to go, for ever): it is removed."""
    with open(build_dir / "servelm-build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class CompiledExtension:
    """Builds one extension at most once per process and remembers the outcome (module or None).

    ``source`` is called at build time (so tests can point it elsewhere); ``self_check(module)``
    returns a reason to refuse the module, or None. The module may export ``compiled_isa()``: the
    instruction sets it was built for, each checked against the running CPU.
    """

    def __init__(
        self,
        what: str,
        prefix: str,
        source: Callable[[], Path],
        self_check: Callable[[ModuleType], str | None],
        logger: logging.Logger,
    ) -> None:
        self.what = what
        self.prefix = prefix
        self.source = source
        self.self_check = self_check
        self.log = logger
        self._lock = threading.Lock()
        self._tried = False
        self._module: ModuleType | None = None

    def get(self, verbose: bool = False) -> ModuleType | None:
        with self._lock:
            if not self._tried:
                self._module = self._build(verbose)
                self._tried = True
            return self._module

    def _build(self, verbose: bool) -> ModuleType | None:
        try:
            from torch.utils import cpp_extension

            source = self.source()
            # The headers beside the source are part of it (gguf_linear.cpp includes gguf_vnni.h).
            text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
            name = build_name(self.prefix, text)
            build_dir = cache_dir() / "torch_extensions" / name
            build_dir.mkdir(parents=True, exist_ok=True)
            if not any(build_dir.glob("*.so")):
                self.log.info("building the %s (one-time, ~30 s; cached in %s)", self.what, build_dir)
            with build_lock(build_dir):
                module = cpp_extension.load(
                    name=name,
                    sources=[str(source)],
                    # Copies: torch appends its own flags to these lists, which would rename later builds.
                    extra_cflags=cflags(),
                    extra_ldflags=list(LDFLAGS),
                    build_directory=str(build_dir),
                    verbose=verbose,
                )
            flags = cpu_flags()
            if hasattr(module, "compiled_isa") and flags is not None:
                missing = sorted(set(module.compiled_isa()) - flags)
                if missing:
                    self.log.warning("%s disabled: this CPU lacks %s", self.what, ", ".join(missing))
                    return None
            problem = self.self_check(module)
            if problem:
                self.log.warning("%s disabled: %s", self.what, problem)
                return None
            return module
        except Exception as exc:  # a missing compiler, ninja or header must only cost speed
            self.log.warning("%s unavailable, using the torch path: %s", self.what, one_line(exc))
            return None
