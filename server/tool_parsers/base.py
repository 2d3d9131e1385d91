"""The state machine every tool-call parser shares: text until a family's start marker, then call
bodies, read as the model writes them.

One machine serves the complete and the streamed parse (``parse`` feeds the whole text at once), so
the streamed deltas join into exactly the complete answer. What vLLM does, and so do we:

- text before the first call is ``content`` (the whitespace right before a call is dropped, and
  content that is only whitespace is none); text after the first call and between calls is dropped;
- output that starts a call and then is not one (the start marker and then garbage, a first call
  cut short by ``max_tokens``) is returned whole as content, without calls. Streamed, a call whose
  name was already sent cannot be taken back: the rest of the text then follows as content;
- an answer cut by ``max_tokens`` after whole calls keeps them: an agent gets the calls the model
  finished, and the cut one is dropped (finish_reason "length" says so; streamed, its name and
  arguments so far were already sent).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from servelm.server.tool_parsers.readers import Reader

if TYPE_CHECKING:
    from servelm.server.tool_parsers.grammar import Vocabulary

# The tools a grammar allows: each one's name and parameters schema.
Tools = list[tuple[str, dict[str, Any]]]


@dataclass
class CallDelta:
    """A piece of call ``index``: its name on its first piece, then pieces of its arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParserDelta:
    """What one chunk of model text adds to the answer."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, index: int, name: str | None, arguments: str) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index and name is None:
            last.arguments += arguments
        else:
            self.calls.append(CallDelta(index, name, arguments))

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class ParsedOutput:
    """A complete answer: its text part (None when it only calls) and its calls."""

    content: str | None
    calls: list[ParsedCall]


class ToolParser:
    """One answer's parser: ``feed`` chunks of text, then ``finish``; or ``parse`` a whole text.

    A family sets its markers: ``openers`` start a call anywhere in the answer, ``start_openers`` only
    at its start (after whitespace), ``continuers`` start another call after one; ``kept`` openers are
    part of the body (Llama 3's bare ``{``); ``closer`` must follow each call (or the end of text).
    """

    name: ClassVar[str]
    openers: ClassVar[tuple[str, ...]] = ()
    start_openers: ClassVar[tuple[str, ...]] = ()
    continuers: ClassVar[tuple[str, ...]] = ()
    kept: ClassVar[tuple[str, ...]] = ()
    closer: ClassVar[str] = ""
    other_markers: ClassVar[tuple[str, ...]] = ()  # inside a call (Mistral's [ARGS])

    def __init__(self) -> None:
        self._buf = ""  # text received and not yet decided
        self._mode = "content"  # content | body | after | between | plain
        self._started = False  # past the answer's start (start openers no longer apply)
        self._body: Reader | None = None
        self._section = ""  # the current section's text, returned as content if it is no call
        self._base = 0  # global index of the current section's first call
        self.calls = 0  # calls named so far
        self.complete = 0  # calls whose text is whole so far
        self.malformed = False  # some text started a call and was not one

    def body(self) -> Reader:
        """A reader for the text after an opener or continuer."""
        raise NotImplementedError

    @classmethod
    def keeps_special_tokens(cls, tokenizer: Any) -> bool:
        """Whether one of the family's markers is a special token of ``tokenizer``: decoding must then
        keep special tokens, or the parser never sees the marker (vLLM turns skip_special_tokens off
        for Mistral so)."""
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {t.content for t in added.values() if getattr(t, "special", False)}
        markers = (*cls.openers, *cls.start_openers, *cls.continuers, cls.closer, *cls.other_markers)
        return any(m in special for m in markers)

    @classmethod
    def grammar(cls, vocab: Vocabulary, tools: Tools, required: bool, parallel: bool, ws: str) -> str:
        """A Lark grammar for an answer: free text and then calls to ``tools`` in this family's format
        (``required``: calls only; ``parallel``: more than one), ``ws`` the JSON whitespace regex."""
        raise NotImplementedError

    @staticmethod
    def call_id() -> str:
        """A new call's id (OpenAI's shape; Mistral's templates want their own)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> ParsedOutput:
        """The complete answer ``text`` as content and calls (vLLM's ``extract_tool_calls``)."""
        return parse_text(self, text)

    def feed(self, text: str) -> ParserDelta:
        out = ParserDelta()
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> ParserDelta:
        """The end of the answer: held-back text is decided."""
        out = ParserDelta()
        if self._mode == "content":
            out.content = self._buf
        elif self._mode == "body" and not self.complete:
            # The first call cut short: no call; if not even its name was sent, its text is content.
            self.malformed = True
            if not self._body_named():
                out.content = self._section + self._buf
        # A later call cut short is dropped, text and all: the whole calls before it stand.
        self._buf = ""
        return out

    def _body_named(self) -> bool:
        return self._body is not None and self._body.named > 0

    # One decision on the buffer; False when it must wait for more text.
    def _step(self, out: ParserDelta) -> bool:
        mode = self._mode
        if mode == "plain":
            out.content += self._buf
            self._buf = ""
            return False
        if mode == "content":
            return self._content(out)
        if mode == "body":
            return self._feed_body(out)
        if mode == "after":
            return self._after(out)
        return self._between()

    def _content(self, out: ParserDelta) -> bool:
        buf = self._buf
        if not self._started:
            head = buf.lstrip()
            if not head:
                return False
            opener = next((o for o in self.start_openers if head.startswith(o)), None)
            if opener is not None:
                return self._open(opener, len(buf) - len(head), out)
            if any(o.startswith(head) for o in self.start_openers):
                return False
            self._started = True
        at, opener = min(((buf.find(o), o) for o in self.openers if o in buf), default=(-1, ""))
        if opener:
            return self._open(opener, at, out)
        cut = len(buf) - _partial_suffix(buf, self.openers)
        # Whitespace before a possible call is held: it is dropped if a call follows.
        keep = len(buf[:cut].rstrip()) if self.openers else cut
        out.content += buf[:keep]
        self._buf = buf[keep:]
        return False

    def _open(self, opener: str, at: int, out: ParserDelta) -> bool:
        before = self._buf[:at]
        out.content += before.rstrip()
        kept = opener in self.kept
        # The section's text, returned as content if it is no call: the dropped whitespace too.
        self._section = before[len(before.rstrip()) :] + ("" if kept else opener)
        self._buf = self._buf[at if kept else at + len(opener) :]
        self._start_section()
        return True

    def _start_section(self) -> None:
        self._started = True
        self._mode = "body"
        self._base = self.calls
        self._body = self.body()

    def _feed_body(self, out: ParserDelta) -> bool:
        assert self._body is not None
        body, buf = self._body, self._buf
        taken, pieces = body.feed(buf)
        for p in pieces:
            out.add(self._base + p.index, p.name, p.arguments)
        self.calls = self._base + body.named
        self.complete = self._base + body.complete
        if body.failed:
            self.malformed = True
            self._mode = "plain"
            # Nothing of this section was sent: its text (the marker included) is content.
            self._buf = buf[taken:] if body.named else self._section + buf
            return True
        self._section += buf[:taken]
        self._buf = buf[taken:]
        if body.done:
            self._mode = "after" if self.closer else "between"
            return True
        return False

    def _after(self, out: ParserDelta) -> bool:
        head = self._buf.lstrip()
        if head.startswith(self.closer):
            self._buf = head[len(self.closer) :]
            self._mode = "between"
            return True
        if self.closer.startswith(head):
            return False
        self.malformed = True
        self._mode = "plain"
        return True

    def _between(self) -> bool:
        buf = self._buf
        at, opener = min(((buf.find(o), o) for o in self.continuers if o in buf), default=(-1, ""))
        if opener:
            self._section = opener
            self._buf = buf[at + len(opener) :]
            self._start_section()
            return True
        self._buf = buf[len(buf) - _partial_suffix(buf, self.continuers) :]
        return False


class AnswerParser(Protocol):
    """What reads one answer: a family's parser, or one that also reads unmarked calls around it."""

    @property
    def calls(self) -> int: ...  # calls named so far
    @property
    def complete(self) -> int: ...  # calls whose text is whole so far
    @property
    def malformed(self) -> bool: ...  # some text started a call and was not one

    def feed(self, text: str) -> ParserDelta: ...
    def finish(self) -> ParserDelta: ...


def parse_text(parser: AnswerParser, text: str) -> ParsedOutput:
    """The complete answer ``text`` through ``parser``: the same machine as a stream, fed at once."""
    deltas = [parser.feed(text), parser.finish()]
    if parser.malformed or not parser.calls:
        return ParsedOutput(text, [])
    calls: list[ParsedCall] = []
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                calls.append(ParsedCall(c.name, ""))
            calls[c.index].arguments += c.arguments
    content = "".join(d.content for d in deltas)
    return ParsedOutput(content or None, calls[: parser.complete])


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers``."""
    for k in range(min(len(text), max((len(m) for m in markers), default=0)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0
