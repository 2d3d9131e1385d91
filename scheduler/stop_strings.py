"""Stop strings in streamed text: the text that may be sent now, held back where a stop string may
be starting (``StopChecker``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StopResult:
    """The text that may be sent now, and the stop string that ended the output (if one did)."""

    text: str
    stop: str | None = None


def _prefix_function(s: str) -> list[int]:
    """KMP's failure table: ``pi[i]`` = length of the longest proper prefix of ``s[: i + 1]`` that is
    also a suffix of it."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        c = s[i]
        while k and s[k] != c:
            k = pi[k - 1]
        if s[k] == c:
            k += 1
        pi[i] = k
    return pi


class StopChecker:
    """Finds stop strings in decoded text, one delta at a time, and decides what may be emitted.

    Each stop string runs a Knuth-Morris-Pratt automaton over the text as it arrives: its state is
    the length of the longest suffix of all text seen that is a prefix of the stop string. So a step
    costs O(new characters x stop strings), whatever the stop strings' or the output's length (a
    search over a window plus a scan of its suffixes grew with both: with one stop string of 100k
    characters, 2.7 ms per token after 1,000 tokens of output, and rising). The match that ends first wins (on a
    tie, the longer stop string: it started earlier). The matched stop string and everything after it
    are not returned (unless ``include_stop_str_in_output``). While streaming, a tail of the text
    that could still grow into a stop string (the largest state) is held back; ``flush`` releases it
    when the output ends otherwise.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = tuple(s for s in stop if s)
        self.include_stop = include_stop_str_in_output
        self._pi = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._unsent = ""  # text seen but not yet returned

    def feed(self, delta: str, honour_stops: bool = True) -> StopResult:
        """Add newly decoded text; return what may be sent now (and the stop string, if one matched).

        With ``honour_stops`` false (before ``min_tokens``) matches ending in ``delta`` are ignored
        for good, but the text still counts towards later matches.
        """
        if not self.stops:
            return StopResult(delta)
        if not delta:
            return StopResult("")
        unsent = self._unsent + delta
        stops, pis, state = self.stops, self._pi, self._state
        for j, c in enumerate(delta):
            hit = -1
            for x, s in enumerate(stops):
                q = state[x]
                pi = pis[x]
                while q and s[q] != c:
                    q = pi[q - 1]
                if s[q] == c:
                    q += 1
                if q == len(s):
                    if hit < 0 or q > len(stops[hit]):
                        hit = x
                    q = pi[q - 1]
                state[x] = q
            if hit >= 0 and honour_stops:
                s = stops[hit]
                end = len(unsent) - len(delta) + j + 1  # just past the match, in ``unsent``
                cut = end if self.include_stop else end - len(s)
                self._unsent = ""
                self._state = [0] * len(stops)
                return StopResult(unsent[: max(cut, 0)], s)
        hold = min(max(state), len(unsent))
        if hold:
            self._unsent = unsent[-hold:]
            return StopResult(unsent[:-hold])
        self._unsent = ""
        return StopResult(unsent)

    def flush(self) -> str:
        """Release the held-back text (the output ended for another reason)."""
        out, self._unsent = self._unsent, ""
        return out
