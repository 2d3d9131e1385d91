"""Workloads for ``servelm bench``: random prompts of exact token length, or a JSONL file.

Random prompts are random token ids decoded to text, re-encoded and trimmed (or topped up) until
the text re-encodes to exactly the wanted number of tokens, so the server computes the prompt
length the benchmark asked for (with the same tokenizer; the server's usage is the final word).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the benchmark uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class BenchRequest:
    """One request of a workload."""

    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict[str, Any]] | None  # chat
    prompt_len: int | None  # tokens of the prompt text by the local tokenizer (None: unknown)
    max_tokens: int


def load_tokenizer(path: str | Path) -> Tokenizer:
    from transformers import AutoTokenizer

    # transformers types decode as str | list[str] (a list for batched input); one sequence gives a str.
    return cast(Tokenizer, AutoTokenizer.from_pretrained(str(path)))


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _ordinary_ids(tokenizer: Any) -> list[int]:
    """Token ids that are plain vocabulary (no special or added tokens such as <|im_start|>)."""
    size = len(tokenizer)
    excluded = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "get_added_vocab", None)
    if added is not None:
        excluded.update(added().values())
    return [i for i in range(size) if i not in excluded]


class RandomPromptMaker:
    """Builds text prompts that re-encode to an exact token count, from a seeded generator."""

    MAX_ROUNDS = 24

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng
        self.vocab = _ordinary_ids(tokenizer)

    def random_ids(self, n: int) -> list[int]:
        return [self.vocab[self.rng.randrange(len(self.vocab))] for _ in range(n)]

    def text(self, num_tokens: int, prefix: str = "") -> tuple[str, int]:
        """Text of ``prefix`` + random tokens re-encoding to ``num_tokens`` in all; (text, real count).

        The count equals ``num_tokens`` except in the rare case where the tokenizer keeps merging
        at the edges; then the closest text found is returned with its real count.
        """
        base = count_tokens(self.tok, prefix) if prefix else 0
        want = num_tokens - base
        if want <= 0:
            return prefix, base
        suffix = self.random_ids(want)
        best: tuple[int, str, int] | None = None
        for _ in range(self.MAX_ROUNDS):
            text = prefix + self.tok.decode(suffix)
            n = count_tokens(self.tok, text)
            if n == num_tokens:
                return text, n
            if best is None or abs(n - num_tokens) < best[0]:
                best = (abs(n - num_tokens), text, n)
            # Re-encode the suffix alone (decode/encode is not an identity on random ids), then fix
            # the length by the difference seen on the whole text.
            suffix = self.tok.encode(self.tok.decode(suffix), add_special_tokens=False)
            diff = n - num_tokens
            if diff > 0:
                suffix = suffix[: max(1, len(suffix) - diff)]
            else:
                suffix = suffix + self.random_ids(-diff)
        assert best is not None
        log.warning("random prompt: wanted %d tokens, closest text has %d", num_tokens, best[2])
        return best[1], best[2]


def _lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    lo = max(1, round(mean * (1 - range_ratio)))
    hi = max(lo, round(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    endpoint: str = "completions",
    token_ids: bool = False,
) -> list[BenchRequest]:
    """``num_prompts`` random prompts of ``prefix_len`` shared tokens + input_len*(1±range_ratio) tokens.

    Output lengths are drawn the same way from ``output_len``. ``token_ids`` (completions only)
    sends the prompt as token ids, skipping the text round trip.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if token_ids and endpoint != "completions":
        raise ValueError("token-id prompts need the completions endpoint")
    rng = random.Random(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    maker = RandomPromptMaker(tokenizer, rng)
    out: list[BenchRequest] = []
    if token_ids:
        prefix_ids = maker.random_ids(prefix_len)
        for n_in, n_out in zip(in_lens, out_lens):
            ids = prefix_ids + maker.random_ids(n_in)
            out.append(BenchRequest(ids, None, len(ids), n_out))
        return out
    prefix = maker.text(prefix_len)[0] if prefix_len > 0 else ""
    for n_in, n_out in zip(in_lens, out_lens):
        text, n = maker.text(prefix_len + n_in, prefix)
        if endpoint == "chat":
            out.append(BenchRequest(None, [{"role": "user", "content": text}], n, n_out))
        else:
            out.append(BenchRequest(text, None, n, n_out))
    return out


def jsonl_requests(
    path: str | Path,
    num_prompts: int | None,
    default_max_tokens: int,
    endpoint: str = "completions",
    tokenizer: Tokenizer | None = None,
) -> list[BenchRequest]:
    """Requests from a JSONL file of ``{"prompt": ..., "max_tokens": ...}`` or ``{"messages": [...]}``.

    The first ``num_prompts`` lines are used, cycling when the file is shorter. A ``prompt`` line
    sent to the chat endpoint becomes one user message; a ``messages`` line needs the chat endpoint.
    """
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
            raise ValueError(f"{path}:{lineno}: expected an object with 'prompt' or 'messages'")
        if "messages" in row and endpoint != "chat":
            raise ValueError(f"{path}:{lineno}: 'messages' rows need --endpoint chat")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    n = num_prompts or len(rows)
    out: list[BenchRequest] = []
    for i in range(n):
        row = rows[i % len(rows)]
        max_tokens = int(row.get("max_tokens") or default_max_tokens)
        if "messages" in row:
            messages = row["messages"]
            text = "".join(str(m.get("content", "")) for m in messages)
            out.append(BenchRequest(None, messages, count_tokens(tokenizer, text) if tokenizer else None, max_tokens))
            continue
        prompt = row["prompt"]
        if isinstance(prompt, list):
            if endpoint == "chat":
                raise ValueError(f"{path}: token-id prompts need --endpoint completions")
            out.append(BenchRequest([int(t) for t in prompt], None, len(prompt), max_tokens))
            continue
        plen = count_tokens(tokenizer, prompt) if tokenizer else None
        if endpoint == "chat":
            out.append(BenchRequest(None, [{"role": "user", "content": prompt}], plen, max_tokens))
        else:
            out.append(BenchRequest(prompt, None, plen, max_tokens))
    return out
