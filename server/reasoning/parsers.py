"""The reasoning parsers by name, and where a rendered prompt leaves the model: inside the thinking, after
it, or free to open it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# Where the output begins: "thinking" (the prompt opened <think>, or the model always thinks first),
# "answer" (the prompt closed the thinking: Qwen3's enable_thinking=false), "open" (the output may
# begin with <think>; anything else first is the answer).
Phase = Literal["thinking", "answer", "open"]

# Prompt tokens read back to find the last tag: a generation prompt ends within a few tokens of it.
_PROMPT_TAIL_TOKENS = 32


@dataclass(frozen=True)
class ReasoningParser:
    """One model family's thinking tags. ``always_thinks``: the output is thinking until the end tag even
    when neither the prompt nor the output opened it (DeepSeek-R1, whose first releases wrote no
    ``<think>``)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_thinks: bool = False

    def phase(self, prompt_ids: list[int], tokenizer: Any) -> Phase:
        """Where the output of a prompt begins, read from the prompt's last tag: an open ``<think>`` (the
        DeepSeek-R1 and Qwen3-Thinking templates end so) means inside the thinking, a ``</think>`` with
        only whitespace after it (Qwen3 with ``enable_thinking: false``) means the answer."""
        tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        s, e = tail.rfind(self.start), tail.rfind(self.end)
        if s > e:
            return "thinking"
        if e >= 0 and not tail[e + len(self.end) :].strip():
            return "answer"
        return "thinking" if self.always_thinks else "open"


# vLLM's names. SmolLM3 and QwQ write Qwen3's tags; R1 distills DeepSeek-R1's.
PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_thinks=True),
}


def get_parser(name: str) -> ReasoningParser:
    """The parser ``name``s; ``ValueError`` listing the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(sorted(PARSERS))})") from None


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is split: its parser, where its output begins, and whether the client
    wants the reasoning (vLLM's ``include_reasoning``; false drops it)."""

    parser: ReasoningParser
    phase: Phase
    include: bool = True
