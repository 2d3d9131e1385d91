"""Benchmark workloads: random prompts of exact token length, shared prefixes, JSONL files."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from servelm.bench.datasets import count_tokens, jsonl_requests, load_tokenizer, random_requests


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return load_tokenizer(default_model_dir)


def test_random_prompts_have_exact_token_lengths(tokenizer) -> None:
    reqs = random_requests(tokenizer, 40, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    # The lengths the generator was asked for, drawn independently with the same seed.
    rng = random.Random(3)
    want_in = [rng.randint(50, 150) for _ in range(40)]
    want_out = [rng.randint(10, 30) for _ in range(40)]
    assert [count_tokens(tokenizer, r.prompt) for r in reqs] == want_in
    assert [r.prompt_len for r in reqs] == want_in
    assert [r.max_tokens for r in reqs] == want_out
    assert len(set(want_in)) > 10  # the range ratio really spreads them


def test_fixed_lengths_and_determinism(tokenizer) -> None:
    a = random_requests(tokenizer, 8, input_len=64, output_len=16, seed=1)
    b = random_requests(tokenizer, 8, input_len=64, output_len=16, seed=1)
    c = random_requests(tokenizer, 8, input_len=64, output_len=16, seed=2)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert all(count_tokens(tokenizer, r.prompt) == 64 and r.max_tokens == 16 for r in a)
    assert len({r.prompt for r in a}) == 8
    # No special token (e.g. <|im_end|>) sneaks into a random prompt.
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    assert not any(set(tokenizer.encode(r.prompt, add_special_tokens=False)) & special for r in a)


def test_shared_prefix(tokenizer) -> None:
    reqs = random_requests(tokenizer, 10, input_len=32, output_len=8, prefix_len=48, seed=5)
    assert all(count_tokens(tokenizer, r.prompt) == 80 for r in reqs)
    prefix = os.path.commonprefix([r.prompt for r in reqs])  # noqa: RUF071 - a text's prefix, not a path's
    # Every prompt starts with the same text worth (nearly) the whole prefix.
    assert count_tokens(tokenizer, prefix) >= 46


def test_token_id_and_chat_prompts(tokenizer) -> None:
    ids = random_requests(tokenizer, 4, input_len=20, output_len=4, prefix_len=10, token_ids=True, seed=0)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 30 for r in ids)
    assert all(r.prompt[:10] == ids[0].prompt[:10] for r in ids)
    chat = random_requests(tokenizer, 3, input_len=20, output_len=4, endpoint="chat", seed=0)
    assert all(r.prompt is None and r.messages[0]["role"] == "user" for r in chat)
    assert all(count_tokens(tokenizer, r.messages[0]["content"]) == 20 for r in chat)
    with pytest.raises(ValueError):
        random_requests(tokenizer, 1, 10, 1, endpoint="chat", token_ids=True)
    with pytest.raises(ValueError):
        random_requests(tokenizer, 1, 10, 1, range_ratio=1.0)


def test_jsonl_dataset(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "w.jsonl"
    rows = [
        {"prompt": "Hello there", "max_tokens": 5},
        {"prompt": [1, 2, 3]},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    reqs = jsonl_requests(path, 5, default_max_tokens=11, tokenizer=tokenizer)
    assert [r.prompt for r in reqs] == ["Hello there", [1, 2, 3]] * 2 + ["Hello there"]  # cycles
    assert [r.max_tokens for r in reqs] == [5, 11, 5, 11, 5]
    assert reqs[0].prompt_len == count_tokens(tokenizer, "Hello there") and reqs[1].prompt_len == 3

    path.write_text("\n".join(json.dumps(r) for r in (rows[0], rows[2])))
    chat = jsonl_requests(path, None, 11, endpoint="chat")
    assert chat[0].messages == [{"role": "user", "content": "Hello there"}]
    assert chat[1].messages == rows[2]["messages"] and chat[1].max_tokens == 7
    with pytest.raises(ValueError, match="--endpoint chat"):
        jsonl_requests(path, None, 11, endpoint="completions")
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="'prompt' or 'messages'"):
        jsonl_requests(path, None, 11)
