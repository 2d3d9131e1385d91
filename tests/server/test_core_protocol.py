"""The messages between the API process and the engine core: outputs survive msgpack as they were,
requests cross with their grammar's spec but not its compiled (native) object, and the engine's own
errors cross as themselves."""

from __future__ import annotations

import pickle

import pytest

from servelm.runtime.batch import TokenLogprobs
from servelm.scheduler.outputs import CompletionOutput, RequestOutput
from servelm.scheduler.sampling_params import InvalidParameterError, LoRANotFoundError, SamplingParams
from servelm.scheduler.structured_output import StructuredOutput
from servelm.server import core_protocol as p


def test_outputs_round_trip() -> None:
    lp = TokenLogprobs(5, -0.25, 1, [(5, -0.25), (7, -1.5)])
    outs = [
        RequestOutput(
            "a",
            [1, 2, 3],
            [CompletionOutput(0, [5], " x", [lp], 3, None), CompletionOutput(1, [], "", None, 2, "stop", "END", -1.5)],
            prompt_logprobs=[None, lp, lp],
            num_cached_tokens=16,
        ),
        RequestOutput("b", [4], [CompletionOutput(0, [9, 10], "yz", None, 2, "length")], finished=True),
        RequestOutput("e", [4, 5], [], finished=True, embedding=[0.5, -0.25, 1e-3]),
        RequestOutput("f", [6], [CompletionOutput(0, [], "", None, 0, "error")], finished=True, error="boom"),
    ]
    prompts = {o.request_id: o.prompt_token_ids for o in outs}
    snapshot, back = p.decode_outputs(p.encode_outputs((3, 1, 42), outs), prompts.__getitem__)
    assert snapshot == (3, 1, 42)
    assert back == outs


def test_params_cross_without_the_compiled_grammar() -> None:
    so = StructuredOutput("json", '{"type": "object"}')
    so.compiled = object()  # stands for llguidance's native matcher, which does not pickle
    params = SamplingParams(max_tokens=4, stop=["\n"], logit_bias={3: 1.0}, structured_output=so)
    sent = pickle.loads(p.dumps(p.sendable_params(params)))
    assert sent.structured_output is not None and sent.structured_output.compiled is None
    assert sent.structured_output.key == so.key
    assert (sent.max_tokens, sent.stop, sent.logit_bias) == (4, ["\n"], {3: 1.0})
    assert params.structured_output.compiled is not None  # the caller's copy is left as it was


@pytest.mark.parametrize(
    "exc", [InvalidParameterError("n", "n must be at least 1"), LoRANotFoundError("ghost"), ValueError("bad")]
)
def test_engine_errors_cross_as_themselves(exc: Exception) -> None:
    back = p.received_error(p.loads(p.dumps(p.sendable_error(exc))))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert vars(back) == vars(exc)


def test_an_error_that_does_not_pickle_crosses_as_its_text() -> None:
    class Local(Exception):  # a class pickle cannot find by name
        pass

    back = p.received_error(p.loads(p.dumps(p.sendable_error(Local("why")))))
    assert isinstance(back, RuntimeError) and "Local: why" in str(back)
