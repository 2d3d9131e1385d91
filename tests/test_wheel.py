"""The wheel installs one top-level package, ``servelm``, and imports from outside the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # pip builds the wheel and installs it

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy without build/: setuptools reuses a checkout's stale build/lib, whose leftovers would
    # hide a package missing from pyproject's list.
    src = tmp_path_factory.mktemp("src") / "servelm"
    shutil.copytree(
        REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
    (whl,) = out.glob("servelm-*.whl")
    return whl


def test_the_wheel_holds_only_servelm(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"servelm"}, sorted(tops)
    # Every module of the product's folders ships: a package left out of pyproject's list still imports
    # in the editable checkout (its finder fills the gap), so only the wheel's listing shows it.
    sources = {
        f"servelm/{p.relative_to(REPO).as_posix()}"
        for top in ("server", "scheduler", "runtime", "metrics", "bench")
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert len(sources) > 50 and "servelm/server/reasoning/__init__.py" in sources
    missing = sorted(sources - set(names))
    assert not missing, f"modules missing from the wheel (add their packages to pyproject.toml): {missing}"
    assert "servelm/runtime/cpu/csrc/cpu_ops.cpp" in names  # the C++ sources compiled at first use
    assert {"servelm/server/playground/index.html", "servelm/server/playground/app.js"} <= set(
        names
    )  # the page served at /


def test_the_installed_wheel_imports_from_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == [
        "servelm"
    ]
    code = "import servelm.server.app as a, servelm.runtime.runner as r; print(a.__file__); print(r.__file__)"
    # The installed copy, not this checkout (PYTHONPATH comes before the editable install's finder).
    got = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    )
    files = got.stdout.split()
    assert files and all(f.startswith(str(target)) for f in files), got.stdout
