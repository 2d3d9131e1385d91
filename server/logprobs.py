"""Token strings and bytes for logprobs, and the two OpenAI logprobs shapes (completions, chat).

A token's text is the vocabulary entry decoded to what it spells ("Ġthe" -> " the"); its bytes are
the exact UTF-8 bytes it contributes, which for byte-level BPE may be part of a multi-byte
character (its text is then "\\ufffd", its bytes still exact).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from servelm.runtime.batch import TokenLogprobs


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The inverse of the byte -> printable-character table byte-level BPE vocabularies are written in."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    name = type(decoder).__name__ if decoder is not None else ""
    if name == "ByteLevel":
        return "byte_level"
    if name == "Sequence" and "ByteFallback" in repr(decoder):
        return "sentencepiece"
    if name == "Metaspace":
        return "sentencepiece"
    return "generic"


class TokenStrings:
    """Cached ``token id -> (text, utf-8 bytes)`` for one tokenizer (event-loop use only)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._kind = _decoder_kind(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return "", []
        if token_id in self._special:
            return piece, list(piece.encode())
        raw: bytes | None = None
        if self._kind == "byte_level":
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                raw = bytes(table[c] for c in piece)
        elif self._kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = bytes([int(piece[3:5], 16)])
            else:
                raw = piece.replace("▁", " ").encode()
        if raw is None:
            text = self._tok.convert_tokens_to_string([piece])
            return text, list(text.encode())
        return raw.decode("utf-8", errors="replace"), list(raw)


# What a logprob of -inf (or NaN, which correct sampling never gives) is written as: JSON has no
# infinities, and clients expect a number (vLLM's convention).
NEGLIGIBLE_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else NEGLIGIBLE_LOGPROB


def completion_logprobs(
    strings: TokenStrings, entries: Sequence[TokenLogprobs], text_offset: int
) -> tuple[dict[str, Any], int]:
    """The legacy ``{tokens, token_logprobs, top_logprobs, text_offset}`` object for some tokens.

    ``top_logprobs`` holds the requested alternatives plus the chosen token (as OpenAI does).
    Returns the object and the text offset after these tokens.
    """
    return _legacy_logprobs(strings, [e.token_id for e in entries], entries, text_offset)


def prompt_logprobs_object(
    strings: TokenStrings, prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], k: int
) -> dict[str, Any]:
    """The legacy object for an echoed prompt (``echo`` with ``logprobs`` k): one entry per prompt token,
    the first with ``null`` logprob and alternatives (nothing precedes it); offsets from 0."""
    return _legacy_logprobs(strings, prompt_ids, entries, 0, k)[0]


def vllm_prompt_logprobs(
    strings: TokenStrings, entries: Sequence[TokenLogprobs | None], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None), ``{token id: {logprob, rank,
    decoded_token}}`` for the prompt's own token, then its k most likely alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {
            str(e.token_id): {
                "logprob": json_logprob(e.logprob),
                "rank": e.rank,
                "decoded_token": strings.text(e.token_id),
            }
        }
        for rank, (t, lp) in enumerate(e.top[:k], start=1):
            d.setdefault(str(t), {"logprob": json_logprob(lp), "rank": rank, "decoded_token": strings.text(t)})
        out.append(d)
    return out


def join_logprobs(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects as one (an echoed prompt's, then the completion's)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}


def _legacy_logprobs(
    strings: TokenStrings,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    text_offset: int,
    k: int | None = None,  # alternatives to keep (None: all there are)
) -> tuple[dict[str, Any], int]:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, e in zip(token_ids, entries):
        text = strings.text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if e is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(json_logprob(e.logprob))
        top = {strings.text(t): json_logprob(lp) for t, lp in (e.top if k is None else e.top[:k])}
        top.setdefault(text, json_logprob(e.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }, text_offset


def chat_logprobs_content(strings: TokenStrings, entries: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: one ``{token, logprob, bytes, top_logprobs}`` per token."""
    out: list[dict[str, Any]] = []
    for e in entries:
        text, raw = strings.get(e.token_id)
        top = []
        for t, lp in e.top:
            tt, tb = strings.get(t)
            top.append({"token": tt, "logprob": json_logprob(lp), "bytes": tb})
        out.append({"token": text, "logprob": json_logprob(e.logprob), "bytes": raw, "top_logprobs": top})
    return out
