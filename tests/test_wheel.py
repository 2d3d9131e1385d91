"""The wheel installs one top-level package, ``servelm``, and imports from outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (whl,) = out.glob("servelm-*.whl")
    return whl


def test_the_wheel_holds_only_servelm(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"servelm"}, sorted(tops)
    for pkg in ("server", "scheduler", "runtime", "metrics", "bench", "runtime/models", "runtime/attention", "runtime/cpu", "runtime/cuda", "runtime/gguf"):
        assert f"servelm/{pkg}/__init__.py" in names, pkg
    assert "servelm/runtime/cpu/csrc/cpu_ops.cpp" in names  # the C++ sources compiled at first use
    assert {"servelm/server/playground/index.html", "servelm/server/playground/app.js"} <= set(names)  # the page served at /


def test_the_installed_wheel_imports_from_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == ["servelm"]
    code = "import servelm.server.app as a, servelm.runtime.runner as r; print(a.__file__); print(r.__file__)"
    # The installed copy, not this checkout (PYTHONPATH comes before the editable install's finder).
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    files = got.stdout.split()
    assert files and all(f.startswith(str(target)) for f in files), got.stdout
