"""Loading the tokenizer that belongs to a model folder (local files only: serving never downloads)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from servelm.runtime.config import UnsupportedModelError


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer (with its chat template) stored in ``path``."""
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: cannot load a tokenizer ({e})") from e
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise UnsupportedModelError(f"{path}: expected a fast (tokenizer.json) tokenizer, got {type(tok).__name__}")
    return tok
