"""Incremental detokenization: text deltas from new token ids without re-decoding the whole output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

_REPLACEMENT = "\ufffd"


def _backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The ``tokenizers`` backend's decode when ``tokenizer.decode`` is exactly that call, else None.

    That holds for a fast HF tokenizer that overrides neither ``decode`` nor ``_decode`` and does not
    clean up tokenization spaces; the HF wrapper around it then only converts and checks its input,
    which costs several times the decode of a step's couple of tokens.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    # A tokenizer loaded without its placeholder tokens (runtime.tokenizer) decodes as its own class,
    # with those ids dropped where special tokens are skipped.
    cls = getattr(tokenizer, "base_class", type(tokenizer))
    if (
        not isinstance(tokenizer, PreTrainedTokenizerFast)
        or cls.decode is not PreTrainedTokenizerFast.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    decode = partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    dropped: frozenset[int] = getattr(tokenizer, "placeholder_ids", frozenset())
    if skip_special_tokens and dropped:
        return lambda ids: decode([i for i in ids if i not in dropped])
    return decode


class TextDecoder:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` for one setting, cheap enough for every step.

    Goes straight to the ``tokenizers`` backend where that is what ``decode`` does (``_backend_decode``),
    and remembers the text of single tokens: the detokenizer's context window is usually the one token
    emitted the step before. One instance can serve every request with the same setting (the engine
    shares them); the memo is bounded by the vocabulary.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = _backend_decode(tokenizer, skip_special_tokens) or self._hf_decode
        self._single: dict[int, str] = {}

    def _hf_decode(self, ids: list[int]) -> str:
        # The tokenizer's own decode settings, so that deltas add up to what ``decode`` gives.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def __call__(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if len(ids) == 1:
            text = self._single.get(ids[0])
            if text is None:
                text = self._single[ids[0]] = self._decode(ids)
            return text
        return self._decode(ids)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Each step decodes only a short window: the tokens since ``prefix_offset`` (already emitted; kept
    as context because byte-level BPE merges bytes across tokens and SentencePiece strips a leading
    space from the first token of any decode) and the new ones since ``read_offset``. The delta is
    the window's text minus the text of its already-emitted part. Text ending in U+FFFD (an
    incomplete UTF-8 sequence) is held back until a later token completes it, or until ``flush``.

    Invariant (tested): the concatenated deltas plus ``flush()`` equal
    ``tokenizer.decode(all_ids, skip_special_tokens=...)``.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, *, decoder: TextDecoder | None = None) -> None:
        """``decoder``: a ``TextDecoder`` of ``tokenizer`` with the same ``skip_special_tokens`` to share."""
        if decoder is None:
            decoder = TextDecoder(tokenizer, skip_special_tokens)
        elif decoder.tokenizer is not tokenizer or decoder.skip_special_tokens != skip_special_tokens:
            raise ValueError("the shared TextDecoder was built for another tokenizer or setting")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = decoder
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window (already emitted)
        self.read_offset = 0  # first token whose text has not been emitted

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now final (may be "")."""
        ids = self.token_ids
        ids.extend(new_token_ids)
        prefix_offset, read_offset = self.prefix_offset, self.read_offset
        prefix_text = self._decode(ids[prefix_offset:read_offset])
        new_text = self._decode(ids[prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self.prefix_offset = read_offset
            self.read_offset = len(ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The text held back so far (an incomplete character is emitted as U+FFFD): call once at the end."""
        ids = self.token_ids
        if self.read_offset >= len(ids):
            return ""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        return new_text[len(prefix_text) :]
