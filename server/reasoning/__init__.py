"""Reasoning output: the thinking a model writes before its answer (``<think>…</think>``), split from
the answer for ``--reasoning-parser`` (vLLM's flag and names).

``parsers`` names the parsers and decides, from a rendered prompt, whether the output begins inside the
thinking; ``stream`` splits the generated text (whole or delta by delta) into reasoning and answer;
``grammar`` makes a structured output constrain the answer after the thinking, not the thinking.
"""

from servelm.server.reasoning.grammar import after_thinking
from servelm.server.reasoning.parsers import PARSERS, ReasoningMode, ReasoningParser, get_parser
from servelm.server.reasoning.stream import ReasoningStream, split_reasoning

__all__ = [
    "PARSERS",
    "ReasoningMode",
    "ReasoningParser",
    "ReasoningStream",
    "after_thinking",
    "get_parser",
    "split_reasoning",
]
