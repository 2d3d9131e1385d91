"""Known quirks of models' own chat templates, corrected in the template a server serves by default.

Some files ship a template that teaches the model a mistake. Qwen2.5-Coder-1.5B-Instruct's GGUF shows
its tools preamble's example call with doubled braces (``{{"name": ...}}``: Jinja text inside a string
literal, so printed as is), which the model copies or answers around; the 0.5B file of the same family
shows it with single braces. With either, the 1.5B calls a tool again after its result comes back and
answers a plain question with a made-up call (scripts/bench_agents.py: 4 of 6 agent steps, 0 of 3
loops; with the braces alone corrected, the same); one line on when not to call, in the preamble's own
words, makes it 5 of 6 and 3 of 3 (docs/tools.md). Ollama serves its own template per model for the same
reason. Each fix is an exact substring of a published template and its replacement, applied in order,
so a template that holds none is served untouched; ``--chat-template-as-stored`` serves the file's text
exactly, and ``--chat-template`` any other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TemplateFix:
    name: str
    old: str
    new: str


_QWEN25_CALL = '<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
FIXES = (
    TemplateFix(
        "qwen2.5-tool-call-example-braces",
        _QWEN25_CALL.replace("{", "{{", 1).replace("}\\n</tool_call>", "}}\\n</tool_call>"),
        _QWEN25_CALL,
    ),
    TemplateFix(
        "qwen2.5-when-not-to-call",
        _QWEN25_CALL + "<|im_end|>",
        _QWEN25_CALL
        + "\\n\\nIf none of the functions is needed for the user's request, do not call any: answer in plain text."
        + " When a <tool_response> is given, use it to answer in plain text.<|im_end|>",
    ),
)


def fix_known_quirks(template: str) -> tuple[str, list[str]]:
    """``template`` with every known quirk it holds corrected, and the names of the fixes applied."""
    applied = []
    for fix in FIXES:
        if fix.old in template:
            template = template.replace(fix.old, fix.new)
            applied.append(fix.name)
    return template, applied
