"""A tokenizer loaded without its thousands of placeholder tokens (Gemma 3's ``<unusedN>``) encodes and
decodes exactly as the full tokenizer that transformers loads from the same folder, and holds a
fraction of its memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from servelm.runtime.model_files import resolve_model_path
from servelm.runtime.tokenizer import load_tokenizer, tokenizer_json
from servelm.scheduler.detokenizer import TextDecoder

TEXTS = [
    "Hello world <start_of_turn>user\nhi<end_of_turn>",
    "日本語のテキストです。Ceci est un texte français. Привет, мир!",
    "def f(x):\n    return x<2 and x > -1  # <not a token>",
    "x <unused5> y<unused55><unused5>z",
    "<unused6241>",
    "<unused",
    "a<unused1>>b<unused12>",
    "<mask><unused7><mask>",  # the sentinel the slim tokenizer puts in a placeholder's place
    "",
]


@pytest.fixture(scope="module")
def folder(gemma3_gguf: Path) -> Path:
    return resolve_model_path(str(gemma3_gguf))


@pytest.fixture(scope="module")
def tokenizers(folder: Path) -> tuple[Any, Any]:
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_placeholders_are_not_loaded_as_added_tokens(tokenizers: tuple[Any, Any]) -> None:
    slim, full = tokenizers
    assert len(full.added_tokens_decoder) > 6000
    assert len(slim.added_tokens_decoder) < 200
    assert len(slim.placeholder_ids) == len(full.added_tokens_decoder) - len(slim.added_tokens_decoder)
    assert len(slim) == len(full) and slim.get_vocab() == full.get_vocab()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encoding_equals_the_full_tokenizer(tokenizers: tuple[Any, Any], add_special_tokens: bool) -> None:
    slim, full = tokenizers
    for text in TEXTS:
        assert slim.encode(text, add_special_tokens=add_special_tokens) == full.encode(
            text, add_special_tokens=add_special_tokens
        ), text


def test_chat_template_and_decoding_equal_the_full_tokenizer(tokenizers: tuple[Any, Any]) -> None:
    slim, full = tokenizers
    unused = full.convert_tokens_to_ids(["<unused5>", "<unused6241>"])
    ids = [2, *unused[:1], 9259, 1902, *unused[1:], 106, 1]
    for skip in (True, False):
        expected = full.decode(ids, skip_special_tokens=skip)
        assert slim.decode(ids, skip_special_tokens=skip) == expected
        assert TextDecoder(slim, skip)(ids) == expected  # the engine's fast path
    assert slim.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
    assert slim.all_special_ids == full.all_special_ids


def test_grammar_engines_read_the_full_vocabulary(tokenizers: tuple[Any, Any], folder: Path) -> None:
    slim, _ = tokenizers
    spec = json.loads(tokenizer_json(slim))
    assert len(spec["added_tokens"]) == len(json.loads((folder / "tokenizer.json").read_text())["added_tokens"])


def test_it_holds_a_fraction_of_the_memory(folder: Path) -> None:
    """Resident memory added by loading the tokenizer, in a fresh process (the full one: ~260 MiB
    after malloc_trim, ~380 MiB before)."""
    probe = (
        "import re,sys,gc,ctypes; from pathlib import Path\n"
        "def rss(): return int(re.search(r'VmRSS:\\s+(\\d+)', Path('/proc/self/status').read_text()).group(1))//1024\n"
        "from servelm.runtime.tokenizer import load_tokenizer\n"
        "r = rss(); t = load_tokenizer(sys.argv[1]); gc.collect(); ctypes.CDLL('libc.so.6').malloc_trim(0); print(rss() - r)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, check=True)
    mib = int(out.stdout.split()[-1])
    print(f"resident MiB added by loading the Gemma 3 tokenizer: {mib}")
    assert mib < 150, f"loading the tokenizer added {mib} MiB"


def test_replicas_starting_at_once_share_one_complete_folder(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four processes load the tokenizer at once on an empty cache: each gets the slim tokenizer."""
    monkeypatch.setenv("SERVELM_CACHE", str(tmp_path / "cache"))
    probe = "import sys; from servelm.runtime.tokenizer import load_tokenizer; print(len(load_tokenizer(sys.argv[1]).placeholder_ids))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", probe, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-500:] for _, e in outs]
    counts = {int(o.split()[-1]) for o, _ in outs}
    assert len(counts) == 1 and counts.pop() > 6000, counts
    (slim,) = (tmp_path / "cache" / "tokenizers").iterdir()  # one folder, no temporaries left
    assert (slim / "placeholder_tokens.json").is_file() and (slim / "tokenizer.json").is_file()
