"""The split into two tiers keeps every test and its rule (tests/tiers.py, docs/testing.md): the two make
targets select complementary halves, CI runs both, and a first-tier test cannot start a server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import SLOW, SecondTierOnly, second_tier_reason, server_in

REPO = Path(__file__).resolve().parents[1]


def _recipe(target: str) -> str:
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert m, f"no `{target}` target in the Makefile"
    return m.group(1)


def test_the_two_targets_together_run_every_test() -> None:
    """`make test` leaves out exactly the tests that `make test-slow` runs: nothing falls between them."""
    assert '-m "not slow"' in _recipe("test")
    assert "-m slow" in _recipe("test-slow")


def test_ci_runs_both_tiers() -> None:
    steps = re.findall(r"^make ([\w-]+)$", (REPO / ".ci" / "run").read_text(), re.M)
    assert "test" in steps and steps[steps.index("test") + 1] == "test-slow", steps


def test_this_run_selected_by_the_marks_the_rule_gave(request: pytest.FixtureRequest) -> None:
    """The automatic marks are in place before ``-m`` selects: under ``make test`` this run holds no test
    of the second tier (a plain ``pytest`` runs both tiers; ``make test-slow`` leaves this file out)."""
    items = request.session.items
    assert not [i.nodeid for i in items if i.get_closest_marker(SLOW) is None and second_tier_reason(i)]
    if request.config.option.markexpr == "not slow":
        assert not [i.nodeid for i in items if i.get_closest_marker(SLOW)]


def test_every_hand_mark_gives_its_reason() -> None:
    """A ``slow`` mark set by hand says why on its line or in the comment just above (docs/testing.md has
    the rule: a server or other process, a real model, a GGUF reference built from files, over 3 s)."""
    bare = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            code = not line.lstrip().startswith("#") and '"' not in line  # not prose about the mark
            reason = "#" in line or (n > 0 and lines[n - 1].lstrip().startswith("#"))
            if code and re.search(r"\bpytest\.mark\.slow\b", line) and not reason:
                bare.append(f"{path.relative_to(REPO)}:{n + 1}")
    assert not bare, f"slow marks without a reason: {bare}"


def test_a_first_tier_test_cannot_start_a_server() -> None:
    # `--help` exits at once should the guard ever let it through.
    with pytest.raises(SecondTierOnly, match="test_a_first_tier_test_cannot_start_a_server starts servelm serve"):
        subprocess.run(
            [sys.executable, "-m", "servelm.server.cli", "serve", "--help"], capture_output=True, timeout=120
        )


@pytest.mark.parametrize(
    "argv,server",
    [
        ([sys.executable, "-m", "servelm.server.cli", "serve", "--port", "0"], "servelm serve"),
        (["/venv/bin/servelm", "serve", "--model", "m"], "servelm serve"),
        ("servelm serve --port 0", "servelm serve"),
        (["/venv/bin/vllm-router", "--port", "1"], "vllm-router"),
        ([sys.executable, "-m", "sglang_router.launch_router", "--port", "1"], "the sglang router"),
        (["/opt/llama.cpp/llama-server", "-m", "x.gguf"], "llama-server"),
        ([sys.executable, "-m", "servelm.server.cli", "bench", "--help"], None),
        (["git", "ls-files"], None),
        (["hadolint", "Dockerfile"], None),
    ],
)
def test_what_counts_as_starting_a_server(argv: list[str] | str, server: str | None) -> None:
    assert server_in(argv) == server
