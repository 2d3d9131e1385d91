"""Grammars that hold a family's tool calls to the declared tools, in the family's own syntax.

llama.cpp's "lazy grammar", as one llguidance Lark grammar: under ``tool_choice: "auto"`` the answer
is free text until the family's start marker, and from the marker on it must be calls (each a
declared tool's name and arguments valid for its ``parameters`` schema) in the family's format, then
the end. ``required`` starts with the marker; a named function allows that one call only. A marker
that is one token of the vocabulary is named as that token (llguidance matches added tokens only so,
and free text then cannot contain it); one that is text is kept out of the free text by a regex.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Whitespace around and between calls: none, or one space or newline (Qwen writes a newline on each side
# of the JSON inside <tool_call> and between blocks). A model that wants to end where the grammar has
# no end yet puts its probability on the whitespace allowed there: a wider gap is where it wanders.
_GAP = "/[ \\n]?/"
_ANY = "(?s:.+)"


def call_schema(name: str, parameters: dict[str, Any], key: str = "arguments") -> dict[str, Any]:
    """One call of tool ``name``: ``{"name": name, key: <its parameters>}``."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }


class Vocabulary:
    """Writes a family's markers into a grammar, as tokens where the tokenizer has them."""

    def __init__(self, tokenizer: Any) -> None:
        self.added: dict[str, int] = dict(tokenizer.get_added_vocab()) if tokenizer is not None else {}

    def has(self, marker: str) -> bool:
        return marker in self.added

    def lit(self, marker: str) -> str:
        return f"<[{self.added[marker]}]>" if marker in self.added else json.dumps(marker)

    def after_text(self, marker: str) -> tuple[str, dict[str, str]]:
        """Grammar for "any text (none too), then ``marker``" and the rules it needs. A text marker
        is found by one lazy lexeme that ends at its first occurrence (free text followed by a text
        marker would leave llguidance's greedy lexer inside the text when the marker arrives)."""
        if self.has(marker):
            return f"TEXT? {self.lit(marker)}", {}
        return "head", {"head[lazy]": f"/(?s:.*){_regex(marker)}/"}

    def text_without(self, *markers: str, first: str = "") -> str:
        """A terminal: any non-empty text (beginning with a character of class ``first``) in which
        none of the markers that are text (not tokens) occurs."""
        head = f"/{first}(?s:.*)/" if first else f"/{_ANY}/"
        for m in markers:
            if not self.has(m):
                head += f" & ~/(?s:.*){_regex(m)}(?s:.*)/"
        return head


def _regex(text: str) -> str:
    return re.sub(r"/", r"\/", re.escape(text))


def json_rule(schema: dict[str, Any], whitespace: str) -> str:
    """``%json`` of ``schema`` with the whitespace every JSON answer is bounded to."""
    guidance = {"whitespace_flexible": True, "whitespace_pattern": whitespace}
    return "%json " + json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)


def any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def lark(start: str, rules: dict[str, str]) -> str:
    return "\n".join([f"start: {start}", *(f"{k}: {v}" for k, v in rules.items()), f"GAP: {_GAP}", ""])
