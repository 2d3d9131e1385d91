"""The folder a GGUF file is served from: its config.json and tokenizer, and where the file is.

``prepare_folder`` writes it once under the cache: ``config.json`` derived from the file's metadata
(``names.hf_config_from_metadata``), the tokenizer as transformers reads it from the file, and
``gguf.json``: the file's path, size and mtime, architecture and tensor table, so that later starts map
the weights without parsing the file's metadata again (``reader.read_indexed_tensors``). No weights
are written.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from gguf import GGUFReader

from . import names
from .reader import tensor_index

log = logging.getLogger(__name__)

SOURCE_FILE = "gguf.json"  # in a prepared folder: which GGUF file holds the weights
# Bumped when what a prepared folder holds changes (2: config.json carries rope_freqs.weight), so older
# folders are prepared again.
FOLDER_FORMAT = 2


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a prepared folder serves, or None for a plain Hugging Face folder."""
    marker = Path(model_dir) / SOURCE_FILE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["path"])


def stored_weight_bytes(model_dir: str | Path) -> int | None:
    """Bytes of the tensors of the GGUF file a prepared folder serves (None for a plain folder)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    marker = Path(model_dir) / SOURCE_FILE
    if not marker.is_file():
        return None
    total = 0
    for _, qtype, dims, _ in json.loads(marker.read_text())["tensors"]:
        block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        n = 1
        for d in dims:
            n *= d
        total += n // block_elems * block_bytes
    return total


def folder_is_current(model_dir: Path) -> bool:
    """Whether ``model_dir`` was prepared for the GGUF file as it is now (same size and mtime)."""
    try:
        source = json.loads((model_dir / SOURCE_FILE).read_text())
        st = Path(source["path"]).stat()
    except (OSError, ValueError, KeyError):
        return False
    current = (source.get("size"), source.get("mtime_ns"), source.get("format")) == (
        st.st_size,
        st.st_mtime_ns,
        FOLDER_FORMAT,
    )
    return current and (model_dir / "config.json").is_file()


def prepare_folder(gguf_path: Path, out: Path) -> Path:
    """Write ``out``: config.json from the file's metadata, its tokenizer, and ``gguf.json`` (atomically)."""
    from transformers import AutoTokenizer

    log.info("reading the config and tokenizer of %s into %s (one-time; weights stay in the file)", gguf_path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        reader = GGUFReader(gguf_path, "r")  # parsed once: seconds for a large vocabulary
        meta, tensor_names = names.gguf_metadata(reader)
        config = names.hf_config_from_metadata(meta, tensor_names)
        factors = names.rope_freq_factors(reader)
        if factors is not None:  # Llama 3.1's RoPE scaling, which llama.cpp's converter stores as a tensor
            config["rope_scaling"] = {"rope_type": "per_frequency", "factors": factors}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(tmp))
        st = gguf_path.stat()
        source = {
            "path": str(gguf_path.resolve()),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "format": FOLDER_FORMAT,
            "architecture": meta["general.architecture"],
            "tensors": tensor_index(reader),
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(source))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
