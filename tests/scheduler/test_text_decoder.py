"""TextDecoder: the detokenizer's decode (backend shortcut + single-token memo) equals ``tokenizer.decode``."""

from __future__ import annotations

import random

import pytest

from servelm.runtime.model_files import default_model_dir
from servelm.scheduler.detokenizer import IncrementalDetokenizer, TextDecoder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    path = default_model_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("default model not prepared (make model)")
    return AutoTokenizer.from_pretrained(str(path))


def id_lists(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    specials = [0, 1, 2]  # <|endoftext|>, <|im_start|>, <|im_end|> in the default vocabulary
    out = [[t] for t in specials] + [[rng.randrange(vocab)] for _ in range(50)]
    out += [[rng.choice(specials + [rng.randrange(vocab)]) for _ in range(rng.randint(2, 6))] for _ in range(50)]
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_equals_tokenizer_decode(tokenizer, skip: bool) -> None:
    dec = TextDecoder(tokenizer, skip)
    assert dec._decode is not dec._hf_decode  # the default tokenizer takes the backend shortcut
    for ids in id_lists(len(tokenizer), seed=int(skip)) * 2:  # twice: the second time from the memo
        assert dec(ids) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert dec([]) == ""


def test_falls_back_to_decode_when_it_does_more(tokenizer) -> None:
    class Shouting(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    loud = Shouting.__new__(Shouting)
    loud.__dict__.update(tokenizer.__dict__)
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    dec = TextDecoder(loud)
    assert dec._decode == dec._hf_decode
    assert dec(ids) == "HELLO THERE" and dec(ids[:1]) == loud.decode(ids[:1], skip_special_tokens=True)


def test_shared_decoder_gives_the_same_deltas(tokenizer) -> None:
    ids = tokenizer.encode("Hello, world! 😀 café\n  def f(x): return x", add_special_tokens=False)
    shared = TextDecoder(tokenizer, True)
    alone = IncrementalDetokenizer(tokenizer)
    for _ in range(2):  # a second request reuses the first one's memo
        d = IncrementalDetokenizer(tokenizer, True, decoder=shared)
        assert [d.step([t]) for t in ids] + [d.flush()] == [alone.step([t]) for t in ids] + [alone.flush()]
        alone = IncrementalDetokenizer(tokenizer)
    with pytest.raises(ValueError, match="another tokenizer or setting"):
        IncrementalDetokenizer(tokenizer, False, decoder=shared)
