"""Readers of one tool-call section's body: a call object, an array of call objects, or Mistral's
``name[ARGS]{...}``. Each sends a call's name once it is whole, then its arguments as they arrive, as
the model wrote them (the JSON text of the ``arguments`` member, so the streamed pieces join into
exactly the non-streamed arguments)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from servelm.server.tool_parsers.json_scan import JsonScanner

# Llama 3 writes "parameters" where the others write "arguments"; vLLM accepts both.
ARGUMENT_KEYS = ("arguments", "parameters")
# Text a Mistral name may be followed by before its arguments (v11+ tokenizers).
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*")
_MISTRAL_MARKS = ("[CALL_ID]", "[ARGS]")
_MAX_NAME_CHARS = 256  # a "name" longer than this is prose, not a call


@dataclass
class Piece:
    """What a reader sends: call ``index`` (within its section) named (first piece only) or argued."""

    index: int
    name: str | None
    arguments: str


class Reader:
    """A section body; ``feed`` returns how many characters it took (it stops at its end)."""

    done = False
    failed = False
    named = 0  # calls whose name was sent
    complete = 0  # calls whose text is whole (the first ones: a cut ends the last)

    def feed(self, chunk: str) -> tuple[int, list[Piece]]:
        raise NotImplementedError


class CallReader(Reader):
    """``{"name": ..., "arguments": {...}}``; with ``name`` given, the object is the arguments."""

    def __init__(self, name: str | None = None, index: int = 0) -> None:
        self._scan = JsonScanner("{")
        self._name = name
        self._index = index
        self._sent = 0  # argument characters sent
        self._has_name = False

    @property
    def complete(self) -> int:  # type: ignore[override]
        return int(self.done and not self.failed)

    def _arguments(self) -> str:
        scan = self._scan
        if self._name is not None:
            return scan.text
        child = scan.child(*ARGUMENT_KEYS)
        if child is None:  # a call without arguments takes none
            return "{}" if scan.done else ""
        return scan.text[child.start : child.end if child.end is not None else len(scan.text)]

    def feed(self, chunk: str) -> tuple[int, list[Piece]]:
        scan = self._scan
        taken = scan.feed(chunk)
        self.done = scan.done
        if scan.failed:
            self.failed = True
            return taken, []
        if not self._has_name:
            name = self._name if self._name is not None else self._find_name()
            if name is None:
                self.failed = self.failed or scan.done
                return taken, []
            self._has_name = True
            self.named = 1
            args = self._arguments()
            self._sent = len(args)
            return taken, [Piece(self._index, name, args)]
        args = self._arguments()
        new, self._sent = args[self._sent :], len(args)
        return taken, ([Piece(self._index, None, new)] if new else [])

    def _find_name(self) -> str | None:
        child = self._scan.child("name")
        if child is None or child.end is None:
            return None
        name = json.loads(self._scan.text[child.start : child.end])
        if not isinstance(name, str) or not name:
            self.failed = True
            return None
        return name


class ArrayReader(Reader):
    """``[call, call, ...]``: each item a ``CallReader``."""

    def __init__(self) -> None:
        self._scan = JsonScanner("[")
        self._items: list[CallReader] = []
        self._fed: list[int] = []  # characters of each item given to its reader

    def feed(self, chunk: str) -> tuple[int, list[Piece]]:
        scan = self._scan
        taken = scan.feed(chunk)
        pieces: list[Piece] = []
        for i, child in enumerate(scan.children):
            if i == len(self._items):
                self._items.append(CallReader(index=i))
                self._fed.append(0)
            item = self._items[i]
            end = child.end if child.end is not None else len(scan.text)
            text = scan.text[child.start + self._fed[i] : end]
            if not text or item.done:
                continue
            n, got = item.feed(text)
            self._fed[i] += n
            pieces += got
            if item.failed or n < len(text) or (child.end is not None and not item.done):
                self.failed = True
                break
        self.named = sum(item.named for item in self._items)
        self.complete = sum(item.complete for item in self._items)
        self.failed = self.failed or scan.failed or (scan.done and not self._items)
        self.done = scan.done and not self.failed
        return taken, pieces


class MistralReader(Reader):
    """After ``[TOOL_CALLS]``: a JSON array of calls (older tokenizers), or ``name[ARGS]{...}`` (v11+;
    ``[CALL_ID]id`` between them is skipped)."""

    def __init__(self) -> None:
        self._head = ""  # text before the body's kind, or before a name's arguments, is known
        self._body: Reader | None = None

    def feed(self, chunk: str) -> tuple[int, list[Piece]]:
        if self._body is not None:
            return self._take(chunk, 0)
        head = self._head + chunk
        stripped = head.lstrip()
        if stripped.startswith("["):
            self._body = ArrayReader()
            return self._take(head, len(self._head))
        brace = head.find("{")
        if brace < 0:
            if not _could_be_name(head):
                self.failed = True
                return 0, []
            self._head = head
            return len(chunk), []
        m = _MISTRAL_NAME.fullmatch(head[:brace])
        if m is None:
            self.failed = True
            return 0, []
        self._body = CallReader(name=m.group(1))
        return self._take(head[brace:], len(self._head) - brace)

    def _take(self, text: str, already: int) -> tuple[int, list[Piece]]:
        """Feed ``text`` to the body; ``already`` of its characters were counted as taken before."""
        assert self._body is not None
        n, pieces = self._body.feed(text)
        body = self._body
        self.done, self.failed, self.named, self.complete = body.done, body.failed, body.named, body.complete
        return max(n - already, 0), pieces


def _could_be_name(head: str) -> bool:
    """Whether ``head`` can still grow into ``name[CALL_ID]id[ARGS]`` (before its ``{``)."""
    if len(head) > _MAX_NAME_CHARS:
        return False
    for k in range(min(len(head), max(map(len, _MISTRAL_MARKS))), -1, -1):
        tail = head[len(head) - k :]
        if (k == 0 or any(mark.startswith(tail) and mark != tail for mark in _MISTRAL_MARKS)) and (
            _MISTRAL_NAME.fullmatch(head[: len(head) - k]) or not head[: len(head) - k].strip()
        ):
            return True
    return False
