"""The text of a request's outputs, made in the API process: the engine core sends token ids only; here
they are detokenized and searched for stop strings (``scheduler.choice_text``, the code an offline
engine runs itself), so the core's loop spends nothing on text.

A stop string is found here after the core has sampled its token, and the core may have sampled a few
more by the time it hears: those are dropped (the choice's tokens, logprobs and count end at the stop),
the core is told to finish the choice as stopped (``Engine.stop_choice``), and whatever it still sends
for that choice is ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from servelm.scheduler.choice_text import ChoiceText
from servelm.scheduler.detokenizer import TextDecoder
from servelm.scheduler.outputs import CompletionOutput, RequestOutput
from servelm.scheduler.sampling_params import SamplingParams

_ENDS_WITH_TEXT = ("stop", "length")  # an abort or an error releases nothing held back (as in the engine)


class TextDecoders:
    """A tokenizer's ``TextDecoder`` for each ``skip_special_tokens`` setting, shared by every request."""

    def __init__(self, tokenizer: object) -> None:
        self._decoders = {skip: TextDecoder(tokenizer, skip) for skip in (True, False)}

    def __getitem__(self, skip_special_tokens: bool) -> TextDecoder:
        return self._decoders[skip_special_tokens]


class RequestText:
    """The text of one engine request's choices, from the token ids its outputs carry."""

    def __init__(self, decoders: TextDecoders, params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self._decoder = decoders[params.skip_special_tokens]
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._choices: dict[int, ChoiceText] = {}
        self._ended: set[int] = set()  # choices finished, by the core or by a stop string here
        self._stopped_here: set[int] = set()
        self.finished = False  # every choice ended: later news of this request is stale

    def apply(self, out: RequestOutput) -> list[tuple[int, str]]:
        """Fill in ``out``'s text (in place), dropping news of choices already stopped here; returns the
        choices a stop string ends in it, with the stop string (the core is to stop them)."""
        stopped: list[tuple[int, str]] = []
        kept: list[CompletionOutput] = []
        for c in out.outputs:
            if c.index in self._stopped_here:
                continue
            stop = self._fill(c)
            if stop is not None:
                self._stopped_here.add(c.index)
                stopped.append((c.index, stop))
            if c.finish_reason is not None:
                self._ended.add(c.index)
            kept.append(c)
        out.outputs = kept
        if len(self._ended) == self.params.n:
            out.finished = True  # (the core's own finish follows for choices stopped here: stale)
        self.finished = out.finished
        return stopped

    def _fill(self, c: CompletionOutput) -> str | None:
        state = self._choices.get(c.index)
        if state is None:
            state = self._choices[c.index] = ChoiceText(self._decoder, self.params)
        ids = c.new_token_ids
        last = len(ids) - 1
        first = c.num_output_tokens - len(ids)  # output tokens before this news
        ends = c.finish_reason in _ENDS_WITH_TEXT
        texts: list[str] = []
        for j, token in enumerate(ids):
            finishing = j == last and ends
            by_stop_token = finishing and c.finish_reason == "stop" and self._is_stop_token(token, c.stop_reason)
            text, stop = state.feed(token, first + j + 1, finishing, by_stop_token)
            texts.append(text)
            if stop is not None:  # the choice ends at this token: what the core sampled after it is dropped
                del ids[j + 1 :]
                if c.new_logprobs is not None:
                    del c.new_logprobs[j + 1 :]
                c.num_output_tokens = first + j + 1
                c.finish_reason, c.stop_reason = "stop", stop
                c.new_text = "".join(texts)
                return stop
        c.new_text = "".join(texts)
        return None

    def _is_stop_token(self, token: int, stop_reason: str | int | None) -> bool:
        """Whether the core stopped the choice on ``token`` as a stop token (EOS or a ``stop_token_ids``
        entry: its text is not the output's) rather than on a completed structure (whose text is)."""
        return isinstance(stop_reason, int) or token in self._eos
