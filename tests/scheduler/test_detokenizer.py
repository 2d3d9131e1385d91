"""Incremental detokenization and stop strings, with the default model's byte-level BPE tokenizer
and a SentencePiece-style (Metaspace "▁" + byte fallback) tokenizer built offline."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelm.runtime.model_files import default_model_dir
from servelm.scheduler.detokenizer import IncrementalDetokenizer
from servelm.scheduler.stop_strings import StopChecker

SAMPLES = [
    "Hello, world! 😀🎉 emoji 👩‍👩‍👧 family",
    "中文字符和日本語のテキスト、한국어",
    "Café, naïve résumé, Ångström, façade, São Paulo",
    "def f(x):\n    return x + 1\n\n\tif x:\n        pass  # trailing  ",
    "   leading spaces and\n\n\nnewlines",
    "mixed 🇫🇷 flags and math ∑∫√ and arrows →←",
]

TEXT = st.lists(
    st.sampled_from(list("abc XYZ\n\t.,!éèüß中文字😀🎉👍🏽∑→\u200d▁") + ["    ", "def ", "\n    ", "  "]),
    max_size=30,
).map("".join)


@pytest.fixture(scope="module")
def bpe_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("default model not prepared (make model)")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A Llama-2-like tokenizer: "▁" for spaces, a prepended "▁" stripped on decode, byte fallback."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world! def foo(x):\n    return x + 1",
        "Café au lait, naïve résumé.",
        "日本語のテキスト 中文",
        "Paris is the capital of France.",
    ] * 10
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    base = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = base + b
    d["model"]["byte_fallback"] = True
    d["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(d)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def stream(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    d = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas = [d.step([t]) for t in ids]
    deltas.append(d.flush())
    return deltas


def assert_stream_matches(tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    deltas = stream(tokenizer, ids, skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    return deltas


@pytest.mark.parametrize("which", ["bpe_tokenizer", "sp_tokenizer"])
@pytest.mark.parametrize("text", SAMPLES)
def test_samples_round_trip(request, which: str, text: str) -> None:
    tok = request.getfixturevalue(which)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = assert_stream_matches(tok, ids)
    # Incomplete characters are held back, never streamed as U+FFFD.
    assert not any("\ufffd" in d for d in deltas[:-1])


@pytest.mark.parametrize("which", ["bpe_tokenizer", "sp_tokenizer"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_property_concatenated_deltas_equal_decode(request, which: str, text: str) -> None:
    tok = request.getfixturevalue(which)
    ids = tok.encode(text, add_special_tokens=False)
    assert_stream_matches(tok, ids)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.one_of(TEXT, st.sampled_from(["<|im_end|>", "<|im_start|>", "<|endoftext|>"])), max_size=6))
def test_special_tokens_skipped_or_kept(bpe_tokenizer, pieces: list[str]) -> None:
    ids: list[int] = []
    for p in pieces:
        ids += bpe_tokenizer.encode(p, add_special_tokens=False)
    for skip in (True, False):
        assert_stream_matches(bpe_tokenizer, ids, skip)


def test_special_tokens_visible_when_not_skipped(bpe_tokenizer) -> None:
    ids = bpe_tokenizer.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(bpe_tokenizer, ids, skip_special_tokens=False)) == "Hi<|im_end|>"
    assert "".join(stream(bpe_tokenizer, ids, skip_special_tokens=True)) == "Hi"


def test_emoji_is_held_until_complete(bpe_tokenizer) -> None:
    ids = bpe_tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # "a" + the emoji split over several byte tokens
    d = IncrementalDetokenizer(bpe_tokenizer)
    deltas = [d.step([t]) for t in ids]
    assert deltas[0] == "a" and all(x == "" for x in deltas[1:-1]) and deltas[-1] == "😀"


def test_flush_emits_a_dangling_partial_character(bpe_tokenizer) -> None:
    ids = bpe_tokenizer.encode("x😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas = stream(bpe_tokenizer, ids)
    assert "".join(deltas) == bpe_tokenizer.decode(ids) and deltas[-1].endswith("\ufffd")


def test_sentencepiece_spaces_between_tokens(sp_tokenizer) -> None:
    ids = sp_tokenizer.encode("The capital is Paris", add_special_tokens=False)
    deltas = assert_stream_matches(sp_tokenizer, ids)
    assert "".join(deltas) == "The capital is Paris"
    assert any(d.startswith(" ") for d in deltas)  # later words keep their space


def test_steps_touch_a_bounded_window(bpe_tokenizer) -> None:
    ids = bpe_tokenizer.encode("word " * 300, add_special_tokens=False)
    d = IncrementalDetokenizer(bpe_tokenizer)
    for t in ids:
        d.step([t])
        assert d.read_offset - d.prefix_offset <= 2  # never re-decodes the whole output


# -- stop strings ---------------------------------------------------------------------------------------


def feed_all(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    sent: list[str] = []
    for d in deltas:
        r = checker.feed(d)
        sent.append(r.text)
        if r.stop is not None:
            return sent, r.stop
    sent.append(checker.flush())
    return sent, None


def test_stop_string_split_across_deltas_is_not_returned() -> None:
    sent, stop = feed_all(StopChecker(["STOP"]), ["Hello S", "TO", "P and more"])
    assert stop == "STOP" and "".join(sent) == "Hello "
    # While the tail could still become the stop string it is held back.
    assert sent == ["Hello ", "", ""]


def test_false_alarm_is_released() -> None:
    sent, stop = feed_all(StopChecker(["STOP"]), ["Hello S", "T", "ick"])
    assert stop is None and "".join(sent) == "Hello STick"
    assert sent[:2] == ["Hello ", ""]


def test_earliest_stop_string_wins_and_include_option() -> None:
    sent, stop = feed_all(StopChecker(["world", "lo w"]), ["hello world"])
    assert stop == "lo w" and "".join(sent) == "hel"
    sent, stop = feed_all(StopChecker(["o world", "lo"]), ["hello world"])
    assert stop == "lo" and "".join(sent) == "hel"  # ends first
    sent, stop = feed_all(StopChecker(["\n\n"], include_stop_str_in_output=True), ["a\n", "\nb"])
    assert stop == "\n\n" and "".join(sent) == "a\n\n"


def test_stop_not_honoured_before_min_tokens_is_not_rematched() -> None:
    c = StopChecker(["ab"])
    r = c.feed("xab", honour_stops=False)
    assert r.stop is None and r.text == "xab"
    r = c.feed("c")
    assert r.stop is None and r.text == "c"
    assert c.feed("a").text == "" and c.feed("b").stop == "ab"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abAB \n", max_size=40),
    stops=st.lists(st.text(alphabet="abAB \n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_property_stop_strings_match_a_whole_text_search(text: str, stops: list[str], cuts: list[int]) -> None:
    # However the text is split into deltas, the result equals the earliest match in the whole text.
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    sent, stop = feed_all(StopChecker(stops), deltas)
    hits = sorted((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
    if hits:
        _, start, first = hits[0]  # the match that ends first, then the one starting first
        assert stop == first and "".join(sent) == text[:start]
    else:
        assert stop is None and "".join(sent) == text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="aab \n", max_size=40),
    stops=st.lists(st.text(alphabet="aab \n", min_size=1, max_size=6), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_property_each_delta_sends_all_but_a_possible_stop_prefix(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    """After every delta, everything is sent except the longest tail of the text that could still
    grow into a stop string; a match ends the output at its end, with or without the stop string."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    checker = StopChecker(stops, include_stop_str_in_output=include)
    seen = ""
    sent = ""
    for a, b in itertools.pairwise(bounds):
        r = checker.feed(text[a:b])
        sent += r.text
        if r.stop is not None:
            ends = [(seen + text[a:b]).find(s) + len(s) for s in stops if s in seen + text[a:b]]
            end = min(ends)  # the first match's end
            assert len(r.stop) == max(len(s) for s in stops if (seen + text[a:b])[:end].endswith(s))
            assert sent == (seen + text[a:b])[: end if include else end - len(r.stop)]
            return
        seen += text[a:b]
        held = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
        assert sent == seen[: len(seen) - held]
    assert sent + checker.flush() == text


def test_a_long_stop_string_is_matched_across_many_deltas() -> None:
    stop = "a" * 3000 + "b"
    checker = StopChecker([stop, "zz"])
    sent = [checker.feed("x")] + [checker.feed("aa") for _ in range(2000)]
    assert "".join(r.text for r in sent) == "x" + "a" * 1000  # all but the 3000 that may still match
    r = checker.feed("b")
    assert r.stop == stop and r.text == ""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=30))
def test_property_holds_for_arbitrary_token_ids(bpe_tokenizer, ids: list[int]) -> None:
    # A model may emit any id sequence, including byte tokens that never form valid UTF-8.
    assert_stream_matches(bpe_tokenizer, ids)
