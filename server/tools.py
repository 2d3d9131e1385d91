"""Tool calling (OpenAI's ``tools`` / ``tool_choice``) on top of structured outputs.

With ``tool_choice: "required"`` the output is constrained to a JSON array of one or more calls, each
``{"name": <one of the tools>, "parameters": <that tool's parameters schema>}``; with a named function,
to that function's parameters. The text is then parsed into ``message.tool_calls`` (ids are ours), so
the calls are always well-formed: which tool and what arguments stay the model's choice.

``"auto"`` (OpenAI's default when tools are given) lets the first character decide: an answer that
starts with ``[`` is constrained to that same array of calls; any other answer is free text (which
therefore cannot start with ``[``, nor with whitespace). One convention for every model, rather than
a parser for each model family's own tool-call syntax (vLLM's approach), and the calls stay
well-formed.

The tools reach the model through its chat template (``tools=``) when the template uses them, for
"required" and named calls; otherwise (the default model's template, and "auto" always, whose
convention is ours) they are described in the system message, and earlier assistant calls in the
history are written as the same JSON the model is constrained to produce.

With ``--tool-call-parser`` (``family``) the model writes calls in its own format instead, which its
chat template was trained on and is always given the tools: the grammar holds the text after the
family's start marker to calls of the declared tools (``server.tool_parsers``), and the family's
parser reads the answer into content and calls, also as it streams. ``"auto"`` then needs
``--enable-auto-tool-choice``, as in vLLM.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from servelm.scheduler.structured_output import JSON_WHITESPACE, StructuredOutput
from servelm.server.errors import bad_request
from servelm.server.protocol_chat import ChatCompletionRequest, ChatTool
from servelm.server.tool_parsers import ToolParser, Tools, Vocabulary
from servelm.server.tool_parsers.answer import AnswerStream, answer_calls

# Any JSON object: a function declared without parameters takes any.
_ANY_PARAMETERS: dict[str, Any] = {"type": "object"}

# "auto": free text is anything that does not start with "[" (the calls' array) or with whitespace.
_FREE_TEXT = r"/[^\[ \t\n\r](.|\n)*/"


@dataclass
class ToolMode:
    """The tools a request may (``auto``) or must call: ``name`` set for one named function."""

    tools: list[ChatTool]
    name: str | None = None
    parallel: bool = True  # more than one call allowed (OpenAI's parallel_tool_calls)
    auto: bool = False  # the model chooses between a text answer and calls
    family: type[ToolParser] | None = None  # --tool-call-parser: calls in the model's own format

    def schema(self) -> dict[str, Any]:
        if self.name is not None:
            return _parameters(self._tool(self.name))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def structured_output(self, tokenizer: Any = None) -> StructuredOutput:
        """The grammar of this mode's answers (``tokenizer``: the family's markers that are tokens)."""
        if self.family is not None:
            parallel = self.parallel and self.name is None
            lark = self.family.grammar(Vocabulary(tokenizer), self.callable(), not self.auto, parallel, JSON_WHITESPACE)
            return StructuredOutput("grammar", lark, param="tools")
        if not self.auto:
            return StructuredOutput("json", json.dumps(self.schema(), ensure_ascii=False), param="tools")
        # The calls' JSON gets the whitespace bounds a "json" spec gets (through its own options).
        schema = {**self.schema(), "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}}
        lark = f"start: calls | TEXT\ncalls: %json {json.dumps(schema, ensure_ascii=False)}\nTEXT: {_FREE_TEXT}\n"
        return StructuredOutput("grammar", lark, param="tools")

    def callable(self) -> Tools:
        """The tools an answer may call (the named one only), with their parameters schemas."""
        return [(t.function.name, _parameters(t)) for t in self.tools if self.name in (None, t.function.name)]

    def answer_stream(self) -> AnswerStream | None:
        """A streamed answer's reader under a family's parser (None without one): the family's calls,
        and an unmarked call of the callable tools."""
        return AnswerStream(self.family, self.callable()) if self.family is not None else None

    @property
    def template_tools(self) -> bool:
        """Whether a chat template that reads tools gets them (else they are described by us)."""
        return self.family is not None or not self.auto

    def is_call(self, text: str) -> bool:
        """Whether an output that begins with ``text`` (non-empty) is calls rather than a text answer."""
        return not self.auto or text.startswith("[")

    def _tool(self, name: str) -> ChatTool:
        return next(t for t in self.tools if t.function.name == name)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI ``tool_calls`` the constrained text spells, or None where it is not calls (a text
        answer under "auto") or holds no whole call (``max_tokens`` cut the first). Calls before a cut
        are returned, the cut one dropped."""
        if self.family is not None:
            return answer_calls(self.family, text, self.callable())[1]
        if self.auto and not text.startswith("["):
            return None
        try:
            value = json.loads(text)
        except ValueError:
            if self.name is not None:
                return None
            value = whole_items(text)  # cut by max_tokens: the calls before the cut stand
        if self.name is not None:
            return [_call(self.name, value)]
        if not isinstance(value, list):
            return None
        calls = [_call(c["name"], c.get("parameters", {})) for c in value if isinstance(c, dict) and "name" in c]
        return calls or None

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A finished answer as (content, calls): a family's text before its calls is content; the
        convention's calls are the whole answer. Calls None: ``text`` is the content, whole."""
        if self.family is not None:
            return answer_calls(self.family, text, self.callable())
        calls = self.parse(text)
        return (text, None) if calls is None else (None, calls)


def whole_items(text: str) -> list[Any]:
    """The whole items at the start of a JSON array that was cut short (none when ``text`` does not
    start one)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return items
    at += 1
    while True:
        at = len(text) - len(text[at:].lstrip())
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)
        at = len(text) - len(text[at:].lstrip())
        if not text.startswith(",", at):
            return items
        at += 1


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _ANY_PARAMETERS


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def tool_mode(
    req: ChatCompletionRequest, family: type[ToolParser] | None = None, auto_enabled: bool = False
) -> ToolMode | None:
    """The tool calls ``req`` may ("auto") or must make, None when it uses no tools; 400 for what cannot
    be served. ``family``: --tool-call-parser's; ``auto_enabled``: --enable-auto-tool-choice."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' is set but 'tools' is empty or missing.", param="tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad_request(f"Two tools are named '{dup}': tool names must be unique.", param="tools")
    if choice == "none":
        return None
    if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs is not None:
        raise bad_request(
            "Tool calls and 'response_format' / 'structured_outputs' cannot be combined.", param="tool_choice"
        )
    parallel = req.parallel_tool_calls is not False
    if choice in (None, "auto") and family is not None and not auto_enabled:
        raise bad_request(
            f"tool_choice 'auto' lets the model call tools in its own format, which this server reads with "
            f"--tool-call-parser {family.name} only when started with --enable-auto-tool-choice (as vLLM); "
            "send tool_choice 'required', a named function or 'none'.",
            param="tool_choice",
        )
    if choice in (None, "auto", "required"):
        return ToolMode(list(req.tools), parallel=parallel, auto=choice != "required", family=family)
    assert not isinstance(choice, str)
    if choice.function.name not in names:
        raise bad_request(
            f"tool_choice names '{choice.function.name}', which is not among the tools.", param="tool_choice"
        )
    return ToolMode(list(req.tools), choice.function.name, family=family)


def render_kwargs(mode: ToolMode | None) -> dict[str, Any]:
    """``render_chat_prompt``'s tool arguments for a request's tool mode (None: no tools)."""
    if mode is None:
        return {}
    return {"tools": tools_for_template(mode.tools), "named_tool": mode.name, "describe": not mode.template_tools}


def tools_for_template(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """Tools as chat templates read them (OpenAI's JSON shape)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def template_knows_tools(template: Any) -> bool:
    """Whether a chat template (its text) reads ``tools``."""
    return isinstance(template, str) and "tools" in template


def describe_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], named: str | None, auto: bool = False
) -> list[dict[str, Any]]:
    """The tools described in the system message (added when absent), for a template without tools or
    for "auto"."""
    calls = 'a JSON array of {"name": ..., "parameters": {...}} objects'
    if named is not None:
        what = f"Call the function {named} by answering with its arguments as a JSON object."
    elif auto:
        what = f"To call one or more of them, answer with only {calls}; otherwise answer normally."
    else:
        what = f"Call one or more of them by answering with {calls}."
    text = (
        "You can call these functions:\n" + json.dumps([t["function"] for t in tools], ensure_ascii=False) + "\n" + what
    )
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def calls_as_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template without tool calls: each assistant message's calls written into its content as the
    JSON array the model is constrained to for calls, and tool results as the text they hold."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            spelled = json.dumps(
                [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in calls],
                ensure_ascii=False,
            )
            m = {"role": m["role"], "content": f"{m['content']}\n{spelled}" if m["content"] else spelled}
        elif "tool_call_id" in m:
            m = {"role": m["role"], "content": m["content"]}
        out.append(m)
    return out
