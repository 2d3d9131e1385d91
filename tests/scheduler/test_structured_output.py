"""Structured outputs through the whole engine on a tiny random Llama (the default model's tokenizer):
the grammar, not the model, decides the shape of the text, so every output must match it exactly;
greedy constrained decoding equals a plain masked-argmax loop over Hugging Face's logits."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams
from servelm.scheduler.structured_output import GrammarCompiler, StructuredOutput

MiB = 2**20

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["red", "green", 'a "quoted" one', "new\nline"]
GBNF = 'root ::= "x=" digit digit? digit? ";"\ndigit ::= [0-9]'  # llama.cpp's grammar format
LARK = 'start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,2}/'


def spec(kind: str) -> StructuredOutput:
    values = {
        "json": json.dumps(PERSON),
        "regex": REGEX,
        "choice": json.dumps(CHOICES),
        "gbnf": GBNF,
        "lark": LARK,
    }
    return StructuredOutput("grammar" if kind in ("gbnf", "lark") else kind, values[kind])


def check(kind: str, text: str) -> None:
    """The whole text matches the spec of ``kind``."""
    if kind == "json":
        obj = json.loads(text)
        assert set(obj) >= {"name", "age"} and set(obj) <= {"name", "age", "tags"}, text
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
        assert all(t in ("a", "b", "c") for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 3
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "gbnf":
        assert re.fullmatch(r"x=[0-9]{1,3};", text), text
    else:
        assert re.fullmatch(r"\(\d{1,2}(,\d{1,2}){0,2}\)", text), text


@pytest.fixture(scope="module")
def eng(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 * MiB, max_model_len=256))


@pytest.fixture(scope="module")
def prompts(eng: Engine) -> list[list[int]]:
    texts = ["Describe a person as JSON:", "Pick one", "1 2 3 4 5 6 7 8 9 10 " * 3, "x"]
    return [eng.tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "gbnf", "lark"])
def test_every_output_matches_its_spec_greedy_and_sampled(eng: Engine, prompts: list[list[int]], kind: str) -> None:
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=120, temperature=temperature, seed=7, n=3, structured_output=spec(kind))
        for result in eng.generate(prompts, params):
            for choice in result.outputs:
                assert choice.finish_reason == "stop", (kind, temperature, choice.text)
                check(kind, choice.text)
    assert eng.block_manager.num_used_blocks == 0


def test_sampled_outputs_differ_yet_all_match(eng: Engine, prompts: list[list[int]]) -> None:
    """The mask restricts the draw; it does not make it greedy."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=8, structured_output=spec("regex"))
    (result,) = eng.generate(prompts[:1], params)
    texts = [c.text for c in result.outputs]
    for t in texts:
        check("regex", t)
    assert len(set(texts)) >= 4, texts


def test_greedy_equals_a_masked_argmax_loop_over_hf_logits(
    tiny_llama_dir: Path, eng: Engine, prompts: list[list[int]]
) -> None:
    """Token for token: HF float32 logits, the same grammar's mask, argmax, feed back."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    compiler = GrammarCompiler(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids)
    vocab = eng.model_config.vocab_size
    for kind in ("json", "lark"):
        s = spec(kind)
        ours = eng.generate(prompts, SamplingParams(max_tokens=60, temperature=0.0, structured_output=s))
        for ids, result in zip(prompts, ours):
            matcher = compiler.compile(StructuredOutput(s.kind, s.value)).matcher()
            bitmask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
            seq, ref = list(ids), []
            with torch.inference_mode():
                for _ in range(60):
                    logits = hf(torch.tensor([seq])).logits[0, -1].float()
                    matcher.fill_bitmask(bitmask, 0)
                    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
                    logits[~bits.view(-1)[:vocab].bool()] = float("-inf")
                    tok = int(logits.argmax())
                    ref.append(tok)
                    if tok in eng.eos_token_ids or matcher.accept(tok):
                        break
                    seq.append(tok)
            assert result.outputs[0].token_ids == ref, kind


def test_same_tokens_with_chunked_prefill_preemption_and_scheduling_ahead(
    tiny_llama_dir: Path, eng: Engine, prompts: list[list[int]]
) -> None:
    """The matcher follows the output tokens, which preemption (recompute) and chunking never change."""
    params = SamplingParams(max_tokens=80, temperature=0.0, n=2, structured_output=spec("json"))
    reference = [[c.token_ids for c in r.outputs] for r in eng.generate(prompts, params)]
    # 10 blocks of 16 tokens for 4 prompts x 2 choices of 2-70 prompt and 20-40 output tokens: some must wait
    # for others' blocks, and some are preempted.
    tight = Engine(
        EngineConfig(
            model=str(tiny_llama_dir),
            kv_cache_memory=10 * 16 * eng.capacity.kv_bytes_per_token,
            max_model_len=160,
            max_num_batched_tokens=16,
        )
    )
    for ahead in (False, True):
        tight.async_scheduling = ahead
        got = [[c.token_ids for c in r.outputs] for r in tight.generate(prompts, params)]
        assert got == reference, f"async_scheduling={ahead}"
        assert tight.block_manager.num_used_blocks == 0
    assert tight.scheduler.num_preemptions_total > 0


def test_a_complete_structure_stops_even_with_ignore_eos(eng: Engine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, structured_output=spec("choice"))
    for result in eng.generate(prompts, params):
        c = result.outputs[0]
        assert c.finish_reason == "stop" and c.text in CHOICES


def test_max_tokens_cuts_the_structure_with_length(eng: Engine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, structured_output=spec("json"))
    (result,) = eng.generate(prompts[:1], params)
    c = result.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3 and c.text.startswith("{")
    assert eng.block_manager.num_used_blocks == 0


def test_logprobs_are_those_of_the_masked_distribution(eng: Engine, prompts: list[list[int]]) -> None:
    """Logprobs come from the processed logits: a token the grammar forbids has -inf, so every
    alternative with a finite logprob starts one of the choices, and greedy takes the best of them."""
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=20, structured_output=spec("choice"))
    (result,) = eng.generate(prompts[:1], params)
    first = result.outputs[0].logprobs[0]
    finite = [(t, lp) for t, lp in first.top if lp > float("-inf")]
    assert finite and finite[0][0] == first.token_id and first.rank == 1
    for t, _ in finite:
        assert any(c.startswith(eng.tokenizer.decode([t])) for c in CHOICES), t
    # Fewer tokens than 20 begin a choice, so the masked rest fill the top 20 with -inf.
    assert len(finite) < 20 and sum(math.exp(lp) for _, lp in finite) == pytest.approx(1.0, abs=1e-4)


def test_unconstrained_rows_in_the_same_batch_are_untouched(eng: Engine, prompts: list[list[int]]) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=60, temperature=0.0, structured_output=spec("json"))
    alone = [r.outputs[0].token_ids for r in eng.generate(prompts, free)]
    mixed = eng.generate(prompts + prompts, [free] * len(prompts) + [constrained] * len(prompts))
    assert [r.outputs[0].token_ids for r in mixed[: len(prompts)]] == alone
    for r in mixed[len(prompts) :]:
        check("json", r.outputs[0].text)
    assert eng.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "bad, param",
    [
        (StructuredOutput("regex", "[a-", param="structured_outputs.regex"), "structured_outputs.regex"),
        (
            StructuredOutput("json", '{"type": "florp"}', param="response_format.json_schema.schema"),
            "response_format.json_schema.schema",
        ),
        (StructuredOutput("json", '{"$ref": "#/nowhere"}'), "structured_outputs"),
        (StructuredOutput("json", "not json at all"), "structured_outputs"),
        (StructuredOutput("grammar", 'start: "a" undefined_rule'), "structured_outputs"),
        (StructuredOutput("grammar", 'root ::= "a" missing'), "structured_outputs"),
        (StructuredOutput("grammar", 'root ::= ("a"'), "structured_outputs"),
        # Valid, but its first mask takes ~0.3 s here (limit 50 ms): refused as too complex.
        (StructuredOutput("regex", "a{300000}"), "structured_outputs"),
    ],
)
def test_invalid_specs_are_refused_naming_their_param(eng: Engine, bad: StructuredOutput, param: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        eng.grammar_compiler.compile(bad)
    assert e.value.param == param and str(e.value)
    # Through add_request too (offline use compiles there): nothing is queued.
    with pytest.raises(InvalidParameterError):
        eng.add_request("bad", [1, 2, 3], SamplingParams(structured_output=StructuredOutput(bad.kind, bad.value)))
    assert not eng.has_unfinished_requests()


def test_too_complex_is_named_as_such(eng: Engine) -> None:
    with pytest.raises(InvalidParameterError, match="too complex to follow at serving speed"):
        eng.grammar_compiler.compile(StructuredOutput("regex", "a{300000}"))


def test_compiled_specs_are_cached_and_matchers_independent(eng: Engine) -> None:
    c = eng.grammar_compiler
    a, b = c.compile(spec("regex")), c.compile(spec("regex"))
    assert a is b
    assert c.compile(StructuredOutput("json", json.dumps(PERSON), whitespace_flexible=False)) is not c.compile(
        spec("json")
    )
    m1, m2 = a.matcher(), a.matcher()
    tok: Any = eng.tokenizer
    for t in tok.encode("ab-", add_special_tokens=False):
        m1.accept(t)
    with pytest.raises(ValueError, match="does not fit"):
        m2.accept(tok.encode("-", add_special_tokens=False)[0])  # m2 is still at the start: "-" cannot begin


def test_a_structure_allowing_only_its_end_under_min_tokens_ends_that_request_alone(
    eng: Engine, prompts: list[list[int]]
) -> None:
    """Before min_tokens the sampler forbids EOS, and a regex of the empty string allows nothing else. The
    server refuses such a request up front (a 400); offline, the engine ends that request alone (the
    sampler lets the end through, or the token taken does not fit and the request fails with a one-line
    reason), and its batchmates run on."""
    dead = SamplingParams(max_tokens=8, min_tokens=3, temperature=0.0, structured_output=StructuredOutput("regex", ""))
    free = SamplingParams(max_tokens=8, temperature=0.0)
    alone = eng.generate(prompts[:1], free)[0].outputs[0].token_ids
    ended, other = eng.generate([prompts[0], prompts[0]], [dead, free])
    c = ended.outputs[0]
    assert c.text == "" and c.finish_reason in ("stop", "error")
    assert c.error is None or ("min_tokens" in c.error and "\n" not in c.error)
    assert other.outputs[0].token_ids == alone
    assert eng.block_manager.num_used_blocks == 0


def test_a_token_that_does_not_fit_is_refused_in_one_line(eng: Engine) -> None:
    m = eng.grammar_compiler.compile(StructuredOutput("regex", "")).matcher()
    tok: Any = eng.tokenizer
    with pytest.raises(ValueError) as e:
        m.accept(tok.encode("a", add_special_tokens=False)[0])
    assert "does not fit" in str(e.value) and "min_tokens" in str(e.value) and "\n" not in str(e.value)


def test_what_a_structure_allows_first(eng: Engine) -> None:
    c = eng.grammar_compiler
    tok: Any = eng.tokenizer
    (a,) = tok.encode("a", add_special_tokens=False)
    empty = c.compile(StructuredOutput("regex", ""))
    assert set(empty.eos_token_ids) == set(eng.eos_token_ids)
    assert empty.can_start_without([]) and not empty.can_start_without(empty.eos_token_ids)
    optional = c.compile(StructuredOutput("regex", "a?"))
    assert optional.can_start_without(optional.eos_token_ids)
    assert not optional.can_start_without([a, *optional.eos_token_ids])
    assert c.compile(spec("json")).can_start_without(range(100))


def test_specs_are_bounded_in_length_and_the_cache_in_characters(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    import servelm.scheduler.structured_output as so

    c = GrammarCompiler(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids)
    long = "|".join(f"w{i}" for i in range(so.MAX_SPEC_CHARS // 4))
    assert len(long) > so.MAX_SPEC_CHARS
    with pytest.raises(InvalidParameterError, match=f"the limit is {so.MAX_SPEC_CHARS}") as e:
        c.compile(StructuredOutput("regex", long, param="structured_outputs.regex"))
    assert e.value.param == "structured_outputs.regex"
    monkeypatch.setattr(so, "CACHE_CHARS", 100)
    specs = [StructuredOutput("regex", f"{'x' * 30}{i}") for i in range(5)]
    compiled = [c.compile(s) for s in specs]
    assert len(c._cache) == 3 and c._cache_chars == 3 * 31  # the oldest two went
    assert c.compile(specs[-1]) is compiled[-1] and c.compile(specs[0]) is not compiled[0]


def test_thousands_of_choices_are_followed_to_the_end(eng: Engine, prompts: list[list[int]]) -> None:
    """A choice list past llguidance's 2,000 items a parser row (one alternative each, as a rule) ended
    its requests with an error after their first token; as one lexeme it has no such limit. Choices
    that are prefixes of others (``"7"``, ``"70"``, ``"700"``) must each stay reachable."""
    many = [f"item {i}" for i in range(2500)] + ["7", "70", "700"]
    so = StructuredOutput("choice", json.dumps(many), "structured_outputs.choice")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=11, n=8, structured_output=so)
    for result in eng.generate(prompts[:2], params):
        for choice in result.outputs:
            assert choice.finish_reason == "stop", choice
            assert choice.text in many, choice.text
    # Each of the prefixes, walked token by token, ends the structure exactly where it ends.
    compiled = eng.grammar_compiler.compile(StructuredOutput("choice", json.dumps(many), "structured_outputs.choice"))
    for text in ("7", "70", "700", "item 2499"):
        m = compiled.matcher()
        ids = eng.tokenizer.encode(text, add_special_tokens=False)
        done = [m.accept(t) for t in ids]
        assert not any(done[:-1]), (text, done)
        assert done[-1] == (text != "7" and text != "70"), (text, done)  # ("7" and "70" may go on)
    assert eng.block_manager.num_used_blocks == 0
