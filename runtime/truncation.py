"""Truncation and draws over probability rows: top-k / top-p as per-row floors, greedy argmax, and
inverse-CDF sampling over the vocabulary or over a ranked head.

Every per-row quantity is computed row by row (exact top-k values, blockwise and sequential sums,
which path a row takes), so a row's result does not depend on which other rows share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from servelm.runtime.platform import platform_of

# Truncation never sorts a whole row (torch's CPU sort of 49,152 floats: ~1.7 ms per row here).
# Top-k with k up to DIRECT_TOP_K ranks a head of k tokens (``_head``), and top-p first looks for
# its nucleus among the TOP_P_FIRST_CANDIDATES most likely tokens: enough for most steps of a chat
# model at temperature <= 1 (measured on SmolLM2 at T=1, top_p=0.95: 63% of steps). Larger k and
# wider nuclei go through a histogram of the probabilities' leading bits (``_radix_floor``).
DIRECT_TOP_K = 256
TOP_P_FIRST_CANDIDATES = 64

_BLOCK = 256  # vocabulary block for the two-level argmax and inverse CDF
# Up to this many logits numpy's argmax (vectorised, one thread) is ahead of the two-level torch one,
# whose amax forks the OpenMP pool for a decode step's one row; past it the threads win (docs/gguf.md).
_NUMPY_ARGMAX_MAX = 1 << 21
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


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
    if not platform_of(x.device).scalar_argmax:
        return x.argmax(-1)  # (on a GPU argmax is one fast kernel)
    if x.dtype in _NUMPY_FLOATS and x.numel() <= _NUMPY_ARGMAX_MAX:
        # numpy's argmax also takes the first maximum, and the first NaN, as torch's does
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    b = _block_size(v)
    if b < 16 or v <= _BLOCK:
        return x.argmax(-1)
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


def _nucleus_in_head(head: torch.Tensor, top_p: torch.Tensor, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    m, _v = rows.shape
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
