"""A kernel build killed half-way (a server stopped with kill -9 while compiling) leaves torch's ``lock``
file in the build folder; torch's own check waits for it to go, for ever. Every later start must not hang."""

from __future__ import annotations

import logging
import multiprocessing
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from servelm.runtime.cpu import extension
from servelm.runtime.cpu.extension import CompiledExtension, build_name


def _fake_load(calls: list[float]) -> Any:
    def load(name: str, build_directory: str, **_: Any) -> ModuleType:
        # torch.utils.cpp_extension's FileBaton: wait while another build's lock file is there.
        lock = Path(build_directory) / "lock"
        deadline = time.monotonic() + 3
        while lock.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("waited for a lock nobody holds")
            time.sleep(0.05)
        calls.append(time.monotonic())
        return ModuleType(name)

    return load


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVELM_CACHE", str(tmp_path))
    monkeypatch.setattr(extension, "cpu_flags", lambda: None)
    source = tmp_path / "k.cpp"
    source.write_text("// a kernel\n")
    name = build_name("servelm_test", source.read_bytes())
    build_dir = tmp_path / "torch_extensions" / name
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # what the killed build left
    calls: list[float] = []
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", _fake_load(calls))
    ext = CompiledExtension("test kernel", "servelm_test", lambda: source, lambda m: None, logging.getLogger("t"))
    assert ext.get() is not None and len(calls) == 1


def _hold_build_lock(build_dir: str, held: Any, release: Any) -> None:
    with extension.build_lock(Path(build_dir)):
        (Path(build_dir) / "lock").touch()  # a live build's own lock, as torch makes it
        held.set()
        release.wait(10)
        (Path(build_dir) / "lock").unlink()


def test_a_live_build_in_another_process_is_waited_for(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_build_lock, args=(str(tmp_path), held, release))
    p.start()
    try:
        assert held.wait(30)
        t0 = time.monotonic()
        release_at = t0 + 0.5
        import threading

        threading.Timer(0.5, release.set).start()
        with extension.build_lock(tmp_path):
            assert time.monotonic() >= release_at - 0.05, "took the lock while another build held it"
            assert not (tmp_path / "lock").exists()
    finally:
        p.join(10)
