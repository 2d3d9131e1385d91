"""The served template corrects known quirks of a model's own (server.template_fixes): the Qwen2.5-Coder
1.5B file's tools preamble shows its example call with doubled braces, which the 0.5B file (the same
family) shows single, and both gain one line on when not to call; any other template is served as
stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader

from servelm.server.chat_template import served_chat_template
from servelm.server.template_fixes import fix_known_quirks

SHIPPED = Path(__file__).parents[2] / "docs" / "templates" / "qwen2.5-coder-tools.jinja"
SINGLE = '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'


def gguf_template(path: Path) -> str:
    field = GGUFReader(path).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


@pytest.fixture(scope="module")
def qwen05_template(qwen05_gguf: Path) -> str:
    return gguf_template(qwen05_gguf)


def quirky(template: str) -> str:
    """The 1.5B file's template: the 0.5B's with the example's braces doubled (checked against the real
    1.5B file by scripts/bench_agents.py; the file's 1.1 GB keep it out of the test suite)."""
    assert template.count(SINGLE) == 1
    return template.replace(SINGLE, "{" + SINGLE + "}")


def test_both_qwen_coder_files_are_served_the_shipped_template(qwen05_template: str) -> None:
    shipped = SHIPPED.read_text()
    fixed, applied = fix_known_quirks(quirky(qwen05_template))
    assert applied == ["qwen2.5-tool-call-example-braces", "qwen2.5-when-not-to-call"]
    assert fixed == shipped
    assert fix_known_quirks(qwen05_template) == (shipped, ["qwen2.5-when-not-to-call"])


def test_a_template_without_a_known_quirk_is_served_as_stored(qwen05_template: str) -> None:
    shipped = SHIPPED.read_text()
    assert fix_known_quirks(shipped) == (shipped, [])  # a fixed template stays fixed
    # Doubled braces elsewhere are the template's own business (here: Jinja expressions).
    other = "{{ messages[0]['content'] }}{{\"name\": x}}"
    assert fix_known_quirks(other) == (other, [])


def test_serve_serves_the_corrected_template_unless_told_to_serve_it_as_stored(
    serve_app: Any, server_tokenizer: Any, qwen05_template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = server_tokenizer.chat_template
    monkeypatch.setattr(server_tokenizer, "chat_template", quirky(qwen05_template))
    assert served_chat_template(serve_app().state.serving) == SHIPPED.read_text()
    assert served_chat_template(serve_app("--chat-template-as-stored").state.serving) == quirky(qwen05_template)
    # --chat-template is served as given, quirks and all: the operator chose it.
    assert served_chat_template(serve_app("--chat-template", quirky(qwen05_template)).state.serving) == quirky(
        qwen05_template
    )
    # The default model's template holds no known quirk: served as stored.
    monkeypatch.setattr(server_tokenizer, "chat_template", own)
    assert serve_app().state.serving.chat_template is None
