"""A choice's text as its tokens arrive: detokenized, searched for stop strings, and what is held back
released at the end. The engine runs it per token where it emits text itself (offline use); the server
runs the same code in the API process on the token ids the engine core sends (``server.output_text``)."""

from __future__ import annotations

from servelm.scheduler.detokenizer import IncrementalDetokenizer, TextDecoder
from servelm.scheduler.sampling_params import SamplingParams
from servelm.scheduler.stop_strings import StopChecker


class ChoiceText:
    """The text of one choice (one sequence of ``params.n``), fed one token at a time."""

    def __init__(self, decoder: TextDecoder, params: SamplingParams) -> None:
        """``decoder``: a ``TextDecoder`` of the tokenizer with ``params.skip_special_tokens`` (shared)."""
        self.detokenizer = IncrementalDetokenizer(decoder.tokenizer, params.skip_special_tokens, decoder=decoder)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        self.parts: list[str] = []  # the text emitted so far (joined once at the end, offline)

    def feed(self, token: int, num_output_tokens: int, finishing: bool, by_stop_token: bool) -> tuple[str, str | None]:
        """Add ``token`` (the choice's ``num_output_tokens``-th): the text to emit now, and the stop
        string that ends the choice here (if one matched). ``finishing``: the token ends the choice for
        another reason (a stop token when ``by_stop_token``, whose own text is not emitted unless asked,
        a length, a completed structure): what was held back is released."""
        detok, checker = self.detokenizer, self.stop_checker
        if not finishing and not checker.stops:
            # The common case, short-cut: no stop string to match, nothing held back to release.
            text = detok.step((token,))
            if text:
                self.parts.append(text)
            return text, None
        honour = num_output_tokens >= self.min_tokens
        out: list[str] = []
        if not by_stop_token or self.include_stop:
            res = checker.feed(detok.step((token,)), honour)
            out.append(res.text)
            if res.stop is not None:
                return self._emit(out), res.stop
        if finishing:
            res = checker.feed(detok.flush(), honour)
            out.append(res.text)
            if res.stop is not None:
                return self._emit(out), res.stop
            out.append(checker.flush())
        return self._emit(out), None

    def _emit(self, out: list[str]) -> str:
        text = "".join(out)
        if text:
            self.parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.parts)
