"""Stop conditions as each token is accepted: stop tokens, length limits, and stop strings (``choice_text``)."""

from __future__ import annotations

from servelm.runtime.batch import TokenLogprobs
from servelm.scheduler.request import Request, RequestStatus


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


def accept_token(
    req: Request, token: int, lps: TokenLogprobs | None, max_model_len: int
) -> tuple[str, RequestStatus | None]:
    """Append a sampled token to ``req``, check every stop condition (stop tokens, a structured output's
    structure completed, length) and, where the engine emits text (``req.text``), detokenize it and look
    for stop strings: the text to emit now and, when ``req`` must finish, how (the caller finishes it)."""
    req.append_token(token, lps)
    status = check_token_stop(req, token) or check_model_len(req, max_model_len)
    stopped_by_token = status == RequestStatus.FINISHED_STOPPED
    if req.grammar is not None and req.grammar.accept(token) and status is None:
        # The structure is complete: only EOS could follow. Its last token's text is kept.
        status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
    if req.text is None:  # token ids only: the API process makes the text (server.output_text)
        return "", status
    text, stop = req.text.feed(token, req.num_output_tokens, status is not None, stopped_by_token)
    if stop is not None:
        status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
    return text, status
