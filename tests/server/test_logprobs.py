"""Token strings and bytes for logprobs (the default model's byte-level BPE)."""

from __future__ import annotations

from typing import Any

from servelm.runtime.batch import TokenLogprobs
from servelm.server.logprobs import TokenStrings, chat_logprobs_content, completion_logprobs

TEXT = " héllo 🙂 世界\n\tdef f(x):  return x"


def test_bytes_are_exact_even_inside_a_character(server_tokenizer: Any) -> None:
    strings = TokenStrings(server_tokenizer)
    ids = server_tokenizer.encode(TEXT)
    parts = [strings.get(t) for t in ids]
    assert b"".join(bytes(b) for _, b in parts) == TEXT.encode()
    # Tokens that split a multi-byte character read as U+FFFD, like the tokenizer's own decode.
    for t, (text, raw) in zip(ids, parts):
        assert text == server_tokenizer.decode([t])
        assert text == bytes(raw).decode("utf-8", errors="replace")
    assert any(text == "\ufffd" for text, _ in parts)


def test_special_tokens_keep_their_name(server_tokenizer: Any) -> None:
    strings = TokenStrings(server_tokenizer)
    eos = server_tokenizer.eos_token_id
    assert strings.get(eos) == (server_tokenizer.eos_token, list(server_tokenizer.eos_token.encode()))


def test_completion_and_chat_shapes(server_tokenizer: Any) -> None:
    strings = TokenStrings(server_tokenizer)
    a, b = server_tokenizer.encode(" Paris is")
    entries = [TokenLogprobs(a, -0.1, 1, [(a, -0.1), (b, -2.0)]), TokenLogprobs(b, -0.5, 2, [(a, -0.3), (b, -0.5)])]
    obj, end = completion_logprobs(strings, entries, text_offset=10)
    assert obj == {
        "tokens": [" Paris", " is"],
        "token_logprobs": [-0.1, -0.5],
        "top_logprobs": [{" Paris": -0.1, " is": -2.0}, {" Paris": -0.3, " is": -0.5}],
        "text_offset": [10, 16],
    }
    assert end == 19
    chat = chat_logprobs_content(strings, entries[:1])
    assert chat == [
        {
            "token": " Paris",
            "logprob": -0.1,
            "bytes": list(b" Paris"),
            "top_logprobs": [
                {"token": " Paris", "logprob": -0.1, "bytes": list(b" Paris")},
                {"token": " is", "logprob": -2.0, "bytes": list(b" is")},
            ],
        }
    ]


def test_logprobs_without_a_finite_value_are_still_json(server_tokenizer: Any) -> None:
    """-inf (a token that cannot be drawn) and NaN have no JSON form: they go out as -9999.0."""
    import json

    strings = TokenStrings(server_tokenizer)
    a, b = server_tokenizer.encode(" Paris is")
    entries = [TokenLogprobs(a, float("nan"), 1, [(a, float("nan")), (b, float("-inf"))])]
    obj, _ = completion_logprobs(strings, entries, text_offset=0)
    assert obj["token_logprobs"] == [-9999.0] and obj["top_logprobs"] == [{" Paris": -9999.0, " is": -9999.0}]
    chat = chat_logprobs_content(strings, entries)
    assert [chat[0]["logprob"]] + [t["logprob"] for t in chat[0]["top_logprobs"]] == [-9999.0, -9999.0, -9999.0]
    json.dumps([obj, chat], allow_nan=False)  # what the server's encoder demands
