"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

Built on llguidance (the Rust library behind Guidance; one of vLLM's backends): a grammar is compiled
against the tokenizer's vocabulary once per distinct spec, and each sequence gets its own matcher.
Every step, the sampler asks each constrained row's matcher for a bitmask of the tokens that keep
the output inside the grammar (``GrammarMatcher.fill_bitmask``: ~10 us for a JSON schema over
49,152 tokens here) and sets the others to -inf; the engine then feeds the chosen token back
(``GrammarMatcher.accept``), and a matcher that can take no more tokens finishes its request with
"stop", as EOS would.

Compiling can take long for a large schema, so the server compiles at the edge, in a worker thread
(``GrammarCompiler.compile``: a bad spec is a 400 there, and so is one longer than ``MAX_SPEC_CHARS``
or whose first mask takes longer than ``MAX_FIRST_MASK_S``), and hands the result to the engine
inside ``SamplingParams``; the engine thread only copies it (microseconds) for each choice. The
copies share the lexer states the first mask built, so the engine's first mask of a request is as
cheap as the later ones.

The library is imported on first use: a server that never sees a constrained request does not need it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from servelm.runtime.tokenizer import tokenizer_json
from servelm.scheduler.errors import InvalidParameterError

if TYPE_CHECKING:  # the server builds specs and compiles them without importing torch
    import torch

Kind = Literal["json", "regex", "choice", "grammar"]

# JSON whitespace between tokens: none, one space, or a newline and up to 20 spaces or tabs (llama.cpp's
# choice). Unbounded whitespace lets a model that is unsure what comes next emit it forever.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"

# A spec whose first token mask takes longer than this is refused: every constrained step waits for its
# masks, batchmates included. Typical specs take 0.02-2 ms (JSON schemas, regexes, grammars); a huge
# counted repetition (a{100000}) ~90 ms, then ~25 ms every step.
MAX_FIRST_MASK_S = 0.05

# Distinct specs kept compiled (an agent sends the same few schemas again and again), and their
# characters in all: a compiled spec keeps ~35 bytes per character of it.
CACHE_SIZE = 256
CACHE_CHARS = 4 * 2**20

# The longest spec (a JSON schema's text, a regex, a grammar, the choices as JSON): compiling costs
# ~1.3 us per character in the tokenizer thread every request shares.
MAX_SPEC_CHARS = 256 * 1024


@dataclass
class StructuredOutput:
    """What a request's output must match; ``param`` names the request field it came from (for errors).

    ``kind``: "json" (``value`` a JSON schema, as text; ``"{}"`` or ``{"type": "object"}`` for any
    object), "regex" (the whole output matches it), "choice" (``value`` a JSON list of strings: the
    output is one of them) or "grammar" (Lark, as llguidance reads it, or GBNF, llama.cpp's format).
    ``compiled`` is filled by ``GrammarCompiler.compile`` (at the edge, or by the engine if not).
    """

    kind: Kind
    value: str
    param: str = "structured_outputs"
    whitespace_flexible: bool = True  # json: some whitespace between tokens (JSON_WHITESPACE), else none
    compiled: CompiledGrammar | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.value, self.whitespace_flexible)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency; missing only in a hand-made install
        raise InvalidParameterError(
            "structured_outputs", f"structured outputs need the llguidance package, which is not installed ({e})"
        ) from None
    return llguidance


def grammar_text(spec: StructuredOutput) -> str:
    """The spec as an llguidance grammar (its JSON form, or Lark)."""
    llg = _llguidance()
    m = llg.LLMatcher
    if spec.kind == "json":
        options: dict[str, Any] = {"whitespace_flexible": spec.whitespace_flexible}
        if spec.whitespace_flexible:
            options["whitespace_pattern"] = JSON_WHITESPACE
        return m.grammar_from_json_schema(spec.value, defaults=options)
    if spec.kind == "regex":
        return m.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        # Lark string literals take JSON's escapes, so each choice is matched literally. The choices are
        # one terminal (one lexeme, a DFA): as alternatives of a rule, the parser's rows grow with their
        # number and llguidance stops at 2,000 items a row, in the middle of a request.
        choices = json.loads(spec.value)
        return m.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )
    if spec.kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(spec.value)
        except Exception as e:  # GBNF the converter cannot read (it raises plain Exceptions too)
            raise InvalidParameterError(spec.param, f"Invalid grammar (GBNF): {e}") from None
        return m.grammar_from_lark(lark)
    raise InvalidParameterError(spec.param, f"unknown structured output kind {spec.kind!r}")


class CompiledGrammar:
    """A spec compiled against one vocabulary: a matcher in its initial state, copied for each sequence."""

    def __init__(self, template: Any, first_mask: bytes = b"", eos_token_ids: Sequence[int] = ()) -> None:
        self._template = template
        self._first_mask = first_mask  # the tokens allowed first (bit t of little-endian word t // 32)
        self._eos = tuple(eos_token_ids)  # the tokens that end the structure

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokens by which this structure ends (what its mask allows once it is complete)."""
        return self._eos

    def can_start_without(self, forbidden: Iterable[int]) -> bool:
        """Whether a first token outside ``forbidden`` is allowed. Before ``min_tokens`` the sampler
        forbids EOS and the stop token ids: a structure allowing nothing else (a regex of the empty
        string allows only its end) leaves it no token to take."""
        mask = bytearray(self._first_mask)
        for t in forbidden:
            if 0 <= t < 8 * len(mask):
                mask[t >> 3] &= ~(1 << (t & 7)) & 0xFF
        return any(mask)


class GrammarMatcher:
    """One sequence's position in its grammar (satisfies ``runtime.batch.TokenMask``)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU, bit t of word t // 32)."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def copy(self) -> GrammarMatcher:
        """An independent copy of this state (speculative decoding masks each draft's position with one)."""
        return GrammarMatcher(self._m.deep_copy())

    def accept(self, token: int) -> bool:
        """Advance past ``token``; returns whether the grammar is complete (no token but EOS may follow).

        Raises ``ValueError`` for a token the grammar does not allow (the mask makes that a bug).
        """
        m = self._m
        if not m.consume_token(token):
            # The sampler takes a token the mask allows unless the mask allowed none it could take.
            first_line = m.get_error().strip().splitlines()[0]
            raise ValueError(
                f"token {token} does not fit the requested structure ({first_line}): the structure allowed no "
                "token this request may take here (before min_tokens, its end and the stop token ids are forbidden)"
            )
        return bool(m.is_stopped())


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs for one tokenizer; thread-safe, with an LRU cache.

    The tokenizer's vocabulary is read on first use (~0.2 s for 49,152 tokens here). ``tokenizer``
    must not be used by another thread meanwhile (the server passes its private copy).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str, bool], CompiledGrammar] = OrderedDict()
        self._cache_chars = 0  # of the cached specs' values
        self._lock = threading.Lock()

    def _vocabulary(self) -> Any:
        if self._ll_tokenizer is None:
            llg = _llguidance()
            backend = getattr(self._tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise InvalidParameterError(
                    "structured_outputs", "structured outputs need a fast (Rust) Hugging Face tokenizer"
                )
            # The vocabulary beyond the tokenizer's (a model's padded embedding) is never allowed.
            self._ll_tokenizer = llg.LLTokenizer(
                tokenizer_json(self._tokenizer), n_vocab=self._vocab_size, eos_token=self._eos or None
            )
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Compile ``spec`` (or take it from the cache), store it in ``spec.compiled`` and return it;
        ``InvalidParameterError`` naming ``spec.param`` when the spec is not a valid grammar."""
        if len(spec.value) > MAX_SPEC_CHARS:
            raise InvalidParameterError(
                spec.param,
                f"This {_WHAT[spec.kind]} has {len(spec.value)} characters (as JSON, for a schema or choices); "
                f"the limit is {MAX_SPEC_CHARS}.",
            )
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                spec.compiled = hit
                return hit
            vocab = self._vocabulary()
        try:
            text = grammar_text(spec)
        except InvalidParameterError:
            raise
        except (ValueError, TypeError) as e:  # JSON that is not JSON...
            raise _invalid(spec, str(e)) from None
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, vocab)
        if failed:
            raise _invalid(spec, messages[0])
        template = llg.LLMatcher(vocab, text, log_level=0)
        # The first mask here, in the caller's thread: it is the dearest (the lexer builds its states,
        # which every copy shares), so the engine thread no longer pays it, and it measures the spec.
        t0 = time.perf_counter()
        first_mask = b"" if template.is_error() else template.compute_bitmask()
        took = time.perf_counter() - t0
        if template.is_error():
            raise _invalid(spec, template.get_error())
        if took > MAX_FIRST_MASK_S:
            raise InvalidParameterError(
                spec.param,
                f"This {_WHAT[spec.kind]} is too complex to follow at serving speed: its first token mask took "
                f"{took * 1e3:.0f} ms (the limit is {MAX_FIRST_MASK_S * 1e3:.0f} ms; every step of a batch waits for "
                "its masks). Large counted repetitions such as a{100000} are the usual cause.",
            )
        compiled = CompiledGrammar(template, first_mask, vocab.eos_tokens)
        with self._lock:
            if spec.key not in self._cache:
                self._cache_chars += len(spec.value)
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE or self._cache_chars > CACHE_CHARS:
                (_, value, _), _ = self._cache.popitem(last=False)
                self._cache_chars -= len(value)
        spec.compiled = compiled
        return compiled


_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _invalid(spec: StructuredOutput, detail: str) -> InvalidParameterError:
    return InvalidParameterError(spec.param, f"Invalid {_WHAT[spec.kind]}: {detail.strip()}")
