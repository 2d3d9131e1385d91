"""The batched sampler: turns the logits of the sampled rows of one step into next tokens.

One call per step, one row per sequence that samples. The work is split in two:

1. ``process_logits`` edits the logits in place, in the order OpenAI/vLLM users expect:
   structured-output mask -> logit_bias -> min_tokens -> repetition penalty -> presence/frequency
   penalties (``logits_processing``). A batch that uses none of them pays nothing.
2. ``sample`` then takes logprobs (of the processed logits, before temperature) where asked, the
   argmax of the greedy rows, and for the others: temperature -> top-k -> top-p -> min-p -> a draw.

Truncation (top-k, top-p, min-p) becomes a probability floor per row. Where the survivors all sit
among a row's few most likely tokens (found without sorting the row, see ``truncation``), the row
is drawn from those alone; otherwise the row is masked below its floor and drawn over the vocabulary.

Drawing: one uniform per sampled row per step, then an inverse-CDF lookup. A seeded sequence
draws its uniform from its own ``torch.Generator``, exactly one per step, so its tokens depend on
nothing else in the batch, nor on the ``Sampler`` instance; all other rows share one generator and
one call. (The exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)``, needs a vocabulary's
worth of random numbers per row: on this CPU that is ~30 ms per step at 32 rows x 49,152 tokens,
against ~2 ms for everything here.) Every per-row quantity is computed row by row (softmax,
per-block sums, sequential cumulative sums, exact top-k values, which path a row takes), so a
row's result does not depend on which other rows share its batch.

No accepted parameters make a probability inf or NaN while the model's logits are finite and within
+-LOGIT_RANGE: a repetition penalty keeps logits finite, a row it may have pushed near float32's
largest value is shifted by its maximum before a temperature below 1 divides it (``tempered_softmax``),
and min_tokens never forbids the last tokens a row may take. Should sampling a batch raise all the
same, ``sample_rows`` samples its rows one by one, with the same draws, and reports those that still
raise (``SampledRows.errors``), so one request's failure is its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from servelm.runtime.batch import SamplingSpec, SequenceView, TokenLogprobs
from servelm.runtime.logits_processing import process_logits
from servelm.runtime.platform import platform_of
from servelm.runtime.sampled_rows import SampledRows, logprob_tensors
from servelm.runtime.truncation import Truncation, argmax_rows, inverse_cdf, sample_sorted, truncate

log = logging.getLogger(__name__)

# Temperatures below this are treated as greedy (dividing by ~0 would overflow the logits).
GREEDY_TEMPERATURE = 1e-5

# How large a model's logits are assumed to get (a float32 head's stay far inside it). A repetition
# penalty r < 1 grows them towards LOGIT_RANGE / r; where that, divided by the temperature, could pass
# half of float32's range, ``tempered_softmax`` shifts the row by its maximum first.
LOGIT_RANGE = 1e30
_FLOAT32_MAX = torch.finfo(torch.float32).max
# (LOGIT_RANGE / r) / T stays below half of float32's range when r * T is at least this.
_SHIFT_BELOW = 2 * LOGIT_RANGE / _FLOAT32_MAX


def tempered_softmax(x: torch.Tensor, params: Sequence[SamplingSpec]) -> torch.Tensor:
    """Each row's softmax at its temperature (no row greedy); ``x`` [n, V], processed logits, is modified.

    softmax(x / T), except in rows whose repetition penalty may have grown the logits so far that x / T
    overflows (to inf, and the softmax to NaN): those get softmax((x - max x) / T), the same
    distribution with every value <= 0. Every other row keeps every bit it had.
    """
    temps = [p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        return x.softmax(-1)
    near = [i for i, p in enumerate(params) if p.repetition_penalty * p.temperature < _SHIFT_BELOW]
    if len(near) == len(params):
        x.sub_(x.amax(-1, keepdim=True))
    elif near:
        idx = platform_of(x.device).host_to_device(near, x.device)
        rows = x.index_select(0, idx)
        x.index_copy_(0, idx, rows.sub_(rows.amax(-1, keepdim=True)))
    return x.div_(platform_of(x.device).host_to_device(temps, x.device, x.dtype).unsqueeze(1)).softmax(-1)


class Sampler:
    """Chooses the next token of every sampled row of a step (see the module docstring).

    ``seed`` seeds the generator shared by rows without their own; None seeds it from the OS.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[SequenceView]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Next token (and logprobs, where asked) of each row; ``logits`` [R, V] may be modified in place."""
        return self.sample_rows(logits, seqs).resolve()

    def sample_rows(
        self, logits: torch.Tensor, seqs: Sequence[SequenceView], reload: Callable[[], torch.Tensor] | None = None
    ) -> SampledRows:
        """``sample``, with the results left where they were computed (on the device).

        Nothing here waits for the device (its host inputs go through ``host_to_device``) for greedy
        rows with logprobs, logit_bias, min_tokens and repetition/presence/frequency penalties; top-k /
        top-p truncation and seeded draws do (they read sizes or random numbers on the host), so with
        those the engine overlaps less of its work with the device.

        ``reload`` returns the logits as they were given (this call edits them): with it, should the
        batch raise, its rows are sampled again one by one with the same draws, and those that raise
        alone come back in ``errors`` (token 0) while the others get the tokens they would have got.
        """
        n_rows = logits.shape[0]
        if n_rows != len(seqs):
            raise ValueError(f"{n_rows} logit rows for {len(seqs)} sequences")
        if n_rows == 0:
            return SampledRows(torch.empty(0, dtype=torch.int64))
        u = self._uniforms(seqs)  # drawn before anything can fail: a retry reuses them
        try:
            return self._sample_batch(logits, seqs, u)
        except Exception:
            if reload is None:
                raise
            log.exception("sampling a batch of %d rows raised; sampling its rows one by one", n_rows)
            return self._sample_each(reload(), seqs, u)

    def _sample_each(self, logits: torch.Tensor, seqs: Sequence[SequenceView], u: torch.Tensor) -> SampledRows:
        """Find the rows that raise alone, then sample the others together with their own draws."""
        n = len(seqs)
        errors: dict[int, Exception] = {}
        for i in range(n):
            try:
                self._sample_batch(logits[i : i + 1].clone(), [seqs[i]], u[i : i + 1])
            except Exception as e:
                errors[i] = e
        out = SampledRows(torch.zeros(n, dtype=torch.int64, device=logits.device), errors=errors)
        ok = [i for i in range(n) if i not in errors]
        if not ok:
            return out
        idx = platform_of(logits.device).host_to_device(ok, logits.device)
        try:
            part = self._sample_batch(logits.index_select(0, idx), [seqs[i] for i in ok], u[ok])
        except Exception as e:  # these rows raise only together: none of them can be trusted
            errors.update(dict.fromkeys(ok, e))
            return out
        out.tokens.index_copy_(0, idx, part.tokens)
        if part.logprobs is not None:
            out.logprobs = replace(part.logprobs, rows=[ok[j] for j in part.logprobs.rows])
        return out

    def _sample_batch(self, logits: torch.Tensor, seqs: Sequence[SequenceView], u: torch.Tensor) -> SampledRows:
        """``sample_rows`` proper, with each row's uniform (``_uniforms``) drawn already."""
        n_rows = logits.shape[0]
        logits = logits.float().contiguous()  # no copy for the float32 rows the runner hands us
        params = [s.params for s in seqs]
        self.process_logits(logits, seqs)

        device = logits.device
        platform = platform_of(device)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_idx = platform.host_to_device(lp_rows, device) if lp_rows else None
        logprobs = logits.index_select(0, lp_idx).log_softmax(-1) if lp_idx is not None else None

        greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_TEMPERATURE]
        if len(greedy) == n_rows:
            tokens = argmax_rows(logits)
        elif not greedy:
            tokens = self._sample_rows(logits, seqs, u)
        else:
            greedy_set = set(greedy)
            rand = [i for i in range(n_rows) if i not in greedy_set]
            g_idx = platform.host_to_device(greedy, device)
            r_idx = platform.host_to_device(rand, device)
            tokens = torch.empty(n_rows, dtype=torch.int64, device=device)
            tokens[g_idx] = argmax_rows(logits.index_select(0, g_idx))
            tokens[r_idx] = self._sample_rows(logits.index_select(0, r_idx), [seqs[i] for i in rand], u[rand])

        out = SampledRows(tokens)
        if logprobs is not None and lp_idx is not None:
            out.logprobs = logprob_tensors(
                logprobs, tokens.index_select(0, lp_idx), lp_rows, [int(params[i].logprobs or 0) for i in lp_rows]
            )
        return out

    def process_logits(self, logits: torch.Tensor, seqs: Sequence[SequenceView]) -> None:
        """Apply the structured-output mask, logit_bias, min_tokens and penalties in place
        (``logits_processing.process_logits``); a method so that a test can make it raise."""
        process_logits(logits, seqs)

    def _sample_rows(self, x: torch.Tensor, seqs: Sequence[SequenceView], u: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and a draw (uniforms ``u``) for rows that are not greedy;
        ``x`` is modified."""
        n, vocab = x.shape
        device = x.device
        platform = platform_of(device)
        params = [s.params for s in seqs]
        probs = tempered_softmax(x, params)

        # Every truncation becomes a per-row probability floor. Rows whose survivors all sit in a
        # ranked head are drawn from it; the rest are masked and drawn over the whole vocabulary.
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        cut = Truncation(floor=torch.zeros(n, dtype=probs.dtype, device=device), heads=[])
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            cut = truncate(
                probs,
                platform.host_to_device(top_k, device),
                platform.host_to_device(top_p, device, probs.dtype),
            )
        floor = cut.floor
        if any(m > 0.0 for m in min_p):
            # The most likely token survives top-k/top-p, and ratios survive renormalisation, so
            # min-p compares with the untruncated max.
            floor = torch.maximum(floor, platform.host_to_device(min_p, device, probs.dtype) * probs.amax(-1))

        u = platform.host_to_device(u, device)
        if not cut.heads:
            if bool((floor > 0).any()):
                probs.masked_fill_(probs < floor.unsqueeze(1), 0.0)
            return inverse_cdf(probs, u)
        tokens = torch.empty(n, dtype=torch.int64, device=device)
        in_head = torch.zeros(n, dtype=torch.bool, device=device)
        for rows, vals, ids in cut.heads:
            vals = vals.masked_fill(vals < floor[rows].unsqueeze(1), 0.0)
            tokens[rows] = sample_sorted(vals, ids, u[rows])
            in_head[rows] = True
        rest = torch.nonzero(~in_head).flatten()
        if rest.numel():
            sub = probs.index_select(0, rest)
            sub.masked_fill_(sub < floor[rest].unsqueeze(1), 0.0)
            tokens[rest] = inverse_cdf(sub, u[rest])
        return tokens

    def _uniforms(self, seqs: Sequence[SequenceView]) -> torch.Tensor:
        """One uniform in [0, 1) per row that is not greedy (greedy rows: 0, nothing drawn): from the
        row's own generator if seeded, else the shared one."""
        drawn = [j for j, s in enumerate(seqs) if s.params.temperature >= GREEDY_TEMPERATURE]
        shared = [j for j in drawn if seqs[j].generator is None]
        if len(shared) == len(seqs):
            return torch.rand(len(seqs), generator=self._generator, dtype=torch.float64)
        u = torch.zeros(len(seqs), dtype=torch.float64)
        if shared:
            u[shared] = torch.rand(len(shared), generator=self._generator, dtype=torch.float64)
        for j in drawn:
            g = seqs[j].generator
            if g is not None:
                u[j] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device).item()
        return u
