"""A JSON value read one character at a time, knowing where each child of its root begins and ends.

Tool-call parsers stream a call's arguments as the model writes them, so they must know, after every
chunk, whether the text so far can still become valid JSON and which characters belong to the
``"arguments"`` member. Incremental JSON libraries hand out parsed values or events, not character
offsets, hence this small validator (the finished value is still checked by ``json.loads``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
# Number states in which the number may end (JSON's grammar: -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?).
_NUMBER_ENDS = {"zero", "int", "frac", "exp"}


@dataclass
class Child:
    """One member of the root object (``key`` set) or item of the root array: its text is
    ``text[start:end]``, ``end`` None while it is still being written."""

    key: str | None
    start: int
    end: int | None = None


class JsonScanner:
    """Validates a JSON object or array as a prefix, character by character.

    ``feed`` stops at the character that completes the root (the rest belongs to whatever follows
    the value) or at the first character that no JSON could continue with (``failed``).
    """

    def __init__(self, root: str = "{") -> None:
        self.root = root  # "{" or "[": the value must be of that kind
        self.text = ""  # what was consumed, from the root's first character (leading whitespace dropped)
        self.children: list[Child] = []
        self.done = False
        self.failed = False
        self._stack: list[str] = []  # open containers, "{" or "["
        self._state = "root"
        self._key_start = 0  # where the root object's current key string began
        self._key: str | None = None  # the root object's key whose value comes next
        self._pending = ""  # a literal's remaining characters
        self._number = ""  # a number's state

    def feed(self, chunk: str) -> int:
        """Consume ``chunk``; returns how many of its characters belong to the value."""
        for i, ch in enumerate(chunk):
            if self.done or self.failed:
                return i
            if self._state == "root" and ch in _WS:
                continue
            if not self._step(ch):
                self.failed = True
                return i
        return len(chunk)

    # One character; False when it cannot continue any JSON value.
    def _step(self, ch: str) -> bool:
        s = self._state
        pos = len(self.text)
        self.text += ch
        if s == "number":
            if self._number_step(ch):
                return True
            if self._number not in _NUMBER_ENDS:
                return False
            self._end_value(pos)  # the number ended just before this character
            self.text = self.text[:-1]
            return self._step(ch)
        if s == "string" or s == "key":
            if ch == "\\":
                self._state = s + "\\"
            elif ch == '"':
                if s == "key":
                    self._close_key(pos)
                else:
                    self._end_value(pos + 1)
            elif ch < " ":
                return False
            return True
        if s in ("string\\", "key\\"):
            if ch == "u":
                self._state, self._pending = s[:-1] + "u", "xxxx"
                return True
            self._state = s[:-1]
            return ch in _ESCAPES
        if s in ("stringu", "keyu"):
            self._pending = self._pending[1:]
            if not self._pending:
                self._state = s[:-1]
            return ch in _HEX
        if s == "literal":
            if ch != self._pending[0]:
                return False
            self._pending = self._pending[1:]
            if not self._pending:
                self._end_value(pos + 1)
            return True
        if ch in _WS:
            return True
        if s == "root":
            if ch != self.root:
                return False
            self._stack.append(ch)
            self._state = "key_or_close" if ch == "{" else "value_or_close"
            return True
        if s in ("key_or_close", "key_next"):
            if ch == "}" and s == "key_or_close":
                return self._close(pos)
            if ch != '"':
                return False
            self._state = "key"
            if len(self._stack) == 1:
                self._key_start = pos
            return True
        if s == "colon":
            self._state = "value"
            return ch == ":"
        if s == "after_value":
            top = self._stack[-1]
            if ch == ",":
                self._state = "key_next" if top == "{" else "value"
                return True
            if (ch == "}" and top == "{") or (ch == "]" and top == "["):
                return self._close(pos)
            return False
        if s == "value_or_close" and ch == "]":
            return self._close(pos)
        return self._start_value(ch, pos)

    def _start_value(self, ch: str, pos: int) -> bool:
        if len(self._stack) == 1:
            self.children.append(Child(self._key, pos))
        if ch in "{[":
            self._stack.append(ch)
            self._state = "key_or_close" if ch == "{" else "value_or_close"
        elif ch == '"':
            self._state = "string"
        elif ch == "-" or ch in _DIGITS:
            self._state, self._number = "number", ("minus" if ch == "-" else "zero" if ch == "0" else "int")
        elif ch in _LITERALS:
            self._state, self._pending = "literal", _LITERALS[ch][1:]
        else:
            return False
        return True

    def _number_step(self, ch: str) -> bool:
        n = self._number
        digit = ch in _DIGITS
        if n == "minus" and digit:
            self._number = "zero" if ch == "0" else "int"
        elif n in ("int", "frac", "exp") and digit:
            pass
        elif n in ("zero", "int") and ch == ".":
            self._number = "dot"
        elif n in ("zero", "int", "frac") and ch in "eE":
            self._number = "e"
        elif n == "e" and ch in "+-":
            self._number = "esign"
        elif n == "dot" and digit:
            self._number = "frac"
        elif n in ("e", "esign") and digit:
            self._number = "exp"
        else:
            return False
        return True

    def _close_key(self, pos: int) -> None:
        self._state = "colon"
        if len(self._stack) == 1:
            self._key = json.loads(self.text[self._key_start : pos + 1])

    def _close(self, pos: int) -> bool:
        self._stack.pop()
        if not self._stack:
            self.done = True
            return True
        self._end_value(pos + 1)
        return True

    def _end_value(self, end: int) -> None:
        self._number = ""
        if len(self._stack) == 1:
            self.children[-1].end = end
        self._state = "after_value"

    def child(self, *keys: str) -> Child | None:
        """The root object's first member named one of ``keys``."""
        return next((c for c in self.children if c.key in keys), None)
