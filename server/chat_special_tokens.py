"""Chat prompts in which the client's text cannot spell special tokens.

A chat template pastes the client's strings (message contents, system and developer text, tool results,
earlier calls' arguments, tool schemas, ``chat_template_kwargs``) between the markers it writes itself.
Encoded as one text, a ``<|im_start|>`` typed in a user message is the very token the template writes,
and forges a turn. ``SpecialTokenGuard`` wraps each special token a client string spells in two
private-use characters before rendering, then encodes the rendered text piece by piece: the template's
text as before, each wrapped token as plain text (the tokenizer's normalizer, pre-tokenizer and model,
past its added tokens). transformers 5's ``apply_chat_template(sanitize_control_tokens=True)`` works the
same way. A conversation whose strings spell no special token is rendered and encoded in one piece,
exactly as without the guard.

Special tokens are the ones ``split_special_tokens`` splits (added tokens marked special, and a slim
tokenizer's placeholders, special in the full one). Added tokens that are not special (Qwen3's
``<think>``, ``<tool_call>``) are still read as tokens, as Hugging Face tokenizers read them. A token
the template builds from a client string's pieces (``'<|' + role + '|>'``) is not one the client spells;
servelm's roles are a fixed set.
"""

from __future__ import annotations

import re
from typing import Any

from servelm.runtime.tokenizer import trie_regex

# Plane 15 private-use characters around a special token a client string spells (transformers' two).
START, END = "\U000f0000", "\U000f0001"
# Pieces of at most _SHORT characters keep their ids, up to _SHORT_CACHED of them per guard.
_SHORT, _SHORT_CACHED = 64, 4096


class SpecialTokenGuard:
    """One tokenizer's special tokens, found in a client's strings (``mark``) and encoded as text in the
    chat rendered from the marked strings (``encode``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials = {t.content: int(i) for i, t in added.items() if t.special and t.content}
        placeholder_ids = sorted(getattr(tokenizer, "placeholder_ids", ()))
        if placeholder_ids:  # runtime.tokenizer.PlaceholderAware: in the vocabulary, not added tokens
            specials.update(zip(tokenizer.convert_ids_to_tokens(placeholder_ids), placeholder_ids))
        self.special_ids = frozenset(specials.values())
        self._pattern: re.Pattern[str] | None = None
        if specials:
            alternation = trie_regex(sorted(specials))
            self._pattern = re.compile(alternation)
            self._at_end = re.compile(f"(?:{alternation})\\Z")
            # Split on a marked token (first group) or on a lone marker (second group).
            self._pieces = re.compile(f"{START}({alternation}){END}|([{START}{END}])")
        self._newline: dict[bool, list[int]] = {}
        self._short: dict[tuple[str, bool], list[int]] = {}
        self._around: tuple[list[int], list[int]] | None = None

    def mark(self, value: Any) -> Any | None:
        """``value`` (strings in lists and dicts, keys included) with each special token it spells wrapped
        in the markers, and the markers a client typed dropped (they could otherwise wrap the template's
        own tokens); None when it spells none, and is then rendered as it is."""
        pattern = self._pattern
        if pattern is None:
            return None
        found = False

        def walk(v: Any) -> Any:
            nonlocal found
            if isinstance(v, str):
                found = found or pattern.search(v) is not None
                return pattern.sub(f"{START}\\g<0>{END}", v.replace(START, "").replace(END, ""))
            if isinstance(v, dict):
                return {walk(k): walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [walk(x) for x in v]
            return v

        marked = walk(value)
        return marked if found else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of a chat rendered from marked strings: the marked tokens as plain text, the rest (the
        template's own special tokens included) as ``tokenizer.encode`` reads it."""
        ids: list[int] = []
        for piece, as_text in self._segments(text):
            if piece:
                ids += self._encode_piece(piece, as_text, first=not ids)
        if add_special_tokens:
            before, after = self._special_around()
            ids = before + ids + after
        return ids

    def _segments(self, text: str) -> list[tuple[str, bool]]:
        """``text`` cut at the markers into (piece, whether it is client text). A lone marker is what a
        template that cut a client string through a marked token left of it: the token right after a
        lone start or right before a lone end is the client's, and the text on the two sides of a lone
        marker is encoded apart, so it cannot join into a token."""
        assert self._pattern is not None  # (mark found a special token)
        parts = self._pieces.split(text)  # text, (marked token, lone marker, text)...
        texts, marked, lone = parts[0::3], parts[1::3], parts[2::3]
        out: list[tuple[str, bool]] = []
        for k, piece in enumerate(texts):
            head = self._pattern.match(piece) if k > 0 and lone[k - 1] == START else None
            if head is not None:
                out.append((head.group(0), True))
                piece = piece[head.end() :]
            tail = self._at_end.search(piece) if k < len(lone) and lone[k] == END else None
            token = marked[k] if k < len(marked) else None
            if tail is not None:
                piece, token = piece[: tail.start()], tail.group(0)
            elif token:
                # The spaces before a token join its text, as in the client's string ("Ġ<", not "Ġ", "<").
                kept = piece.rstrip(" ")
                piece, token = kept, piece[len(kept) :] + token
            out.append((piece, False))
            if token:
                out.append((token, True))
        return out

    def _encode_piece(self, piece: str, as_text: bool, first: bool) -> list[int]:
        """``piece`` as it encodes where it stands: after other text it is encoded behind a newline that
        is then removed, so that a SentencePiece tokenizer adds no word-start prefix there."""
        if first or len(piece) > _SHORT:
            return self._encode_piece_uncached(piece, as_text, first)
        # Short pieces repeat (the tokens themselves; a hostile text of thousands of them): each is
        # encoded once, not one tokenizer call per occurrence.
        ids = self._short.get((piece, as_text))
        if ids is None:
            ids = self._encode_piece_uncached(piece, as_text, first)
            if len(self._short) < _SHORT_CACHED:
                self._short[(piece, as_text)] = ids
        return list(ids)

    def _encode_piece_uncached(self, piece: str, as_text: bool, first: bool) -> list[int]:
        encode = self._plain if as_text else self._encode
        if first:
            ids = encode(piece)
        else:
            newline = self._newline.get(as_text)
            if newline is None:
                newline = self._newline[as_text] = encode("\n")
            ids = encode("\n" + piece)
            ids = ids[len(newline) :] if ids[: len(newline)] == newline else encode(piece)
        if as_text and not self.special_ids.isdisjoint(ids):  # the model's merges spell the token itself
            ids = [i for ch in piece for i in self._plain(ch)]
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _plain(self, text: str) -> list[int]:
        """``text`` through the tokenizer's pipeline without its added tokens, which only reads the
        tokenizer (transformers' ``split_special_tokens`` sets a flag on the tokenizer all threads share)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        words = (
            [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
            if backend.pre_tokenizer is not None
            else [text]
        )
        return [t.id for w in words for t in backend.model.tokenize(w)]

    def _special_around(self) -> tuple[list[int], list[int]]:
        """The ids ``add_special_tokens`` puts before and after a text (BOS, say)."""
        if self._around is None:
            inner = self._encode("a")
            outer = list(self.tokenizer.encode("a", add_special_tokens=True))
            k = next((k for k in range(len(outer) - len(inner) + 1) if outer[k : k + len(inner)] == inner), None)
            self._around = ([], []) if k is None else (outer[:k], outer[k + len(inner) :])
        return self._around


__all__ = ["END", "START", "SpecialTokenGuard"]
