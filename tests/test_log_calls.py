"""Every logging call's %-placeholders match its arguments.

A mismatch is not caught when the call runs: logging prints "--- Logging error ---" with a traceback
to stderr and drops the message (the CUDA graph-capture summary was lost that way on a GPU, where no
CPU test reaches it), so the check reads the source instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "runtime", "scheduler", "metrics", "bench", "scripts")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
# One printf-style conversion as logging's %-formatting reads it (%% is a literal percent sign).
CONVERSION = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")


def placeholders(fmt: str) -> int:
    return sum(1 for m in CONVERSION.finditer(fmt) if m.group() != "%%")


def log_calls(path: Path) -> list[tuple[int, str, int]]:
    """(line, format, number of arguments) for each ``log.<level>("literal", ...)`` call in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger", "LOG")):
            continue
        if not node.args or not (isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args):
            continue
        found.append((node.lineno, node.args[0].value, len(node.args) - 1))
    return found


def test_the_check_counts_conversions() -> None:
    assert placeholders("a %s b %.1f c %5d %% d %(name)s") == 4
    assert placeholders("100%% done") == 0


def test_every_log_call_has_as_many_arguments_as_placeholders() -> None:
    checked, wrong = 0, []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for line, fmt, nargs in log_calls(path):
                checked += 1
                # With no arguments logging does not format, so a lone % is harmless there.
                if nargs and placeholders(fmt) != nargs:
                    wrong.append(
                        f"{path.relative_to(REPO)}:{line}: {placeholders(fmt)} placeholders, {nargs} arguments: {fmt!r}"
                    )
    assert checked > 50, checked  # the walk found the project's logging calls
    assert not wrong, "\n".join(wrong)
