"""``use_beam_search`` on ``POST /v1/completions`` (vLLM's extension): the request's fields as beam-search
parameters, and what beam search cannot serve refused by name (the search itself: ``scheduler.beam_search``)."""

from __future__ import annotations

from servelm.scheduler.sampling_params import InvalidParameterError, SamplingParams
from servelm.server.errors import bad_request, unsupported
from servelm.server.protocol_completions import CompletionRequest


def beam_search_params(req: CompletionRequest, params: SamplingParams, vocab_size: int) -> int:
    """Make ``params`` a beam search of width ``best_of`` (else ``n``) and return how many of the best beams
    each prompt answers with (``n``); a 400 naming the field for what it does not support."""
    n = req.n if req.n is not None else 1
    width = req.best_of if req.best_of is not None else n
    if req.stream:
        raise unsupported(
            "stream", "'stream' is not supported with 'use_beam_search': the beams are known when the search ends"
        )
    if req.structured_outputs is not None or (req.response_format is not None and req.response_format.type != "text"):
        name = "structured_outputs" if req.structured_outputs is not None else "response_format"
        raise unsupported(name, f"'{name}' is not supported with 'use_beam_search'")
    if width < n:
        raise bad_request(f"'best_of' (the beam width, {width}) must be at least 'n' ({n}).", param="best_of")
    params.n = width
    params.use_beam_search = True
    # Beams follow the model's own log-probabilities: an omitted temperature is 0, any other is refused.
    params.temperature = 0.0 if req.temperature is None else req.temperature
    params.length_penalty = 1.0 if req.length_penalty is None else req.length_penalty
    params.early_stopping = False if req.early_stopping is None else req.early_stopping
    try:
        params.validate(vocab_size=vocab_size)
    except InvalidParameterError as e:
        raise bad_request(str(e), param=e.param) from None
    return n
