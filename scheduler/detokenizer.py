"""Incremental detokenization: text deltas from new token ids without re-decoding the whole output."""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


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

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window (already emitted)
        self.read_offset = 0  # first token whose text has not been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        # The tokenizer's own decode settings, so that deltas add up to what ``decode`` gives.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now final (may be "")."""
        self.token_ids.extend(new_token_ids)
        ids = self.token_ids
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            return delta
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
