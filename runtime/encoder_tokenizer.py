"""The tokenizer of an encoder: a sentence-transformers folder's own, or a GGUF file's WordPiece vocabulary
rebuilt as the BERT tokenizer it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelm.runtime.config import UnsupportedModelError

_PHANTOM_SPACE = "\u2581"  # llama.cpp's converter marks word-initial WordPiece tokens with it and drops "##"


def wordpiece_vocabulary(tokens: list[str]) -> dict[str, int]:
    """Hugging Face WordPiece spellings of a GGUF ``bert`` vocabulary: ``▁word`` -> ``word``, a continuation
    ``piece`` -> ``##piece``, special tokens (``[CLS]``) as they are."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t.startswith(_PHANTOM_SPACE):
            word = t[1:]
        elif t.startswith("[") and t.endswith("]"):
            word = t
        else:
            word = "##" + t
        vocab.setdefault(word, i)
    return vocab


def gguf_bert_tokenizer(path: Path, fields: dict[str, Any] | None = None) -> Any:
    """A fast tokenizer equal to the uncased BERT one the GGUF file's vocabulary was converted from
    (lower-casing and accent stripping as llama.cpp's WPM tokenizer does; ``[CLS] text [SEP]``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from servelm.runtime.encoder_loader import gguf_vocabulary

    if fields is None:  # the file's metadata, unless its loader has read it already
        fields = gguf_vocabulary(path)[1]
    tokens = fields["tokenizer.ggml.tokens"]
    if fields.get("tokenizer.ggml.model") != "bert":
        raise UnsupportedModelError(f"{path}: tokenizer {fields.get('tokenizer.ggml.model')!r} (served: bert)")
    vocab = wordpiece_vocabulary(tokens)
    cls_id, sep_id = int(fields["tokenizer.ggml.bos_token_id"]), int(fields["tokenizer.ggml.seperator_token_id"])
    cls, sep, unk = tokens[cls_id], tokens[sep_id], tokens[int(fields["tokenizer.ggml.unknown_token_id"])]
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=[(cls, cls_id), (sep, sep_id)]
    )
    tok.decoder = decoders.WordPiece()
    pad = tokens[int(fields.get("tokenizer.ggml.padding_token_id", 0))]
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token=unk, cls_token=cls, sep_token=sep, pad_token=pad, mask_token="[MASK]"
    )


def load_encoder_tokenizer(model: str, gguf_fields: dict[str, Any] | None = None) -> Any:
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return gguf_bert_tokenizer(path, gguf_fields)
    from servelm.runtime.tokenizer import load_tokenizer

    return load_tokenizer(path)
