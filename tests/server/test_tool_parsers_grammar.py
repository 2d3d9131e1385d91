"""Each family's tool-call grammar (``ToolParser.grammar``), run by llguidance over a real tokenizer.

An answer is allowed when llguidance accepts its tokens to the end; the answers are written in each
family's format (tests/server/test_tool_parsers.py), so what the grammar allows is also what the
parser reads back as calls. Markers are tokens as each family's tokenizer has them (Qwen's
``<tool_call>`` a plain added token, Llama's, Mistral's and Granite's special ones), and text in a
tokenizer without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from test_tool_parsers import Call, granite, granite31, hermes, llama3, llama3_tagged, mistral, mistral_v11

from servelm.scheduler.structured_output import JSON_WHITESPACE
from servelm.server.tool_parsers import PARSERS, Vocabulary

llg = pytest.importorskip("llguidance")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", WEATHER), ("now", {"type": "object"})]
TWO: list[Call] = [("get_weather", {"city": "Paris"}), ("now", {})]
ONE = TWO[:1]
UNDECLARED: list[Call] = [("rm_rf", {})]
BAD_ARGUMENTS: list[Call] = [("get_weather", {"town": 1})]


def _tokenizer(markers: bool) -> Any:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from servelm.runtime.model_files import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    if markers:
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in ("<tool_call>", "</tool_call>")])
        tok.add_special_tokens(
            {"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<|tool_call|>"]}
        )
    return tok


@pytest.fixture(scope="module", params=[True, False], ids=["marker-tokens", "marker-text"])
def tok(request: pytest.FixtureRequest) -> Any:
    return _tokenizer(request.param)


def allows(tok: Any, grammar: str, text: str) -> bool:
    from servelm.runtime.tokenizer import tokenizer_json

    vocab = getattr(tok, "_llg", None)
    if vocab is None:
        vocab = tok._llg = llg.LLTokenizer(tokenizer_json(tok), n_vocab=len(tok), eos_token=[tok.eos_token_id])
    m = llg.LLMatcher(vocab, llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    m.consume_tokens(tok.encode(text, add_special_tokens=False))
    return not m.is_error() and m.is_accepting()


def _as_the_tokenizer_writes(vocab: Vocabulary, fmt: Callable[[list[Call]], str]) -> Callable[[list[Call]], str]:
    """Mistral tokenizers with [ARGS] write name[ARGS]{...}; Granite 3.1's (no <|tool_call|>) <tool_call>."""
    if fmt is mistral and vocab.has("[ARGS]"):
        return mistral_v11
    if fmt is granite and not vocab.has("<|tool_call|>"):
        return granite31
    return fmt


FAMILIES: list[tuple[str, Callable[[list[Call]], str], bool]] = [
    # (parser, how the family writes calls, whether calls may follow text)
    ("hermes", hermes, True),
    ("llama3_json", llama3, False),
    ("llama3_json", llama3_tagged, True),
    ("mistral", mistral, True),
    ("granite", granite, False),
]


@pytest.mark.parametrize("name,fmt,after_text", FAMILIES, ids=[f.__name__ for _, f, _ in FAMILIES])
def test_auto_allows_text_or_declared_calls(
    tok: Any, name: str, fmt: Callable[[list[Call]], str], after_text: bool
) -> None:
    vocab = Vocabulary(tok)
    if fmt is llama3_tagged and not vocab.has("<|python_tag|>"):
        pytest.skip("a tokenizer without <|python_tag|>: Llama 3 calls are the bare JSON")
    fmt = _as_the_tokenizer_writes(vocab, fmt)
    grammar = PARSERS[name].grammar(vocab, TOOLS, False, True, JSON_WHITESPACE)
    assert allows(tok, grammar, "It is sunny in Paris.")
    for calls in (ONE, TWO):
        text = fmt(calls)
        assert allows(tok, grammar, text)
        assert [c.name for c in PARSERS[name]().parse(text).calls] == [n for n, _ in calls]
    # Calls after text: allowed where the family's parser reads them as calls, else text at most.
    text = "Let me see.\n" + fmt(ONE)
    parsed = [c.name for c in PARSERS[name]().parse(text).calls]
    if after_text:
        assert allows(tok, grammar, text) and parsed == ["get_weather"]
    else:
        assert parsed == []
    # Once a call starts it must be a declared tool, with valid arguments, and nothing after it.
    assert not allows(tok, grammar, fmt(UNDECLARED))
    assert not allows(tok, grammar, fmt(BAD_ARGUMENTS))
    assert not allows(tok, grammar, fmt(ONE) + " Done.")


@pytest.mark.parametrize(
    "name,fmt,after_text", FAMILIES[:2] + FAMILIES[3:], ids=[f.__name__ for _, f, _ in FAMILIES[:2] + FAMILIES[3:]]
)
def test_required_allows_only_calls(tok: Any, name: str, fmt: Callable[[list[Call]], str], after_text: bool) -> None:
    vocab = Vocabulary(tok)
    fmt = _as_the_tokenizer_writes(vocab, fmt)
    grammar = PARSERS[name].grammar(vocab, TOOLS, True, True, JSON_WHITESPACE)
    assert allows(tok, grammar, fmt(TWO))
    assert not allows(tok, grammar, "It is sunny in Paris.")
    single = PARSERS[name].grammar(vocab, TOOLS, True, False, JSON_WHITESPACE)
    assert allows(tok, single, fmt(ONE)) and not allows(tok, single, fmt(TWO))


def test_text_markers_stay_out_of_free_text() -> None:
    # Without a <tool_call> token, free text may still not spell it: the text would be a call.
    tok = _tokenizer(False)
    grammar = PARSERS["hermes"].grammar(Vocabulary(tok), TOOLS, False, True, JSON_WHITESPACE)
    assert not allows(tok, grammar, "I would write <tool_call> garbage")
    assert allows(tok, grammar, "I would write <tool_ call> or <tool_call")


def test_special_markers_are_kept_in_the_text() -> None:
    # Decoding drops special tokens by default; a family whose marker is one needs them kept.
    with_tokens, plain = _tokenizer(True), _tokenizer(False)
    assert {n for n in PARSERS if PARSERS[n].keeps_special_tokens(with_tokens)} == {"llama3_json", "mistral", "granite"}
    assert not any(p.keeps_special_tokens(plain) for p in PARSERS.values())


def takes(tok: Any, grammar: str, text: str) -> bool:
    """Whether ``text`` is a prefix of an answer the grammar allows (its tokens are all taken)."""
    vocab = tok._llg if getattr(tok, "_llg", None) is not None else None
    if vocab is None:
        allows(tok, grammar, "")  # builds the vocabulary
        vocab = tok._llg
    m = llg.LLMatcher(vocab, llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    m.consume_tokens(tok.encode(text, add_special_tokens=False))
    return not m.is_error()


@pytest.mark.parametrize(
    "name,fmt,after_text", FAMILIES[:2] + FAMILIES[3:], ids=[f.__name__ for _, f, _ in FAMILIES[:2] + FAMILIES[3:]]
)
def test_forced_calls_end(tok: Any, name: str, fmt: Callable[[list[Call]], str], after_text: bool) -> None:
    # Under "required" (and a named function: its one tool, not parallel) the calls OpenAI's
    # parallel_tool_calls allows, then only the end: no whitespace after the last call for a model
    # that does not end to linger in.
    vocab = Vocabulary(tok)
    fmt = _as_the_tokenizer_writes(vocab, fmt)
    parallel = PARSERS[name].grammar(vocab, TOOLS, True, True, JSON_WHITESPACE)
    single = PARSERS[name].grammar(vocab, TOOLS, True, False, JSON_WHITESPACE)
    named = PARSERS[name].grammar(vocab, TOOLS[:1], True, False, JSON_WHITESPACE)
    for grammar in (parallel, single, named):
        assert allows(tok, grammar, fmt(ONE))
        for tail in ("\n", " ", "\n\n", "\t"):
            assert not allows(tok, grammar, fmt(ONE) + tail), repr(tail)
    assert allows(tok, parallel, fmt(TWO)) and allows(tok, parallel, fmt(TWO + TWO))
    for grammar in (single, named):
        assert not takes(tok, grammar, fmt(ONE) + "\n") and not takes(tok, grammar, fmt(ONE) + ";")
        assert not takes(tok, grammar, fmt(TWO))


def test_hermes_gaps_hold_one_whitespace_character(tok: Any) -> None:
    # Around and between <tool_call> blocks: none or one space or newline (Qwen writes one newline), never
    # the run of whitespace a small model wrote there, growing from call to call, until max_tokens.
    grammar = PARSERS["hermes"].grammar(Vocabulary(tok), TOOLS, True, True, JSON_WHITESPACE)
    call = '{"name": "now", "arguments": {}}'
    for gap in ("", " ", "\n"):
        assert allows(tok, grammar, f"<tool_call>{gap}{call}{gap}</tool_call>{gap}<tool_call>{call}</tool_call>"), repr(
            gap
        )
    for gap in ("\n\n", " \n", "\n  ", "\t", "\r\n"):
        assert not takes(tok, grammar, f"<tool_call>{gap}{call}"), repr(gap)
        assert not takes(tok, grammar, f"<tool_call>{call}{gap}</tool_call>"), repr(gap)
        assert not takes(tok, grammar, f"<tool_call>{call}</tool_call>{gap}<tool_call>"), repr(gap)
