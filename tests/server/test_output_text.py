"""The API process makes the text (server.output_text) from an engine that sends token ids only: what a
client gets must equal what the engine produces when it detokenizes and stops on strings itself, token
for token, including the tokens the engine samples after a stop string before it hears of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.engine import Engine
from servelm.scheduler.outputs import RequestOutput
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.output_text import RequestText, TextDecoders

MiB = 2**20


def engine(model: Path, detokenize: bool, eos: int | None = None, **cfg: Any) -> Engine:
    config = EngineConfig(model=str(model), kv_cache_memory=4 * MiB, max_model_len=256, **cfg)
    e = Engine(config, detokenize=detokenize)
    if eos is not None:  # a token the tiny random model does emit, made an end-of-sequence token
        e.eos_token_ids = (*e.eos_token_ids, eos)
    return e


def in_engine(e: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    """Each choice's (token ids, text, finish reason, stop reason, logprob ids) as the engine itself makes them."""
    res = e.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    return [
        [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, [lp.token_id for lp in c.logprobs or []])
            for c in r.outputs
        ]
        for r in res
    ]


def at_the_edge(e: Engine, reqs: list[tuple[list[int], SamplingParams]], lag: int, chunk: int) -> list[Any]:
    """The same from an engine that sends token ids: text made by ``RequestText``; a choice a stop string
    ends is stopped in the engine ``lag`` steps later (the engine core hears of it late); ``chunk`` steps'
    news of a request arrive as one output (as a step with accepted drafts brings several tokens)."""
    decoders = TextDecoders(e.tokenizer)
    texts, got, finished = {}, {}, set()
    for i, (prompt, params) in enumerate(reqs):
        rid = f"r{i}"
        e.add_request(rid, prompt, params)
        texts[rid] = RequestText(decoders, params, e.eos_token_ids)
        got[rid] = {k: [[], "", None, None, [], 0] for k in range(params.n)}
    to_stop: list[tuple[int, str, int, str]] = []  # (due step, request id, choice, stop string)
    step = 0
    held: dict[str, RequestOutput] = {}
    while e.has_unfinished_requests():
        step += 1
        for news in e.step():
            if news.request_id in held:
                news = merged(held.pop(news.request_id), news)
            held[news.request_id] = news
        if step % chunk and e.has_unfinished_requests():
            continue
        outs, held = list(held.values()), {}
        for out in outs:
            text = texts[out.request_id]
            if text.finished:
                continue
            for index, stop in text.apply(out):
                to_stop.append((step + lag, out.request_id, index, stop))
            for c in out.outputs:
                g = got[out.request_id][c.index]
                assert g[2] is None, "news of a choice after it finished"
                g[0] += c.new_token_ids
                g[1] += c.new_text
                g[2], g[3] = c.finish_reason, c.stop_reason
                g[4] += [lp.token_id for lp in c.new_logprobs or []]
                g[5] = c.num_output_tokens
            if out.finished:
                finished.add(out.request_id)
        for _, rid, index, stop in [s for s in to_stop if s[0] <= step]:
            e.stop_choice(rid, index, stop)
        to_stop = [s for s in to_stop if s[0] > step]
    assert finished == set(texts)
    assert e.block_manager.num_used_blocks == 0
    result = []
    for rid in texts:
        choices = []
        for ids, text, finish, stop, lps, num in got[rid].values():
            assert num == len(ids)
            choices.append((ids, text, finish, stop, lps))
        result.append(choices)
    return result


def merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two outputs of a request as one (each choice's news appended)."""
    choices = {c.index: c for c in a.outputs}
    for c in b.outputs:
        prev = choices.get(c.index)
        if prev is not None:
            c.new_token_ids = prev.new_token_ids + c.new_token_ids
            c.new_text = prev.new_text + c.new_text
            if prev.new_logprobs is not None:
                c.new_logprobs = prev.new_logprobs + (c.new_logprobs or [])
        choices[c.index] = c
    b.outputs = [choices[i] for i in sorted(choices)]
    return b


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path) -> tuple[int, list[tuple[list[int], SamplingParams]]]:
    """Every way a choice ends: length, a stop token, EOS, stop strings (one a single character, one
    spanning tokens, one held back at the end), min_tokens before a stop string, stop strings kept in
    the output, special tokens kept, n=2 with a stop string hit by one choice only, logprobs."""
    e = engine(tiny_llama_dir, True)
    tok = e.tokenizer
    texts = ["1 2 3 4 5 6 7 8 9 10 " * 3, "Hello, my name is", "The capital of France", "def fib(n):\n    "]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    g = dict(temperature=0.0, ignore_eos=True)
    free = e.generate(prompts, SamplingParams(max_tokens=24, **g))
    out = [r.outputs[0] for r in free]
    mid = [o.text[len(o.text) // 3 : len(o.text) // 3 + 4] for o in out]  # spans tokens, mid-output
    last = [o.text[-3:] for o in out]  # met at the very end (held back until then)
    char = [o.text[len(o.text) // 2] for o in out]
    stop_token = out[1].token_ids[5]
    eos = out[3].token_ids[7]
    return eos, [
        (prompts[0], SamplingParams(max_tokens=24, **g)),
        (prompts[1], SamplingParams(max_tokens=24, stop_token_ids=[stop_token], **g)),
        (prompts[2], SamplingParams(max_tokens=24, stop=[mid[2], "never there"], logprobs=2, **g)),
        (prompts[3], SamplingParams(max_tokens=24, stop=[char[3]], **g)),
        (prompts[0], SamplingParams(max_tokens=24, stop=[last[0]], **g)),
        (prompts[1], SamplingParams(max_tokens=24, stop=[mid[1]], include_stop_str_in_output=True, **g)),
        (prompts[2], SamplingParams(max_tokens=24, stop=[char[2]], min_tokens=20, **g)),
        (prompts[3], SamplingParams(max_tokens=24, stop=[mid[3]], skip_special_tokens=False, **g)),
        (prompts[2], SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=3, stop=[" the", "e"])),
        (prompts[3], SamplingParams(max_tokens=24, temperature=0.0, stop=[mid[3][1:]])),  # EOS, or the stop string
        (
            prompts[3],
            SamplingParams(max_tokens=24, temperature=0.0, include_stop_str_in_output=True),
        ),  # EOS's text kept
    ]


@pytest.mark.parametrize("lag,chunk", [(0, 1), (2, 1), (1, 3)])
@pytest.mark.parametrize(
    "cfg",
    [{}, {"async_scheduling": True}, {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'}],
    ids=["sync", "async-scheduling", "ngram-speculation"],
)
def test_text_made_at_the_edge_equals_the_engines_own(
    tiny_llama_dir: Path, workload: tuple[int, list[Any]], cfg: dict[str, Any], lag: int, chunk: int
) -> None:
    eos, reqs = workload
    expected = in_engine(engine(tiny_llama_dir, True, eos, **cfg), reqs)
    reasons = {(c[2], type(c[3]).__name__) for r in expected for c in r}
    assert {("stop", "str"), ("stop", "int"), ("stop", "NoneType"), ("length", "NoneType")} <= reasons
    assert at_the_edge(engine(tiny_llama_dir, False, eos, **cfg), reqs, lag, chunk) == expected


def test_an_engine_without_text_sends_token_ids_only(tiny_llama_dir: Path) -> None:
    e = engine(tiny_llama_dir, False)
    outs = e.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=["a"]))
    assert outs[0].outputs[0].text == "" and len(outs[0].outputs[0].token_ids) == 8
