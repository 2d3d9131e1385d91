"""Speculative decoding by n-gram lookup ("prompt lookup"): drafts from the request's own tokens.

Decode is bound by reading the weights: a step that computes a few more positions of the same
sequence costs little more than one (on the CPU, int4: 9.0 ms for 1 row, 11.2 for 2, 16.2 for 4).
When the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) occurred earlier
in the prompt or the output, the tokens that followed them there are proposed as the next ones; the
model computes the real next token and the drafts' positions in one step, and every draft that equals
the token the model would have chosen there is kept. Nothing is proposed when nothing matches, so
text that does not repeat itself costs nothing.

Verifying is exact. Each position is sampled as usual (from the distribution given the drafts before
it), and a draft is kept only if it is what was sampled before it, so every token kept is a draw from
the right distribution: greedy requests get plain decoding's tokens (up to the rounding of the few-row
vs many-row matmul paths, as in any batch), sampled ones tokens distributed as plain decoding's. (With
a draft that is one token rather than a distribution, speculative sampling's accept-with-probability
p(d), else redraw without d, keeps d just as often and gives the same distribution.) Requests with
penalties (they depend on the tokens before each position) or a structured output do not speculate,
nor seeded sampled ones: their draws would depend on whether drafts were made, i.e. on the load.
vLLM's equivalent: ``--speculative-config '{"method": "ngram", ...}'``; the same JSON is accepted here.
A draft model (``{"method": "draft_model", "model": PATH, ...}``) proposes through ``scheduler.draft_model``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from servelm.runtime.batch import BatchItem
    from servelm.scheduler.request import Request


def _json_object(text: str) -> dict[str, Any]:
    try:
        raw: Any = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return dict(raw)


def _max_running(raw: dict[str, Any]) -> None:
    """vLLM's ``disable_by_batch_size`` (no drafts from that many running requests) as ``max_running``."""
    if "disable_by_batch_size" in raw:
        raw["max_running"] = int(raw.pop("disable_by_batch_size")) - 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: n-gram drafting."""

    num_speculative_tokens: int = 3  # drafts per step at most
    prompt_lookup_min: int = 2  # shortest suffix looked up
    prompt_lookup_max: int = 4  # longest suffix looked up (tried first)
    # No drafts in a step with more running requests than this: a batch's extra rows cost compute
    # that a single stream gets almost for free (the matmuls are memory-bound only at few rows).
    max_running: int = 1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative config: num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.max_running < 1:
            raise ValueError("speculative config: max_running must be at least 1")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From vLLM-style JSON: ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max":
        4, "prompt_lookup_min": 2, "max_running": 1}`` (only ``method`` "ngram"; ``disable_by_batch_size``,
        vLLM's name, sets ``max_running`` to one less)."""
        raw = _json_object(text)
        method = raw.pop("method", "ngram")
        if method not in ("ngram", "prompt_lookup"):
            raise ValueError(
                f"--speculative-config: method {method!r} is not supported (only 'ngram' and 'draft_model')"
            )
        if "model" in raw:
            raise ValueError(
                "--speculative-config: n-gram lookup takes no 'model'; a draft model is method 'draft_model' (not both)"
            )
        _max_running(raw)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown} (known: method, disable_by_batch_size, {', '.join(sorted(known))})"
            )
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in raw.values()):
            raise ValueError("--speculative-config: values must be integers")
        return cls(**raw)


@dataclass(frozen=True)
class DraftModelConfig:
    """``--speculative-config`` with a draft model: a smaller model of the same vocabulary proposes."""

    model: str  # a folder or a GGUF file, loaded as the served model is
    num_speculative_tokens: int = 3  # drafts per step (fewer only near max_tokens)
    # No drafts in a step with more running requests than this: every running request's drafts are
    # computed by the draft model and verified by the target, which paid for one request on this CPU but
    # cost more than it saved from two (docs/speculative-decoding.md).
    max_running: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative config: a draft model needs 'model', a folder or a GGUF file")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative config: num_speculative_tokens must be at least 1")
        if not isinstance(self.max_running, int) or self.max_running < 1:
            raise ValueError("speculative config: max_running must be at least 1")

    @classmethod
    def parse(cls, text: str) -> DraftModelConfig:
        """From vLLM-style JSON: ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3,
        "max_running": 1}`` (``disable_by_batch_size`` as for n-gram lookup)."""
        raw = _json_object(text)
        raw.pop("method", None)
        ngram = sorted(k for k in raw if k.startswith("prompt_lookup"))
        if ngram:
            raise ValueError(
                f"--speculative-config: {ngram} are n-gram lookup's; a draft model and n-gram lookup are not both served"
            )
        _max_running(raw)
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown} (known: method, model, num_speculative_tokens, max_running, disable_by_batch_size)"
            )
        if "model" not in raw:
            raise ValueError("--speculative-config: a draft model needs 'model', a folder or a GGUF file")
        return cls(**raw)


def parse_speculative_config(text: str) -> SpeculativeConfig | DraftModelConfig:
    """``--speculative-config``: method ``draft_model`` (or a ``model`` without a method, as vLLM reads
    it) is a draft model, anything else n-gram lookup."""
    raw = _json_object(text)
    method = raw.get("method")
    if method in ("draft_model", "draft") or (method is None and "model" in raw):
        return DraftModelConfig.parse(text)
    return SpeculativeConfig.parse(text)


class Proposer(Protocol):
    """What the scheduler and the engine ask of a drafting method."""

    @property
    def config(self) -> SpeculativeConfig | DraftModelConfig: ...

    @property
    def counts(self) -> DraftCounts: ...

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``limit`` drafts for ``req`` (placeholders where ``fill`` computes them)."""
        ...

    def fill(self, items: list[BatchItem]) -> int:
        """Compute the drafts of a scheduled step's items before it launches; returns how many of the
        drafts scheduled were dropped (their items' ``num_new_tokens`` lowered to match)."""
        ...

    def observe(self, req: Request, kept: int, proposed: int) -> None:
        """After a step verified ``proposed`` drafts of ``req`` and kept ``kept``."""
        ...


@dataclass
class DraftCounts:
    """Verifications since the metrics last took them: vLLM's ``spec_decode_num_drafts`` and
    ``..._num_accepted_tokens_per_pos`` (position 0 is the first draft)."""

    num_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, kept: int, proposed: int) -> None:
        if proposed:
            self.num_drafts += 1
            if len(self.accepted_per_pos) < proposed:
                self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
            for j in range(kept):
                self.accepted_per_pos[j] += 1

    def take(self) -> tuple[int, list[int]]:
        out = (self.num_drafts, self.accepted_per_pos)
        self.num_drafts, self.accepted_per_pos = 0, []
        return out


class NgramIndex:
    """For each n, the latest position that followed each n-gram of a token list, grown as it grows."""

    def __init__(self, nmin: int, nmax: int) -> None:
        self.sizes = range(nmax, nmin - 1, -1)
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.upto = 1  # continuation positions 1 .. upto-1 are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of ``tokens`` seen before, or []."""
        end = len(tokens)
        # Index the continuations that exist now (position end-1 is the newest; end has none yet).
        for j in range(self.upto, end):
            for n, m in self.maps.items():
                if j >= n:
                    m[tuple(tokens[j - n : j])] = j
        self.upto = max(self.upto, end)
        for n in self.sizes:
            if end <= n:
                continue
            at = self.maps[n].get(tuple(tokens[end - n :]))
            # at == end would be the suffix itself; only earlier occurrences (at < end) are indexed.
            if at is not None:
                return tokens[at : at + k]
        return []


# Drafting backs off on a request whose drafts are mostly wrong: a verifying step costs more than a
# plain one (on the CPU, int4: 1.3x with one draft, 1.55x with three), so full drafts need about half of
# them kept to pay, one draft about a third. The rate is a moving average of the share kept per step.
RATE_WEIGHT = 0.3
RATE_FULL = 0.5  # at or above: up to num_speculative_tokens drafts
RATE_PROBE = 0.25  # below: one draft every PROBE_EVERY decode steps, to notice when it pays again
PROBE_EVERY = 4


@dataclass
class DraftState:
    """A request's drafting: its n-gram index and how well its drafts have done."""

    index: NgramIndex
    kept_rate: float = 1.0  # optimistic at first
    skipped: int = 0


class NgramProposer:
    """Drafts for the requests that may speculate (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        from servelm.runtime.sampler import GREEDY_TEMPERATURE  # (not at import: the CLI parses configs without torch)

        self.config = config
        self.greedy_below = GREEDY_TEMPERATURE
        self.counts = DraftCounts()

    def eligible(self, req: Request) -> bool:
        p = req.params
        return (
            (p.temperature < self.greedy_below or req.generator is None)  # see the module docstring
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and req.grammar is None
            and req.num_output_tokens >= p.min_tokens
        )

    def propose(self, req: Request, limit: int) -> list[int]:
        """At most ``limit`` drafts to follow ``req``'s tokens (the last of which is not computed yet);
        fewer, or none, while few of the request's recent drafts were kept."""
        k = min(self.config.num_speculative_tokens, limit)
        if k <= 0 or not self.eligible(req):
            return []
        state = req.drafting
        if state is None:
            c = self.config
            state = req.drafting = DraftState(NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max))
        if state.kept_rate < RATE_PROBE:
            # Drafts have been wrong: a step with them costs more than it yields. Try one now and then.
            state.skipped += 1
            if state.skipped < PROBE_EVERY:
                return []
            state.skipped, k = 0, 1
        elif state.kept_rate < RATE_FULL:
            k = 1
        return state.index.propose(req.token_ids, k)

    def fill(self, items: list[BatchItem]) -> int:
        """Nothing to compute: the drafts are the request's own tokens."""
        return 0

    def observe(self, req: Request, kept: int, proposed: int) -> None:
        """After a step verified ``proposed`` drafts of ``req`` and kept ``kept``."""
        self.counts.add(kept, proposed)
        state = req.drafting
        if state is not None and proposed:
            state.kept_rate = (1 - RATE_WEIGHT) * state.kept_rate + RATE_WEIGHT * kept / proposed
