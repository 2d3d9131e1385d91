"""Loading the tokenizer that belongs to a model folder (local files only: serving never downloads).

Some vocabularies reserve thousands of placeholder tokens (Gemma 3: 6,242 ``<unusedN>``) as special
added tokens. The ``tokenizers`` library matches added tokens with an automaton whose size grows with
their number: Gemma 3's costs ~290 MiB per tokenizer object, and a server holds two. When a folder
has many such placeholders (special, never named by the config or the chat template, and already in
the model's vocabulary under the same id) the tokenizer is loaded without them from a derived folder
in the cache, and ``PlaceholderAware`` gives back their meaning: a text that spells one is encoded
with a sentinel in its place, and decoding with ``skip_special_tokens`` drops their ids. The ids are
those of the full tokenizer (tests compare both).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from servelm.runtime.config import UnsupportedModelError

# Below this many placeholders the automaton is small (~45 KiB per token): load the folder as it is.
MIN_PLACEHOLDERS = 256
PLACEHOLDERS_FILE = "placeholder_tokens.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "sep_token", "cls_token")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer (with its chat template) stored in ``path``."""
    path = Path(path)
    slim = _slim_folder(path) if (path / "tokenizer.json").is_file() else None
    try:
        tok = AutoTokenizer.from_pretrained(str(slim or path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: cannot load a tokenizer ({e})") from e
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise UnsupportedModelError(f"{path}: expected a fast (tokenizer.json) tokenizer, got {type(tok).__name__}")
    # transformers 5 keeps the vocabulary and merges it built the Rust tokenizer from as Python
    # objects (Gemma 3: ~170 MiB); nothing reads them after construction.
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tok, name, None), (dict, list)):
            setattr(tok, name, type(getattr(tok, name))())
    # Encoding then only reads the Rust tokenizer (transformers clears these on a call that finds them
    # set, a write): the server's threads and the engine's share one tokenizer.
    backend = tok.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    if slim is not None:
        placeholders = json.loads((slim / PLACEHOLDERS_FILE).read_text())
        PlaceholderAware.adopt(tok, {str(k): int(v) for k, v in placeholders.items()}, path / "tokenizer.json")
    return tok


def tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer's full ``tokenizers`` JSON, placeholders included (what grammar engines read)."""
    source = getattr(tokenizer, "source_tokenizer_json", None)
    if source is not None:
        return Path(source).read_text(encoding="utf-8")
    return str(tokenizer.backend_tokenizer.to_str())


class PlaceholderAware:
    """Mixed into a loaded tokenizer's class: the placeholders it was loaded without keep their ids."""

    placeholder_ids: frozenset[int] = frozenset()
    source_tokenizer_json: Path | None = None
    _placeholders: dict[str, int]
    _pattern: re.Pattern[str]
    _sentinel: tuple[str, int]

    @classmethod
    def adopt(cls, tok: Any, placeholders: dict[str, int], source: Path) -> None:
        base = type(tok)
        tok.__class__ = type(base.__name__, (cls, base), {"base_class": base})
        tok._placeholders = placeholders
        tok.placeholder_ids = frozenset(placeholders.values())
        tok.source_tokenizer_json = source
        # The sentinel: a special added token the slim tokenizer still splits out, that no
        # post-processor adds (bos/eos would be ambiguous) and that no placeholder overlaps.
        named = {str(getattr(tok, n, None)) for n in _NAMED_SPECIAL[:2]}
        candidates = [
            (t.content, i)
            for i, t in sorted(tok.added_tokens_decoder.items())
            if t.special and not t.normalized and t.content not in named and not t.lstrip and not t.rstrip
        ]
        if not candidates:
            raise UnsupportedModelError(f"{source}: no special token to stand in for its placeholder tokens")
        tok._sentinel = candidates[-1]
        tok._pattern = re.compile(trie_regex([tok._sentinel[0], *placeholders]))

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> list[int]:
        if not isinstance(text, str) or not self._spells_placeholder(text):
            return super().encode(text, *args, **kwargs)  # type: ignore[misc]
        if args or kwargs.keys() - {"add_special_tokens"}:
            raise NotImplementedError("a text that spells a placeholder token is encoded with add_special_tokens only")
        found = [m.group(0) for m in self._pattern.finditer(text)]
        sentinel, sentinel_id = self._sentinel
        ids = super().encode(self._pattern.sub(sentinel, text), **kwargs)  # type: ignore[misc]
        stand_ins = iter(self._placeholders.get(s, sentinel_id) for s in found)
        return [next(stand_ins) if i == sentinel_id else i for i in ids]

    def _spells_placeholder(self, text: str) -> bool:
        return any(m.group(0) != self._sentinel[0] for m in self._pattern.finditer(text))

    def _decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if skip_special_tokens:
            ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
            token_ids = [i for i in ids if i not in self.placeholder_ids]
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)  # type: ignore[misc]


def trie_regex(words: list[str]) -> str:
    """A regex matching any of ``words``, longest first (as the tokenizers library matches added
    tokens), shaped as a trie so that thousands of words sharing a prefix cost one branch each step."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def render(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + render(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:  # a word ends here: try the longer ones first (greedy)
            return (f"(?:{body})" if len(branches) == 1 and len(body) > 1 else body) + "?"
        return body

    return render(trie)


def _slim_folder(path: Path) -> Path | None:
    """The cached folder that loads ``path``'s tokenizer without its placeholders; None when it has few."""
    from servelm.runtime.model_files import cache_dir

    source = path / "tokenizer.json"
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "tokenizers" / key
    if not (folder / PLACEHOLDERS_FILE).is_file():
        _write_slim_folder(path, folder)
    return folder if (folder / "tokenizer.json").is_file() else None


def _write_slim_folder(path: Path, folder: Path) -> None:
    """Write ``folder`` whole in a temporary folder and rename it into place: replicas starting at once on
    a shared cache each see no folder or a complete one."""
    spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    placeholders = _placeholders(spec, path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        if len(placeholders) >= MIN_PLACEHOLDERS:
            spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in placeholders]
            (tmp / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
            for f in path.iterdir():
                if f.is_file() and f.name != "tokenizer.json" and not f.name.endswith(_WEIGHT_SUFFIXES):
                    (tmp / f.name).symlink_to(f.resolve())
        else:
            placeholders = {}  # few: the folder is loaded as it is
        (tmp / PLACEHOLDERS_FILE).write_text(json.dumps(placeholders), encoding="utf-8")
        try:
            tmp.rename(folder)
        except OSError:  # another process renamed its copy first, or a crashed one left half a folder
            if not (folder / PLACEHOLDERS_FILE).is_file():
                shutil.rmtree(folder, ignore_errors=True)
                tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _placeholders(spec: dict[str, Any], path: Path) -> dict[str, int]:
    """Special added tokens the model's vocabulary already holds under the same id, never named by
    the tokenizer config or a chat template: their only job is to be matched in input text."""
    vocab = spec.get("model", {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [piece, score] by id

        def in_vocab(content: str, i: int) -> bool:
            return 0 <= i < len(vocab) and vocab[i][0] == content

    elif isinstance(vocab, dict):

        def in_vocab(content: str, i: int) -> bool:
            return vocab.get(content) == i

    else:
        return {}
    named = _named_text(path)
    return {
        t["content"]: int(t["id"])
        for t in spec.get("added_tokens", [])
        if t.get("special")
        and not t.get("normalized")
        and in_vocab(t["content"], int(t["id"]))
        and t["content"] not in named
    }


def _named_text(path: Path) -> str:
    """Everything in the folder's tokenizer config and chat templates that can name a token."""
    parts = []
    for name in (
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
    ):
        f = path / name
        if f.is_file():
            parts.append(f.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts)
