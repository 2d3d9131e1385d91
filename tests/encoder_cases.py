"""Texts and references for the encoder tests: varied inputs nobody tuned to, and sentence-transformers'
own ``encode`` (or llama.cpp's, for a GGUF file) as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Several languages and scripts, code, punctuation, numbers, accents, a single word.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Le gouvernement a annoncé mardi une réforme des retraites très contestée.",
    "Der Bundestag hat am Donnerstag über das neue Klimaschutzgesetz abgestimmt.",
    "東京は日本の首都であり、世界最大の都市圏の一つです。",
    "Москва — столица России, крупнейший город страны.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name;",
    "¿Dónde está la biblioteca? Está a 3,5 km, al lado del café «Olé».",
    "embeddings",
    'In 1969, Apollo 11 landed on the Moon; Neil Armstrong said: "That\'s one small step..."',
]

_LONG_SOURCE = (
    "Retrieval systems split long documents into passages, embed each passage, and compare a query's "
    "vector with theirs; the longest passage an encoder takes is its maximum sequence length. "
)


def text_of_tokens(tokenizer: Any, n: int) -> str:
    """A text that encodes to exactly ``n`` tokens, special tokens included (a document at the limit)."""
    body = tokenizer(_LONG_SOURCE * (n // 8 + 2), add_special_tokens=False)["input_ids"]
    special = len(tokenizer("")["input_ids"])
    text = tokenizer.decode(body[: n - special])
    got = len(tokenizer(text)["input_ids"])
    assert got == n, f"{got} tokens, wanted {n}"
    return text


def st_encode(folder: Path, texts: list[str], **kwargs: Any) -> torch.Tensor:
    """sentence-transformers' embeddings of ``texts`` (float32, CPU), the reference."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, **kwargs).float().cpu()


def cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).tolist()
