"""transformers' beam search as the reference for ours: ``generate(num_beams=W, num_return_sequences=W,
do_sample=False, ...)``, its sequences cut after their first stop token and its ``sequences_scores``; width 1
is transformers' greedy search, scored the same way from its logits (sum of log-probabilities / length ** penalty)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class BeamReference:
    tokens: list[list[int]]  # the W returned sequences' generated tokens, best first
    scores: list[float]  # their sequences_scores
    steps: int  # search steps run (tokens computed per beam): where the early-stopping rule ended the search


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def hf_beam_search(
    model: Any,
    prompt: list[int],
    width: int,
    max_new_tokens: int,
    stops: list[int],
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> BeamReference:
    """``model`` (float32, eval) searched from ``prompt``; ``stops``: every token that ends a beam (EOS and stop ids)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            num_beams=width,
            num_return_sequences=width,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=list(stops),
            pad_token_id=stops[0],
            output_scores=True,
            return_dict_in_generate=True,
            temperature=None,
            top_p=None,
            top_k=None,
            repetition_penalty=None,
        )
    n = len(prompt)
    seqs = [_cut(s[n:].tolist(), set(stops)) for s in out.sequences]
    if width > 1:
        return BeamReference(seqs, out.sequences_scores.tolist(), len(out.scores))
    # Greedy: its logits, as log-probabilities of the chosen tokens.
    lps = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores])
    total = float(sum(lps[i, t] for i, t in enumerate(seqs[0])))
    return BeamReference(seqs, [total / len(seqs[0]) ** length_penalty], len(out.scores))


def run_beam_search(engine: Any, request_id: str, prompt: list[int], params: Any) -> tuple[list[Any], int]:
    """A search through the engine's step loop: its choices (``CompletionOutput``s, best first) and the search
    steps it ran (its beams' last length)."""
    engine.add_request(request_id, prompt, params)
    group = engine.choice_group(request_id)
    while not group.finished:
        engine.step()
    return group.results, max(b.num_output_tokens for b in group.choices) + 1


def assert_beams_equal(
    choices: list[Any], ref: BeamReference, length_penalty: float, label: str, rel: float = 1e-5
) -> None:
    """Our choices against transformers': same tokens in the same order, and cumulative log-probability /
    length ** penalty equal to transformers' sequences_scores."""
    ours = [c.new_token_ids for c in choices]
    assert ours == ref.tokens, f"{label}: beams differ\nours {ours}\nhf   {ref.tokens}"
    for c, score in zip(choices, ref.scores):
        mine = c.cumulative_logprob / len(c.new_token_ids) ** length_penalty
        assert abs(mine - score) <= rel * abs(score) + 1e-5, f"{label}: score {mine} vs transformers' {score}"
