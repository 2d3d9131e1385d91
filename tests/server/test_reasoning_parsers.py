"""``server.reasoning`` without a server: the splitter streamed in every cut equals the whole split, the
prompt's last tag decides where an output begins (Qwen3's own template renders the prompts), and the
grammar built for a structured output lets the thinking run free and holds the answer to the spec
(llguidance consuming the scripted tokenizer's tokens)."""

from __future__ import annotations

import json
import random
from functools import partial
from typing import Any

import pytest
from scripted_model import scripted_tokenizer

from servelm.scheduler.structured_output import GrammarCompiler, StructuredOutput
from servelm.server.reasoning import (
    PARSERS,
    ReasoningMode,
    ReasoningStream,
    after_thinking,
    get_parser,
    split_reasoning,
)

QWEN3 = PARSERS["qwen3"]
R1 = PARSERS["deepseek_r1"]


@pytest.fixture(scope="module")
def tok() -> Any:
    return scripted_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok: Any) -> GrammarCompiler:
    return GrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])


@pytest.mark.parametrize(
    "parser, phase, text, expected",
    [
        # Qwen3 as it writes: the whitespace around the tags is not part of either side.
        (QWEN3, "open", "<think>\nI add.\n</think>\n\nFour.", ("I add.", "Four.")),
        (QWEN3, "open", "Four, without thinking.", (None, "Four, without thinking.")),
        (QWEN3, "open", "  Four.", (None, "  Four.")),  # no thinking: the answer as written
        (QWEN3, "open", "Four. <think>later</think>", (None, "Four. <think>later</think>")),  # only the start opens it
        # The prompt opened the thinking (DeepSeek-R1, Qwen3-Thinking templates): no <think> in the output.
        (QWEN3, "thinking", "I add.\n</think>\n\nFour.", ("I add.", "Four.")),
        (QWEN3, "thinking", "<think>I add.</think>Four.", ("I add.", "Four.")),  # R1-0528 writes it again
        # Cut by max_tokens inside the thinking: all reasoning, no answer (a partial end tag included).
        (QWEN3, "open", "<think>I add and", ("I add and", "")),
        (QWEN3, "thinking", "I add </thi", ("I add </thi", "")),
        (QWEN3, "open", "<thi", (None, "<thi")),  # not thinking after all: the answer as written
        # The prompt closed the thinking (enable_thinking=false): every tag is text.
        (QWEN3, "answer", "<think>x</think>y", (None, "<think>x</think>y")),
        (QWEN3, "open", "<think>\n\n</think>\n\nFour.", (None, "Four.")),  # empty thinking is none
        # DeepSeek-R1 thinks first even when nothing opened it.
        (R1, "thinking", "I add.</think>Four.", ("I add.", "Four.")),
    ],
)
def test_whole_split_and_every_streamed_cut_agree(
    parser: Any, phase: Any, text: str, expected: tuple[str | None, str]
) -> None:
    assert split_reasoning(parser, phase, text) == expected
    rng = random.Random(0)
    cuts = [[text[i : i + 1] for i in range(len(text))]]  # a character at a time: every tag split
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 5))))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    for pieces in cuts:
        s = ReasoningStream(parser, phase)
        got = [s.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
        thinking, answer = "".join(g[0] for g in got), "".join(g[1] for g in got)
        assert (thinking or None, answer) == expected, pieces
        # Nothing of the answer is sent before the thinking is over.
        first_answer = next((k for k, g in enumerate(got) if g[1]), len(got))
        assert not any(g[0] for g in got[first_answer + 1 :])


def test_the_prompts_last_tag_decides_where_the_output_begins(tok: Any) -> None:
    ask = [{"role": "user", "content": "Two and two?"}]

    def ids(**kw: Any) -> list[int]:
        return tok.encode(
            tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=False, **kw), add_special_tokens=False
        )

    assert QWEN3.phase(ids(), tok) == "open"  # Qwen3's template leaves <think> to the model
    assert QWEN3.phase(ids(enable_thinking=False), tok) == "answer"  # ... or closes it for it
    assert R1.phase(ids(), tok) == "thinking" and R1.phase(ids(enable_thinking=False), tok) == "answer"
    opened = ids() + tok.encode("<think>\n", add_special_tokens=False)  # DeepSeek-R1 / Qwen3-Thinking prompts
    assert QWEN3.phase(opened, tok) == "thinking"
    # A finished turn's thinking earlier in the history does not count: only a tag at the prompt's end.
    history = [
        *ask,
        {"role": "assistant", "content": "<think>x</think>Four."},
        {"role": "user", "content": "And three?"},
    ]
    later = tok.encode(
        tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert QWEN3.phase(later, tok) == "open"
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_parser("granite")


def _accepts(compiled: Any, ids: list[int]) -> tuple[bool, bool]:
    """(whether the grammar takes every token, whether it is then complete)."""
    m = compiled.matcher()
    for t in ids:
        try:
            done = m.accept(t)
        except ValueError:
            return False, False
    return True, done


@pytest.mark.parametrize("phase", ["open", "thinking"])
def test_the_grammar_frees_the_thinking_and_holds_the_answer(tok: Any, compiler: GrammarCompiler, phase: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = StructuredOutput("json", json.dumps(schema), param="response_format.json_schema.schema")
    wrapped = after_thinking(spec, ReasoningMode(QWEN3, phase), tok)
    assert wrapped.param == spec.param and wrapped.kind == "grammar"
    compiled = compiler.compile(wrapped)
    enc = partial(tok.encode, add_special_tokens=False)
    opener = "<think>" if phase == "open" else ""
    assert _accepts(compiled, enc(f'{opener}Free {{"not": json}} text\n</think>\n\n{{"a": 4}}')) == (True, True)
    assert _accepts(compiled, enc(f"{opener}Free text</think>Four.")) == (False, False)  # the answer is held
    # The end tag spelled in pieces inside the thinking would end it for the splitter: refused.
    pieces = enc(f"{opener}Free") + [tok.convert_tokens_to_ids(t) for t in ("</", "think", ">")]
    assert _accepts(compiled, pieces)[0] is False
    # The thinking is optional only where the output may open it; after a prompt that opened it, the same
    # text is thinking and the answer is still to come.
    assert _accepts(compiled, enc('{"a": 4}')) == ((True, True) if phase == "open" else (True, False))
    # A prompt that closed the thinking keeps the spec as it was.
    assert after_thinking(spec, ReasoningMode(QWEN3, "answer"), tok) is spec


@pytest.mark.parametrize(
    "spec, answer",
    [
        (StructuredOutput("regex", r"[0-9]/[0-9]"), "3/4"),  # a slash, escaped for Lark
        (StructuredOutput("choice", json.dumps(["yes", "no"])), "no"),
        (StructuredOutput("grammar", 'root ::= "A" | "B"'), "B"),  # GBNF
        (StructuredOutput("grammar", 'start: "x" NUM\nNUM: /[0-9]/'), "x7"),  # Lark
    ],
)
def test_every_kind_of_spec_nests_after_the_thinking(
    tok: Any, compiler: GrammarCompiler, spec: StructuredOutput, answer: str
) -> None:
    compiled = compiler.compile(after_thinking(spec, ReasoningMode(QWEN3, "open"), tok))
    enc = partial(tok.encode, add_special_tokens=False)
    assert _accepts(compiled, enc(f"<think>Why not.</think>{answer}")) == (True, True)
    assert _accepts(compiled, enc("<think>Why not.</think>zzz"))[0] is False


def test_the_flag_names_vllms_parsers() -> None:
    from servelm.server.cli import build_parser

    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert PARSERS[args.reasoning_parser] is R1 and build_parser().parse_args(["serve"]).reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])


def test_tool_auto_grammar_nests_after_the_thinking(tok: Any, compiler: GrammarCompiler) -> None:
    from servelm.server.protocol_chat import ChatTool
    from servelm.server.tools import ToolMode

    tool = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}})  # fmt: skip
    spec = ToolMode([tool], auto=True).structured_output()  # Lark: the calls' array or free text
    compiled = compiler.compile(after_thinking(spec, ReasoningMode(QWEN3, "open"), tok))
    enc = partial(tok.encode, add_special_tokens=False)
    assert _accepts(compiled, enc('<think>A call.</think>\n\n[{"name": "f", "parameters": {"x": 1}}]')) == (True, True)
    assert _accepts(compiled, enc("<think>No call.</think>Hello there"))[0] is True
    assert _accepts(compiled, enc("<think>A call.</think>[oops"))[0] is False


def test_serve_hands_the_parser_to_the_app(serve_app: Any) -> None:
    """``servelm serve --reasoning-parser`` reaches the serving context (the engine and uvicorn faked)."""
    for argv, expected in ((["--reasoning-parser", "qwen3"], QWEN3), ([], None)):
        assert serve_app(*argv).state.serving.reasoning_parser is expected
