"""The batched sampler: turns the logits of the sampled rows of one step into next tokens.

One call per step, one row per sequence that samples. The work is split in two:

1. ``process_logits`` edits the logits in place, in the order OpenAI/vLLM users expect:
   structured-output mask -> logit_bias -> min_tokens -> repetition penalty -> presence/frequency
   penalties. The mask reads one bit per token of each constrained row; every other step touches
   only the (row, token) positions concerned (gathered/scattered through flat indices built in one
   go), so its cost follows the number of tokens involved, not the vocabulary. A batch that uses
   none of them pays nothing.
2. ``sample`` then takes logprobs (of the processed logits, before temperature) where asked, the
   argmax of the greedy rows, and for the others: temperature -> top-k -> top-p -> min-p -> a draw.

Truncation (top-k, top-p, min-p) becomes a probability floor per row. Where the survivors all sit
among a row's few most likely tokens (found without sorting the row, see ``_head``), the row is
drawn from those alone; otherwise the row is masked below its floor and drawn over the vocabulary.

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
from dataclasses import dataclass, replace
from itertools import chain
from typing import Callable, Sequence

import torch

from servelm.runtime import cpu_ops
from servelm.runtime.batch import LogitBias, SamplingSpec, SequenceView, TokenLogprobs

log = logging.getLogger(__name__)

# Temperatures below this are treated as greedy (dividing by ~0 would overflow the logits).
GREEDY_TEMPERATURE = 1e-5

# How large a model's logits are assumed to get (a float32 head's stay far inside it). A repetition
# penalty r < 1 grows them towards LOGIT_RANGE / r; where that, divided by the temperature, could pass
# half of float32's range, ``tempered_softmax`` shifts the row by its maximum first.
LOGIT_RANGE = 1e30
_FLOAT32_MAX = torch.finfo(torch.float32).max

# Truncation never sorts a whole row (torch's CPU sort of 49,152 floats: ~1.7 ms per row here).
# Top-k with k up to DIRECT_TOP_K ranks a head of k tokens (``_head``), and top-p first looks for
# its nucleus among the TOP_P_FIRST_CANDIDATES most likely tokens: enough for most steps of a chat
# model at temperature <= 1 (measured on SmolLM2 at T=1, top_p=0.95: 63% of steps). Larger k and
# wider nuclei go through a histogram of the probabilities' leading bits (``_radix_floor``).
DIRECT_TOP_K = 256
TOP_P_FIRST_CANDIDATES = 64

_BLOCK = 256  # vocabulary block for the two-level argmax and inverse CDF


def _block_size(vocab_size: int) -> int:
    """The largest power of two <= _BLOCK dividing the vocabulary (1 for odd sizes)."""
    b = _BLOCK
    while vocab_size % b:
        b //= 2
    return b


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (first maximal index per row), about 10x faster on CPU for wide rows.

    torch's CPU argmax is a scalar loop while ``amax`` is vectorised: take the max of each block,
    the first block holding the row max, then the first maximum inside that block.
    """
    n, v = x.shape
    b = _block_size(v)
    if b < 16 or v <= _BLOCK or x.device.type != "cpu":
        return x.argmax(-1)  # (on a GPU argmax is one fast kernel)
    blocks = x.view(n, v // b, b)
    best_block = blocks.amax(-1).argmax(-1)  # [n]
    inner = blocks[torch.arange(n, device=x.device), best_block]  # [n, b]
    return best_block * b + inner.argmax(-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of non-negative, unnormalised ``probs`` [n, V] with uniforms ``u`` [n].

    Row i returns the first index j with cumsum(probs[i])[j] > u[i] * sum(probs[i]), so a zero
    entry is never returned. Two levels keep it exact and cheap: float32 sums of vocabulary blocks
    accumulated in float64 pick the block, then a float64 cumulative sum inside that one block
    picks the token (a float32 cumsum over 49k entries would swallow tokens below ~1e-7 of the mass).
    """
    n, v = probs.shape
    b = _block_size(v)
    blocks = probs.view(n, v // b, b)
    block_mass = blocks.sum(-1)  # [n, nb] float32
    cum = block_mass.double().cumsum(-1)  # [n, nb]
    total = cum[:, -1:]
    # u < 1, but u * total can round up to total; stay strictly below it.
    target = torch.minimum(u.to(cum.dtype).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    blk = torch.searchsorted(cum, target, right=True).clamp_max_(v // b - 1)  # [n, 1]
    before = torch.where(blk > 0, cum.gather(1, (blk - 1).clamp_min(0)), 0.0)
    # Fraction of the chosen block's mass to walk; its float32 sum and the float64 cumsum below may
    # differ in the last bits, so rescale rather than subtract.
    frac = ((target - before) / block_mass.gather(1, blk).double()).clamp_(0.0, 1.0 - 1e-12)
    inner = blocks[torch.arange(n, device=probs.device), blk.squeeze(1)].double().cumsum(-1)  # [n, b]
    j = torch.searchsorted(inner, frac * inner[:, -1:], right=True).clamp_max_(b - 1)
    return (blk * b + j).squeeze(1)


@dataclass
class Truncation:
    """What top-k/top-p leave of each row of a probability matrix [n, V].

    ``floor[i]``: the smallest surviving probability of row i (0: nothing truncated). Rows listed
    in a ``heads`` entry have every survivor inside that entry's head, so they can be sampled there
    without touching the rest of the vocabulary.
    """

    floor: torch.Tensor  # [n]
    # (row ids [g], probabilities [g, W] descending with zeros past top-k, their token ids [g, W])
    heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> Truncation:
    """Top-k then top-p, as probability floors (plus heads where the survivors fit in one).

    ``probs`` [n, V] is a softmax; ``top_k`` [n] int64 (>= V means off); ``top_p`` [n] (1 means off).
    Top-k keeps the k most likely tokens (ties with the k-th may survive too); top-p then keeps, of
    the renormalised top-k distribution, the smallest most-likely set whose mass reaches top_p
    (plus ties with its last member); the most likely token always survives. A row's result
    depends on that row alone: heads are exact, sums are sequential or blockwise.
    """
    n, v = probs.shape
    device = probs.device
    top_k = top_k.clamp_max(v)
    has_k, has_p = top_k < v, top_p < 1.0
    small_k = has_k & (top_k <= DIRECT_TOP_K)
    floor = torch.zeros(n, dtype=probs.dtype, device=device)
    heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # Small k, and top-p alone: rank a head wide enough for every such row.
    head_rows = torch.nonzero(small_k | (has_p & ~has_k)).flatten()
    if head_rows.numel():
        ks = top_k[head_rows]
        sk = small_k[head_rows]
        wants = [int(ks[sk].max())] if bool(sk.any()) else []
        if not bool(sk.all()):
            wants.append(TOP_P_FIRST_CANDIDATES)
        width = min(v, max(wants))
        rows = probs if head_rows.numel() == n else probs.index_select(0, head_rows)
        vals, ids = _head(rows, width)
        # Top-k by position; the renormalised mass of a top-k row is its head's, else the whole row's.
        vals = vals.masked_fill(torch.arange(width, device=device) >= torch.where(sk, ks, width).unsqueeze(1), 0.0)
        f, covered = _nucleus_in_head(vals, top_p[head_rows], torch.where(sk, -1.0, _row_mass(rows)))
        floor[head_rows] = f
        covered |= sk  # a top-k row's survivors are all in its head
        if bool(covered.all()):
            heads.append((head_rows, vals, ids))
        else:
            keep = torch.nonzero(covered).flatten()
            if keep.numel():
                heads.append((head_rows[keep], vals[keep], ids[keep]))
            wide = torch.nonzero(~covered).flatten()
            wide_rows = rows if wide.numel() == rows.shape[0] else rows.index_select(0, wide)
            floor[head_rows[wide]] = _radix_floor(wide_rows, top_p[head_rows[wide]], weighted=True)

    # Large k: count down the histogram; then top-p, if any, on what survives.
    big_rows = torch.nonzero(has_k & ~small_k).flatten()
    if big_rows.numel():
        rows = probs.index_select(0, big_rows)
        floor[big_rows] = _radix_floor(rows, top_k[big_rows].to(probs.dtype), weighted=False)
        p_rows = torch.nonzero(has_p[big_rows]).flatten()
        if p_rows.numel():
            rows = rows.index_select(0, p_rows)
            rows.masked_fill_(rows < floor[big_rows[p_rows]].unsqueeze(1), 0.0)
            vals, _ = _head(rows, min(v, TOP_P_FIRST_CANDIDATES))
            f, covered = _nucleus_in_head(vals, top_p[big_rows[p_rows]], _row_mass(rows))
            wide = torch.nonzero(~covered).flatten()
            if wide.numel():
                f[wide] = _radix_floor(rows.index_select(0, wide), top_p[big_rows[p_rows[wide]]], weighted=True)
            floor[big_rows[p_rows]] = f
    return Truncation(floor=floor, heads=heads)


def _row_mass(rows: torch.Tensor) -> torch.Tensor:
    """Each row's sum, blockwise: the same float sum whatever else is in the batch."""
    m, v = rows.shape
    b = _block_size(v)
    return rows.view(m, v // b, b).sum(-1).sum(-1)


def _nucleus_in_head(
    head: torch.Tensor, top_p: torch.Tensor, mass: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p floor of each row from its head [m, W] (descending); ``mass`` < 0 means the head's own sum.

    Returns (floor, covered): ``covered`` is False where the first TOP_P_FIRST_CANDIDATES of the
    head hold less than top_p x mass (the floor is then meaningless). The head may be wider when
    other rows asked for a larger top-k, but the test looks at a fixed width, so whether a row is
    drawn from its head never depends on its batch.
    """
    cum = head.cumsum(-1)  # sequential: a prefix's sum does not depend on the width
    total = torch.where(mass < 0, cum[:, -1], mass)
    need = top_p * total
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    n_keep = (before < need.unsqueeze(1)).sum(-1).clamp(1, head.shape[1])
    floor = head.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
    checked = cum[:, min(head.shape[1], TOP_P_FIRST_CANDIDATES) - 1]
    return floor, (checked >= need) | (top_p >= 1.0)


def _head(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row, descending, and their column ids; exact (ties included).

    Only blocks whose maximum is among the k largest block maxima can hold a top-k value, so
    ``topk`` runs over those blocks (recursively) instead of the whole row: ~2x faster for the
    top-64 of 49,152, where a plain ``topk`` costs ~20 us per row here.
    """
    m, v = rows.shape
    b = 64
    while b >= 8 and (v % b or v // b < 8 * k):
        b //= 2
    if b < 8:
        return rows.topk(k, dim=-1)
    blocks = rows.view(m, v // b, b)
    best = blocks.amax(-1).topk(k, dim=-1).indices  # [m, k] block ids
    cand = blocks[torch.arange(m, device=rows.device).unsqueeze(1), best].view(m, k * b)
    vals, pos = _head(cand, k)
    return vals, best.gather(1, pos // b) * b + pos % b


def sample_sorted(vals: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over candidate probabilities ``vals`` [g, W] (zeros never drawn); returns ``ids`` entries."""
    cum = vals.double().cumsum(-1)
    total = cum[:, -1:]
    target = torch.minimum(u.to(cum.dtype).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    j = torch.searchsorted(cum, target, right=True).clamp_max_(vals.shape[1] - 1)
    return ids.gather(1, j).squeeze(1)


_RADIX_SHIFT = 19  # keep the exponent and 4 mantissa bits of a probability: 2,048 buckets, 1/16 octave each


def _radix_floor(rows: torch.Tensor, target: torch.Tensor, weighted: bool) -> torch.Tensor:
    """Per row of ``rows`` [m, V] (values in [0, 1]), the largest value t with W(>= t) >= need.

    W counts the entries >= t (``weighted=False``, need = ``target``: the target-th largest value)
    or sums them (``weighted=True``, need = ``target`` x the row's sum: the top-p floor). Rather than
    sorting the row: a histogram over the leading bits of the float's representation (monotone for
    non-negative floats) finds the bucket where W crosses need; only that bucket's entries are sorted.

    Probabilities are finite by construction; should a row hold anything else all the same (NaN's bits
    read as a negative bucket, and ``scatter_add_`` raised), every key is clamped into the histogram
    and an empty boundary bucket gives 0 (nothing cut), so a bad row gets a bad floor, never an error.
    """
    m, v = rows.shape
    device = rows.device
    nb = (0x3F800000 >> _RADIX_SHIFT) + 1  # the bucket of 1.0 is the highest
    keys = (rows.view(torch.int32) >> _RADIX_SHIFT).clamp_(0, nb - 1)  # [m, V]
    weights = rows if weighted else torch.ones_like(rows)
    hist = torch.zeros(m, nb, dtype=rows.dtype, device=device).scatter_add_(1, keys.long(), weights)
    from_top = hist.flip(-1).cumsum(-1).flip(-1)  # [m, nb]: W of the buckets >= b
    need = target * from_top[:, 0] if weighted else target
    bucket = ((from_top >= need.unsqueeze(1)).sum(-1) - 1).clamp_min(0)  # the last bucket where W >= need
    above = torch.cat([from_top[:, 1:], torch.zeros_like(from_top[:, :1])], dim=1).gather(1, bucket.unsqueeze(1))

    # Sort the boundary bucket's entries of every row (by row, then descending value) and pad them.
    r, c = torch.nonzero(keys == bucket.to(keys.dtype).unsqueeze(1), as_tuple=True)
    vals = rows[r, c]
    order = vals.argsort(descending=True, stable=True)
    order = order[r[order].argsort(stable=True)]
    r, vals = r[order], vals[order]
    counts = torch.bincount(r, minlength=m)
    starts = counts.cumsum(0) - counts
    pos = torch.arange(r.numel(), device=device) - starts[r]
    padded = torch.zeros(m, max(1, int(counts.max())), dtype=rows.dtype, device=device)
    padded[r, pos] = vals
    step = padded if weighted else torch.zeros_like(padded).index_put_((r, pos), torch.ones_like(vals))
    cum = above + step.cumsum(-1)
    j = torch.minimum((cum < need.unsqueeze(1)).sum(-1), counts - 1).clamp_min_(0)
    return padded.gather(1, j.unsqueeze(1)).squeeze(1)


def host_to_device(
    values: Sequence[int] | Sequence[float] | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) on ``device`` without waiting for it.

    On a GPU, ``torch.tensor(values, device=...)`` copies from pageable memory and then synchronises
    the stream: the host would wait for the step's forward, which the engine overlaps with its own
    work when it schedules ahead. A copy from pinned memory is queued behind that work instead.
    """
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[j], t]`` to -inf wherever bit t % 32 of ``bitmask[j, t // 32]`` is clear.

    ``bitmask`` [len(rows), ceil(V / 32)] int32, on the logits' device (one bit per token: 6 KB a row
    for 49,152 tokens, where a boolean mask would be 48 KB to copy to a GPU).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        kernel = cpu_ops.token_bitmask_kernel()
        if kernel is not None:
            kernel(logits, rows, bitmask)
            return
    n, v = len(rows), logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: no host copy to wait for
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(n, -1)[:, :v].bool()
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


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
        idx = host_to_device(near, x.device)
        rows = x.index_select(0, idx)
        x.index_copy_(0, idx, rows.sub_(rows.amax(-1, keepdim=True)))
    return x.div_(host_to_device(temps, x.device, x.dtype).unsqueeze(1)).softmax(-1)


# (LOGIT_RANGE / r) / T stays below half of float32's range when r * T is at least this.
_SHIFT_BELOW = 2 * LOGIT_RANGE / _FLOAT32_MAX


def _bias_positions(biases: list[tuple[int, LogitBias]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions ``row * V + token`` and values of the rows' logit_bias, each in one CPU tensor."""
    ids, values = [], []
    for _, b in biases:
        t, v = b.token_ids, b.values
        if b.lowest < 0 or b.highest >= vocab:  # ids outside the vocabulary (only unvalidated options) are ignored
            keep = (t >= 0) & (t < vocab)
            t, v = t[keep], v[keep]
        ids.append(t)
        values.append(v)
    if len(biases) == 1:
        return ids[0] + biases[0][0] * vocab, values[0]
    offsets = torch.tensor([i * vocab for i, _ in biases], dtype=torch.int64)
    return torch.cat(ids) + offsets.repeat_interleave(torch.tensor([len(t) for t in ids])), torch.cat(values)


def _leaves_a_token(stops: list[int], vocab: int, bitmask_row: torch.Tensor | None) -> bool:
    """Whether a row may still take a token once ``stops`` are forbidden (the structured output's
    ``bitmask_row`` allowing, or every token without one)."""
    if bitmask_row is None:
        return len(set(stops)) < vocab
    allowed = ((bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab].bool()
    allowed[stops] = False
    return bool(allowed.any())


def _flat_token_positions(
    seqs: Sequence[SequenceView], rows: list[int], vocab_size: int, output_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices ``row * V + token`` of every token (or output token) of ``seqs[rows]``, and each one's row."""
    lists = [seqs[i].token_ids[seqs[i].num_prompt_tokens :] if output_only else seqs[i].token_ids for i in rows]
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor([len(t) for t in lists]))
    return row_of * vocab_size + ids, row_of


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
        idx = host_to_device(ok, logits.device)
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
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_idx = host_to_device(lp_rows, device) if lp_rows else None
        logprobs = logits.index_select(0, lp_idx).log_softmax(-1) if lp_idx is not None else None

        greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_TEMPERATURE]
        if len(greedy) == n_rows:
            tokens = argmax_rows(logits)
        elif not greedy:
            tokens = self._sample_rows(logits, seqs, u)
        else:
            greedy_set = set(greedy)
            rand = [i for i in range(n_rows) if i not in greedy_set]
            g_idx = host_to_device(greedy, device)
            r_idx = host_to_device(rand, device)
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
        """Apply logit_bias, min_tokens, repetition and presence/frequency penalties in place.

        ``logits`` must be contiguous [R, V]; row i belongs to ``seqs[i]``. Rows that use none of
        these are untouched, and a batch where none does costs only a scan of the parameters.
        """
        n_rows, vocab = logits.shape
        flat = logits.view(-1)
        device = logits.device
        params = [s.params for s in seqs]

        biases: list[tuple[int, LogitBias]] = []
        suppress: list[tuple[int, list[int]]] = []
        rep_rows: list[int] = []
        pf_rows: list[int] = []
        masked: list[int] = []
        for i, (s, p) in enumerate(zip(seqs, params)):
            if s.grammar is not None:
                masked.append(i)
            if p.logit_bias:
                bias = p.logit_bias_tensors
                if bias is not None:
                    biases.append((i, bias))
            if p.min_tokens > 0 and len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
                stops = [t for t in s.stop_token_ids_for_min_tokens if 0 <= t < vocab]
                if stops:
                    suppress.append((i, stops))
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                pf_rows.append(i)

        if masked:
            bitmask = torch.empty(len(masked), (vocab + 31) // 32, dtype=torch.int32)
            for j, i in enumerate(masked):
                seqs[i].grammar.fill_bitmask(bitmask, j)  # type: ignore[union-attr]
            apply_token_bitmask(logits, host_to_device(masked, device), host_to_device(bitmask, device))
        if biases:
            pos, val = _bias_positions(biases, vocab)
            flat.index_add_(0, host_to_device(pos, device), host_to_device(val, device).to(logits.dtype))
        if suppress:
            # min_tokens yields where it would forbid every token left (a structured output that must
            # end now): a row of -inf has no distribution to draw from.
            mask_row = {i: j for j, i in enumerate(masked)}
            at = [
                i * vocab + t
                for i, stops in suppress
                if _leaves_a_token(stops, vocab, bitmask[mask_row[i]] if i in mask_row else None)
                for t in stops
            ]
            if at:
                flat.index_fill_(0, host_to_device(at, device), float("-inf"))
        if rep_rows:
            # CTRL / HF definition over prompt + output: shrink towards zero by r (grow if r < 1).
            pos, row_of = _flat_token_positions(seqs, rep_rows, vocab, output_only=False)
            if pos.numel():
                pos, row_of = host_to_device(pos, device), host_to_device(row_of, device)
                info = torch.finfo(logits.dtype)
                # An r below the dtype's range (the range is (0, 10]: 5e-324 is 0 in float32) counts as
                # its smallest normal number: r = 0 would turn a masked -inf into NaN, which argmax picks.
                r = host_to_device([p.repetition_penalty for p in params], device, logits.dtype)[row_of].clamp_(min=info.tiny)
                vals = flat[pos]
                # Duplicate positions all write the same value. A tiny r would push a positive logit to
                # inf, and the softmax to NaN: stay at the largest finite value. A token a structured
                # output or min_tokens forbade (-inf) stays forbidden.
                new = torch.where(vals < 0, vals * r, vals / r).clamp_(-info.max, info.max)
                flat[pos] = torch.where(vals == float("-inf"), vals, new)
        if pf_rows:
            # OpenAI definition over output tokens: logit -= count * frequency + (count > 0) * presence.
            pos, _ = _flat_token_positions(seqs, pf_rows, vocab, output_only=True)
            if pos.numel():
                # Count each position's occurrences without ``unique``, whose output size the host
                # would have to wait for: sort, number the runs, count per run (at most n runs).
                pos = torch.sort(host_to_device(pos, device)).values
                first = torch.ones_like(pos, dtype=torch.bool)
                first[1:] = pos[1:] != pos[:-1]
                run = torch.cumsum(first, 0) - 1
                counts = torch.zeros(pos.numel(), dtype=logits.dtype, device=device).index_add_(
                    0, run, torch.ones(pos.numel(), dtype=logits.dtype, device=device)
                )
                row_of = pos // vocab
                freq = host_to_device([p.frequency_penalty for p in params], device, logits.dtype)
                pres = host_to_device([p.presence_penalty for p in params], device, logits.dtype)
                # Each position once (at the first of its run); the rest of a run adds exactly 0.
                delta = torch.where(first, counts[run] * freq[row_of] + pres[row_of], 0.0)
                flat.index_add_(0, pos, -delta)

    def _sample_rows(self, x: torch.Tensor, seqs: Sequence[SequenceView], u: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and a draw (uniforms ``u``) for rows that are not greedy;
        ``x`` is modified."""
        n, vocab = x.shape
        device = x.device
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
                host_to_device(top_k, device),
                host_to_device(top_p, device, probs.dtype),
            )
        floor = cut.floor
        if any(m > 0.0 for m in min_p):
            # The most likely token survives top-k/top-p, and ratios survive renormalisation, so
            # min-p compares with the untruncated max.
            floor = torch.maximum(floor, host_to_device(min_p, device, probs.dtype) * probs.amax(-1))

        u = host_to_device(u, device)
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


@dataclass
class LogprobTensors:
    """The logprobs asked for by some rows of a step, as tensors (see ``SampledRows``)."""

    rows: list[int]  # the step's row of each entry
    ks: list[int]  # how many alternatives each row asked for
    chosen: torch.Tensor  # [m] the chosen tokens
    chosen_logprob: torch.Tensor  # [m]
    rank: torch.Tensor  # [m] 1 = most likely
    top_logprobs: torch.Tensor  # [m, max(ks)] descending
    top_ids: torch.Tensor  # [m, max(ks)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.chosen, self.chosen_logprob, self.rank, self.top_logprobs, self.top_ids)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> LogprobTensors:
        return LogprobTensors(self.rows, self.ks, *tensors)

    def resolve(self, n_rows: int) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * n_rows
        top_ids, top_vals = self.top_ids.tolist(), self.top_logprobs.tolist()
        for j, (i, tok, lp, rank, k) in enumerate(
            zip(self.rows, self.chosen.tolist(), self.chosen_logprob.tolist(), self.rank.tolist(), self.ks)
        ):
            out[i] = TokenLogprobs(token_id=tok, logprob=lp, rank=rank, top=list(zip(top_ids[j][:k], top_vals[j][:k])))
        return out


@dataclass
class SampledRows:
    """One step's draws, still where they were computed: ``tokens`` [R] int64, plus the logprob
    tensors of the rows that asked. ``resolve`` turns them into Python values (on a GPU: a wait)."""

    tokens: torch.Tensor
    logprobs: LogprobTensors | None = None
    errors: dict[int, Exception] | None = None  # rows whose sampling raised (``Sampler.sample_rows``)

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, *(self.logprobs.tensors() if self.logprobs is not None else ())]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> SampledRows:
        """The same rows with every tensor replaced (e.g. by its host copy), in ``tensors()`` order."""
        lps = self.logprobs.with_tensors(tensors[1:]) if self.logprobs is not None else None
        return SampledRows(tensors[0], lps, self.errors)

    def resolve(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        tokens: list[int] = self.tokens.tolist()
        lps = self.logprobs.resolve(len(tokens)) if self.logprobs is not None else [None] * len(tokens)
        return tokens, lps


def logprob_tensors(logprobs: torch.Tensor, chosen: torch.Tensor, rows: list[int], ks: list[int]) -> LogprobTensors:
    """Logprob tensors for rows of ``logprobs`` [m, V] (log_softmax) given each row's chosen token."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [m, 1]
    # An int32 sum of the comparison: 3x faster than the default int64 one on CPU (10 vs 29 ms at 128 x 49,152).
    rank = (logprobs > chosen_lp).sum(-1, dtype=torch.int32) + 1
    kmax = min(max(ks), logprobs.shape[1])
    if kmax > 0:
        top_v, top_i = _head(logprobs, kmax)
    else:
        top_v = logprobs.new_empty(len(rows), 0)
        top_i = torch.empty(len(rows), 0, dtype=torch.int64, device=logprobs.device)
    return LogprobTensors(rows, ks, chosen, chosen_lp.squeeze(1), rank, top_v, top_i)
