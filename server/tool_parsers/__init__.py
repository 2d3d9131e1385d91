"""Each model family's own tool-call syntax, parsed into OpenAI ``tool_calls`` (vLLM's
``--tool-call-parser`` names), completely or as the text streams."""

from __future__ import annotations

import secrets
import string

from servelm.server.tool_parsers.base import CallDelta, ParsedCall, ParsedOutput, ParserDelta, ToolParser
from servelm.server.tool_parsers.readers import ArrayReader, CallReader, MistralReader, Reader


class HermesParser(ToolParser):
    """Qwen2.5 / Qwen3 (and Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
    block per call, after optional text."""

    name = "hermes"
    openers = ("<tool_call>",)
    continuers = ("<tool_call>",)
    closer = "</tool_call>"

    def body(self) -> Reader:
        return CallReader()


class Llama3JsonParser(ToolParser):
    """Llama 3.x: ``{"name": ..., "parameters": {...}}`` as the whole answer (or after
    ``<|python_tag|>``), several separated by ``;``."""

    name = "llama3_json"
    openers = ("<|python_tag|>",)
    start_openers = ("{",)
    kept = ("{",)
    continuers = (";",)

    def body(self) -> Reader:
        return CallReader()


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of calls, or ``name[ARGS]{...}`` (v11+ tokenizers,
    one ``[TOOL_CALLS]`` per call)."""

    name = "mistral"
    openers = ("[TOOL_CALLS]",)
    continuers = ("[TOOL_CALLS]",)

    def body(self) -> Reader:
        return MistralReader()

    @staticmethod
    def call_id() -> str:
        # Mistral's chat templates refuse history whose call ids are not 9 letters and digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class GraniteParser(ToolParser):
    """Granite 3.x: ``<|tool_call|>`` (3.0) or ``<tool_call>`` (3.1) then a JSON array of calls, as the
    whole answer."""

    name = "granite"
    start_openers = ("<|tool_call|>", "<tool_call>", "[")
    kept = ("[",)

    def body(self) -> Reader:
        return ArrayReader()


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, GraniteParser)}

__all__ = ["PARSERS", "CallDelta", "ParsedCall", "ParsedOutput", "ParserDelta", "ToolParser"]
