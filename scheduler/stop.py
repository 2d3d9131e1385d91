"""Stop conditions: stop tokens, stop strings (with streaming hold-back), and length limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler.request import Request, RequestStatus


def check_token_stop(req: Request, token_id: int) -> RequestStatus | None:
    """After ``token_id`` was appended to ``req``: the finishing status its token ids imply, if any.

    EOS (unless ignore_eos) and ``stop_token_ids`` finish with "stop" and are not honoured before
    ``min_tokens`` (the sampler suppresses them anyway); ``max_tokens`` and the model's length finish
    with "length". Sets ``req.stop_reason`` for a stop token id (None for EOS).
    """
    n_out = req.num_output_tokens
    if n_out >= req.params.min_tokens:
        if token_id in req.stop_token_ids:
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in req.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def check_model_len(req: Request, max_model_len: int) -> RequestStatus | None:
    return RequestStatus.FINISHED_LENGTH if len(req.token_ids) >= max_model_len else None


@dataclass
class StopResult:
    """The text that may be sent now, and the stop string that ended the output (if one did)."""

    text: str
    stop: str | None = None


class StopChecker:
    """Finds stop strings in decoded text, one delta at a time, and decides what may be emitted.

    Searches only the new text plus the last ``max(len(stop)) - 1`` characters before it, so the cost
    per step does not grow with the output. The matched stop string and everything after it are not
    returned (unless ``include_stop_str_in_output``). While streaming, a tail of the text that could
    still grow into a stop string is held back; ``flush`` releases it when the output ends otherwise.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = tuple(s for s in stop if s)
        self.include_stop = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._tail = ""  # the last max_len-1 characters of all text seen
        self._unsent = ""  # text seen but not yet returned

    def feed(self, delta: str, honour_stops: bool = True) -> StopResult:
        """Add newly decoded text; return what may be sent now (and the stop string, if one matched)."""
        if not self.stops:
            return StopResult(delta)
        if not delta:
            return StopResult("")
        window = self._tail + delta
        unsent = self._unsent + delta
        if honour_stops:
            best: tuple[int, int, str] | None = None
            t = len(self._tail)
            for s in self.stops:
                # Only matches that end inside the new text: older ones were seen (or ignored) before.
                i = window.find(s, max(0, t - len(s) + 1))
                # The match that ends first (what generation would have stopped at), then the earliest.
                if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                    best = (i + len(s), i, s)
            if best is not None:
                _, i, s = best
                end = i + (len(s) if self.include_stop else 0)
                # Position of the cut inside ``unsent`` (which is a suffix of everything seen).
                cut = end - (len(window) - len(unsent))
                self._unsent = ""
                self._tail = ""
                return StopResult(unsent[: max(cut, 0)], s)
        self._tail = window[-(self.max_len - 1) :] if self.max_len > 1 else ""
        hold = self._holdback(window)
        hold = min(hold, len(unsent))
        if hold:
            self._unsent = unsent[-hold:]
            return StopResult(unsent[:-hold])
        self._unsent = ""
        return StopResult(unsent)

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self.max_len - 1), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """Release the held-back text (the output ended for another reason)."""
        out, self._unsent = self._unsent, ""
        return out
