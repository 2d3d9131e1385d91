"""Each model family's own tool-call syntax, parsed into OpenAI ``tool_calls`` (vLLM's
``--tool-call-parser`` names), completely or as the text streams."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from servelm.server.tool_parsers.base import CallDelta, ParsedCall, ParsedOutput, ParserDelta, ToolParser, Tools
from servelm.server.tool_parsers.grammar import Vocabulary, any_of, call_schema, json_rule, lark
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

    @classmethod
    def grammar(cls, vocab: Vocabulary, tools: Tools, required: bool, parallel: bool, ws: str) -> str:
        call = json_rule(any_of([call_schema(n, p) for n, p in tools]), ws)
        close = vocab.lit("</tool_call>")
        more = f" (GAP {vocab.lit('<tool_call>')} GAP call GAP {close})*" if parallel else ""
        opened, rules = vocab.after_text("<tool_call>") if not required else (vocab.lit("<tool_call>"), {})
        start = f"{opened} GAP call GAP {close}{more}"
        rules.update(call=call, TEXT=vocab.text_without("<tool_call>"))
        return lark(start if required else f"TEXT | {start}", rules)


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

    @classmethod
    def grammar(cls, vocab: Vocabulary, tools: Tools, required: bool, parallel: bool, ws: str) -> str:
        call = json_rule(any_of([call_schema(n, p, "parameters") for n, p in tools]), ws)
        calls = 'call (GAP ";" GAP call)*' if parallel else "call"
        tag = "<|python_tag|>"
        tagged = [f"{vocab.lit(tag)} calls"] if vocab.has(tag) else []
        free = vocab.text_without(tag, first="[^{\\s]")
        if required:
            start = " | ".join(["calls", *tagged])
        else:
            start = " | ".join(["FREE", "calls", *tagged, *(f"FREE {t}" for t in tagged)])
        return lark(start, {"calls": calls, "call": call, "FREE": free})


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of calls, or ``name[ARGS]{...}`` (v11+ tokenizers,
    one ``[TOOL_CALLS]`` per call)."""

    name = "mistral"
    openers = ("[TOOL_CALLS]",)
    continuers = ("[TOOL_CALLS]",)
    other_markers = ("[ARGS]", "[CALL_ID]")

    def body(self) -> Reader:
        return MistralReader()

    @staticmethod
    def call_id() -> str:
        # Mistral's chat templates refuse history whose call ids are not 9 letters and digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    @classmethod
    def grammar(cls, vocab: Vocabulary, tools: Tools, required: bool, parallel: bool, ws: str) -> str:
        mark = vocab.lit("[TOOL_CALLS]")
        rules = {"TEXT": vocab.text_without("[TOOL_CALLS]")}
        more = ""
        if vocab.has("[ARGS]"):  # v11+ tokenizers: [TOOL_CALLS]name[ARGS]{...} per call
            args = vocab.lit("[ARGS]")
            rules["call"] = " | ".join(f"{json.dumps(n)} {args} {json_rule(p, ws)}" for n, p in tools)
            body = "call"
            more = f" ({mark} call)*" if parallel else ""
        else:
            array: dict[str, Any] = {
                "type": "array",
                "items": any_of([call_schema(n, p) for n, p in tools]),
                "minItems": 1,
            }
            if not parallel:
                array["maxItems"] = 1
            body = f"GAP {json_rule(array, ws)}"
        if required:
            return lark(f"{mark} {body}{more}", rules)
        opened, extra = vocab.after_text("[TOOL_CALLS]")
        return lark(f"TEXT | {opened} {body}{more}", {**rules, **extra})


class GraniteParser(ToolParser):
    """Granite 3.x: ``<|tool_call|>`` (3.0) or ``<tool_call>`` (3.1) then a JSON array of calls, as the
    whole answer."""

    name = "granite"
    start_openers = ("<|tool_call|>", "<tool_call>", "[")
    kept = ("[",)

    def body(self) -> Reader:
        return ArrayReader()

    @classmethod
    def grammar(cls, vocab: Vocabulary, tools: Tools, required: bool, parallel: bool, ws: str) -> str:
        mark = "<|tool_call|>" if vocab.has("<|tool_call|>") else "<tool_call>"
        array: dict[str, Any] = {"type": "array", "items": any_of([call_schema(n, p) for n, p in tools]), "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        rules = {
            "calls": f"{vocab.lit(mark)} GAP {json_rule(array, ws)}",
            "FREE": vocab.text_without(*cls.start_openers[:2], first="[^\\[\\s]"),
        }
        return lark("calls" if required else "FREE | calls", rules)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, GraniteParser)
}

__all__ = ["PARSERS", "CallDelta", "ParsedCall", "ParsedOutput", "ParserDelta", "ToolParser", "Tools", "Vocabulary"]
