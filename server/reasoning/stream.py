"""Generated text -> (reasoning, answer), delta by delta.

A tag may arrive split over deltas (``</thi`` then ``nk>``): text that could still be the start of the
tag awaited is held back until it is decided, as is whitespace at the end of the thinking. The reasoning
and the answer are stripped of the whitespace around the tags (Qwen3 writes ``<think>\\n…\\n</think>\\n\\n``,
and its template strips the same when a turn comes back). Thinking that never closes (the output was
cut by ``max_tokens``) is all reasoning and the answer is empty, streamed or not (vLLM's streaming
behaviour; its non-streamed ``qwen3`` parser returns such an output as the answer instead). Only the
output's start can open the thinking: a ``<think>`` later in an answer is text.
"""

from __future__ import annotations

from servelm.server.reasoning.parsers import Phase, ReasoningParser


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """One output's splitter: ``feed`` each text delta (the last one ``final``); each call returns the
    (reasoning, answer) text to send now."""

    def __init__(self, parser: ReasoningParser, phase: Phase) -> None:
        self.start, self.end = parser.start, parser.end
        # open -> (think_start -> thinking ->) answer_start -> answer
        self.state = {"thinking": "think_start", "answer": "answer", "open": "open"}[phase]
        self.buf = ""
        self.thought = phase == "thinking"  # whether the output has (had) thinking

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        r, a = self._feed(text)
        if final:
            r2, a2 = self._finish()
            r, a = r + r2, a + a2
        return r, a

    def _feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            b = self.buf
            if self.state == "open":
                s = b.lstrip()
                if s.startswith(self.start):
                    self.buf, self.state, self.thought = s[len(self.start) :], "think_start", True
                    continue
                if self.start.startswith(s):
                    break  # nothing but whitespace and the tag's beginning yet
                self.state = "answer"
            elif self.state == "think_start":
                s = b.lstrip()
                if s.startswith(self.start):  # a model that writes <think> after a prompt that opened it
                    self.buf = s[len(self.start) :]
                    continue
                if self.start.startswith(s):
                    break
                self.buf, self.state = s, "thinking"
            elif self.state == "thinking":
                i = b.find(self.end)
                if i >= 0:
                    reasoning.append(b[:i].rstrip())
                    self.buf, self.state = b[i + len(self.end) :], "answer_start"
                    continue
                sure = b[: len(b) - _held(b, self.end)].rstrip()
                reasoning.append(sure)
                self.buf = b[len(sure) :]
                break
            elif self.state == "answer_start":
                s = b.lstrip()
                self.buf = s
                if not s:
                    break
                self.state = "answer"
            else:
                answer.append(b)
                self.buf = ""
                break
        return "".join(reasoning), "".join(answer)

    def _finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        b, self.buf = self.buf, ""
        if self.state == "open":
            return "", b
        if self.state == "think_start":
            return b.strip(), ""
        if self.state == "thinking":  # held whitespace here is inside the reasoning, after what was sent
            return b.rstrip(), ""
        return "", ""


def split_reasoning(parser: ReasoningParser, phase: Phase, text: str) -> tuple[str | None, str]:
    """A whole output as (reasoning or None when there was none, answer): what its stream sends."""
    s = ReasoningStream(parser, phase)
    reasoning, answer = s.feed(text, final=True)
    return (reasoning if s.thought and reasoning else None), answer
