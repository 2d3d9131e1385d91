"""Calls small models write without their family's markers: the whole answer one JSON object
``{"name": ..., "arguments": {...}}`` (or ``"parameters"``, as Llama writes it), bare or in one fenced
```` ```json ```` block.

Small chat models trained for ``<tool_call>`` blocks often drop the markers under "auto" (Qwen2.5-Coder's
0.5B and 1.5B files answer a weather question with a bare object or a fenced one). Such an answer is a
call only where nothing else can be meant: the object (or its fenced block) is the whole answer, whitespace
aside; its name is a declared tool; it has no member besides the name and the arguments; and the arguments
are valid for that tool's ``parameters`` schema. Any other answer goes to the family's parser unchanged, so
an answer that merely contains JSON stays an answer.

Streamed, an answer is held back only while it can still be such a call (its start is a fence or ``{``,
the members seen so far fit), and the call is sent when the answer ends, since only the end tells that the
object was the whole answer. Whatever rules it out lets the held text go on to the family's parser at once.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeGuard

from jsonschema import Draft202012Validator, validators

from servelm.server.tool_parsers.base import ParsedOutput, ParserDelta, ToolParser, Tools, parse_text
from servelm.server.tool_parsers.json_scan import JsonScanner
from servelm.server.tool_parsers.readers import ARGUMENT_KEYS

# A fence's first line: three backticks, "json" or no language, then the end of the line.
_FENCE = re.compile(r"```(?:json)?[ \t]*\n", re.IGNORECASE)
# What may still grow into that line.
_FENCE_START = re.compile(r"`{0,3}|```(?:j|js|jso|json[ \t]*)", re.IGNORECASE)
_KEYS = ("name", *ARGUMENT_KEYS)


class UnmarkedCalls:
    """A family's parser (``parser``) that also reads one unmarked call of ``tools`` as the whole answer.

    It has the parser's ``feed`` / ``finish`` / ``parse`` and counters, so an answer stream takes either.
    """

    def __init__(self, parser: ToolParser, tools: Tools) -> None:
        self.parser = parser
        self._schemas = dict(tools)
        # A family whose own calls start with a bare object (Llama 3) reads those itself, as they stream.
        self._bare = "{" not in parser.start_openers
        self._held = ""  # the answer so far, while it may be an unmarked call
        self._deciding = bool(tools)
        self._fenced = False
        self._scan: JsonScanner | None = None
        self._tail = ""  # text after the object
        self._call = False  # the answer was an unmarked call

    @property
    def calls(self) -> int:
        return 1 if self._call else self.parser.calls

    @property
    def complete(self) -> int:
        return 1 if self._call else self.parser.complete

    @property
    def malformed(self) -> bool:
        return not self._call and self.parser.malformed

    def parse(self, text: str) -> ParsedOutput:
        return parse_text(self, text)

    def feed(self, text: str) -> ParserDelta:
        if not self._deciding:
            return self.parser.feed(text)
        self._held += text
        if self._still_possible(text):
            return ParserDelta()
        return self._hand_over()

    def finish(self) -> ParserDelta:
        if not self._deciding:
            return self.parser.finish()
        call = self._whole_call()
        if call is None:
            out = self._hand_over()
            return _joined(out, self.parser.finish())
        self._deciding, self._call = False, True
        out = ParserDelta()
        out.add(0, *call)
        return out

    def _hand_over(self) -> ParserDelta:
        self._deciding = False
        held, self._held = self._held, ""
        return self.parser.feed(held)

    def _still_possible(self, new: str) -> bool:
        """Whether the answer so far (``new`` its latest text) may still be an unmarked call."""
        if self._scan is None:
            head = self._held.lstrip()
            fence = _FENCE.match(head)
            if fence is not None:
                self._fenced = True
                body = head[fence.end() :]
            elif head.startswith("{") and self._bare:
                body = head
            else:
                return _FENCE_START.fullmatch(head) is not None
            self._scan = JsonScanner("{")
            new = body
        scan = self._scan
        if not scan.done:
            taken = scan.feed(new)
            if scan.failed or not self._members_fit():
                return False
            new = new[taken:] if scan.done else ""
        self._tail += new
        closing = r"\s*(?:`{1,3}\s*)?" if self._fenced else r"\s*"
        return re.fullmatch(closing, self._tail) is not None

    def _members_fit(self) -> bool:
        """No member but a name and one kind of arguments, and a name (once whole) that is a tool's."""
        assert self._scan is not None
        scan = self._scan
        keys = [c.key for c in scan.children]
        if any(k not in _KEYS for k in keys) or len(keys) != len(set(keys)) or all(k in keys for k in ARGUMENT_KEYS):
            return False
        name = scan.child("name")
        if name is None or name.end is None:
            return True
        return self._declared(_loads(scan.text[name.start : name.end]))

    def _declared(self, name: Any) -> TypeGuard[str]:
        return isinstance(name, str) and name in self._schemas

    def _whole_call(self) -> tuple[str, str] | None:
        """The answer's call as (name, arguments text), or None where the answer is no call."""
        scan = self._scan
        closing = r"\s*(?:```\s*)?" if self._fenced else r"\s*"
        if scan is None or not scan.done or re.fullmatch(closing, self._tail) is None:
            return None
        name = _loads(scan.text[c.start : c.end]) if (c := scan.child("name")) is not None else None
        if not self._declared(name):
            return None
        child = scan.child(*ARGUMENT_KEYS)
        arguments = scan.text[child.start : child.end] if child is not None and child.end is not None else "{}"
        value = _loads(arguments)
        if not isinstance(value, dict) or not _valid(value, self._schemas[name]):
            return None
        return name, arguments


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _valid(value: dict[str, Any], schema: dict[str, Any]) -> bool:
    """Whether ``value`` is valid for ``schema`` (JSON Schema 2020-12 unless it names its draft)."""
    validator = validators.validator_for(schema, default=Draft202012Validator)
    return bool(validator(schema).is_valid(value))


def _joined(a: ParserDelta, b: ParserDelta) -> ParserDelta:
    a.content += b.content
    for c in b.calls:
        a.add(c.index, c.name, c.arguments)
    return a
