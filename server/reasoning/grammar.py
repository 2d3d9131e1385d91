"""Structured outputs under a reasoning parser: the grammar constrains the answer after the thinking.

The request's spec becomes one llguidance Lark grammar: free thinking text closed by the end tag, then the
spec (nested: ``%json``, a regex, the choices, or ``%lark {…}`` for a grammar). The thinking is required
when the prompt opened it, optional when the output may open it, absent when the prompt closed it. A tag
that is one token of the vocabulary is named as that token (llguidance matches added tokens only so);
the thinking text may not spell the end tag in pieces either, so the grammar and the splitter
(``server.reasoning.stream``) always agree on where the answer begins.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from servelm.server.reasoning.parsers import ReasoningMode

if TYPE_CHECKING:  # the CLI names the parsers without importing the engine's side
    from servelm.scheduler.structured_output import StructuredOutput

# Whitespace between the end tag and the answer (Qwen3 writes two newlines); bounded, as JSON's is.
_GAP = r"/[ \t\r\n]{0,4}/"


def _tag(tag: str, added: dict[str, int]) -> str:
    return tag if tag in added else json.dumps(tag)


def _lark_regex(text: str) -> str:
    """A regex as a Lark ``/…/`` literal (its unescaped slashes escaped)."""
    return "/" + re.sub(r"(?<!\\)/", r"\/", text) + "/"


def _answer(spec: StructuredOutput) -> str:
    from servelm.scheduler.structured_output import JSON_WHITESPACE

    if spec.kind == "json":
        schema = json.loads(spec.value)
        guidance: dict[str, Any] = {"whitespace_flexible": spec.whitespace_flexible}
        if spec.whitespace_flexible:
            guidance["whitespace_pattern"] = JSON_WHITESPACE
        return "%json " + json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)
    if spec.kind == "regex":
        return _lark_regex(spec.value)
    if spec.kind == "choice":
        return "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.value)) + ")"
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(spec.value)
    except Exception:  # not GBNF after all: compiled as given, where its error is named
        lark = spec.value
    return "%lark {\n" + lark + "\n}"


def after_thinking(spec: StructuredOutput, mode: ReasoningMode, tokenizer: Any) -> StructuredOutput:
    """``spec`` applied to the answer after ``mode``'s thinking (``spec`` itself when the prompt closed
    the thinking). Runs in the tokenizer thread (it reads the added vocabulary)."""
    from servelm.scheduler.structured_output import StructuredOutput

    if mode.phase == "answer":
        return spec
    parser = mode.parser
    added = tokenizer.get_added_vocab()
    start, end = _tag(parser.start, added), _tag(parser.end, added)
    # Any text that does not contain the end tag.
    free = "/(.|\\n)*/ & ~" + _lark_regex("(.|\\n)*" + re.escape(parser.end) + "(.|\\n)*")
    if mode.phase == "thinking":
        head = f"start: think answer\nthink: {start}? THINKING {end} GAP\n"
    else:
        head = f"start: think? answer\nthink: {start} THINKING {end} GAP\n"
    lark = f"{head}THINKING: {free}\nGAP: {_GAP}\nanswer: {_answer(spec)}\n"
    return StructuredOutput("grammar", lark, param=spec.param, whitespace_flexible=spec.whitespace_flexible)
