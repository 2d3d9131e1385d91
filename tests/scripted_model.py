"""A Qwen3-shaped tiny model that greedily writes a chosen text, and its real-format tokenizer.

The tokenizer is the default model's byte-level BPE with Qwen3's own tokens added as Qwen3 has them
(``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>`` as plain added tokens, so they survive
``skip_special_tokens``; ``<|im_start|>`` / ``<|im_end|>`` are the default vocabulary's ChatML tokens),
``<|im_end|>`` as EOS, and Qwen3's published chat template (tests/templates/qwen3.jinja).

The model is a scripted Qwen3: every attention and MLP output projection is zero, so the residual
stream at a position is that position's token embedding and the logits are
``head @ final_norm(embed[t])``. Each token of a script gets a one-hot embedding of its own
dimension, and the head row of the token that should follow it is ``BIG`` times that one-hot: greedy
decoding then walks a chosen bigram chain from the prompt's last token, whatever came before. A chain
therefore cannot repeat a token (nor use the prompt's last token again); ``distinct_ids`` spells a
text with distinct tokens, which byte-level BPE allows (``"`` and ``" `` and ``":`` are all tokens).

Usage::

    tok = scripted_tokenizer()
    ids = distinct_ids(tok, "<think>Two and two.</think>Four.")
    folder = build_scripted_model(tmp / "m", {prompt_end_id(tok): ids})
    # servelm serve --model folder ...: any chat prompt is answered with that text, then <|im_end|>.
    with scripted_server(folder, reasoning_parser=PARSERS["qwen3"]) as srv:  # the same, in-process
        openai_client(srv).chat.completions.create(...)
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from servelm.runtime.model_files import ensure_default_model

TEMPLATES = Path(__file__).resolve().parent / "templates"

# Qwen3's added tokens that are not special (they stay in the decoded text).
QWEN3_TEXT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# The script's logit over every other token's (~0.1): far beyond any sampling temperature's reach.
BIG = 10.0


def scripted_tokenizer() -> Any:
    """The default model's tokenizer made Qwen3-shaped: Qwen3's text tokens, EOS and chat template."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TEXT_TOKENS])
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return tok


def prompt_end_id(tok: Any, **template_kwargs: Any) -> int:
    """The last token of a chat prompt (its generation prompt's), which a script starts from:
    ``enable_thinking=False`` ends Qwen3's prompts with another token than the default."""
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, **template_kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return int(ids[-1])


def _token_texts(tok: Any) -> dict[str, list[int]]:
    """Each token's text (those that decode alone to whole characters) -> the ids that spell it."""
    texts = getattr(tok, "_scripted_texts", None)
    if texts is None:
        texts = {}
        for i in range(len(tok)):
            s = tok.decode([i])
            if s and "\ufffd" not in s:
                texts.setdefault(s, []).append(i)
        tok._scripted_texts = texts
    return texts


def distinct_ids(tok: Any, text: str, avoid: tuple[int, ...] | set[int] = ()) -> list[int]:
    """Token ids that decode to ``text`` with no id twice (and none of ``avoid``). Added tokens
    (``<think>``...) are always their one token, as the model emits them; the text between them is
    spelled longest token first, backtracking where a later piece runs out of tokens. Raises
    ``ValueError`` when the text cannot be spelled so."""
    texts = _token_texts(tok)
    longest = max(len(s) for s in texts)
    added = sorted(tok.get_added_vocab(), key=len, reverse=True)
    used = set(avoid)

    def spell(pos: int) -> list[int] | None:
        if pos == len(text):
            return []
        mark = next((a for a in added if text.startswith(a, pos)), None)
        # A piece stops where the next added token starts: that one is spelled as itself.
        stop = min((j for a in added if (j := text.find(a, pos + 1)) > 0), default=len(text))
        lengths = [len(mark)] if mark else range(min(longest, stop - pos), 0, -1)
        for n in lengths:
            piece = text[pos : pos + n]
            for i in texts.get(piece, ()):
                if i in used:
                    continue
                used.add(i)
                rest = spell(pos + n)
                if rest is not None:
                    return [i, *rest]
                used.discard(i)
        return None

    ids = spell(0)
    if ids is None:
        raise ValueError(f"cannot spell {text!r} with distinct tokens (avoiding {sorted(avoid)})")
    assert tok.decode(ids) == text, (tok.decode(ids), text)
    return ids


def build_scripted_model(
    out: Path, scripts: dict[int, list[int]], tok: Any | None = None, eos_after: bool = True
) -> Path:
    """Save at ``out`` a Qwen3-shaped model (and ``tok``, default ``scripted_tokenizer()``) that, after
    a prompt ending in token ``p``, greedily generates ``scripts[p]`` and then EOS (unless
    ``eos_after`` is false: it then runs on with random tokens until ``max_tokens``). The tokens of all
    scripts, their prompt ends included, must be distinct."""
    import transformers

    tok = tok if tok is not None else scripted_tokenizer()
    eos = int(tok.convert_tokens_to_ids("<|im_end|>"))
    chain: dict[int, int] = {}  # token -> the token that follows it
    for start, ids in scripts.items():
        seq = [start, *ids]
        for a, b in itertools.pairwise(seq):
            if a in chain:
                raise ValueError(f"token {a} ({tok.decode([a])!r}) appears twice in the scripts; use distinct_ids")
            chain[a] = b
        if eos_after:
            if seq[-1] in chain:
                raise ValueError(f"token {seq[-1]} ({tok.decode([seq[-1]])!r}) appears twice in the scripts")
            chain[seq[-1]] = eos
    heads, head_dim = 2, 16
    hidden = max(64, -(-(len(chain) + 1) // 16) * 16)
    vocab = -(-len(tok) // 64) * 64
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the residual stream stays the token's embedding
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        for k, t in enumerate(chain):
            emb[t].zero_()
            emb[t, k] = 1.0
            head[chain[t]] += BIG * torch.nn.functional.one_hot(torch.tensor(k), hidden).float()
        model.model.norm.weight.fill_(1.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    # The engine reads its EOS from generation_config.json as transformers does.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos}))
    return out


def scripted_greedy(folder: Path, prompt_ids: list[int], max_tokens: int = 64) -> list[int]:
    """What transformers' greedy decoding makes of ``prompt_ids`` with the saved model (the reference
    the tests check a script against before trusting it)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids) :].tolist()


# ---- a real server over a scripted folder, and the official SDKs pointed at it -----------------------


@contextmanager
def scripted_server(folder: Path, name: str = "scripted", **serving: Any) -> Iterator[Any]:
    """``serve_scripted`` for a ``with`` block (a fixture's), stopped at its end."""
    server = serve_scripted(folder, name, **serving)
    try:
        yield server
    finally:
        server.stop()


def serve_scripted(folder: Path, name: str = "scripted", **serving: Any) -> Any:
    """uvicorn + the real engine over ``folder``, started (a ``srv_harness.ServerThread``; ``.ctx`` is its
    ``ServingContext``). ``serving`` sets context fields as the CLI's flags do, e.g.
    ``reasoning_parser=PARSERS["qwen3"]``."""
    from srv_harness import ServerThread

    from servelm.scheduler.config import EngineConfig
    from servelm.scheduler.engine import Engine
    from servelm.server.app import build_app
    from servelm.server.async_engine import AsyncEngine

    engine = Engine(
        EngineConfig(
            model=str(folder), served_model_name=name, kv_cache_memory=16 * 2**20, max_model_len=512, max_num_seqs=4
        )
    )
    app = build_app(AsyncEngine(engine))
    for field, value in serving.items():
        setattr(app.state.serving, field, value)
    server = ServerThread(app).start()
    server.ctx = app.state.serving
    return server


def openai_client(srv: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def anthropic_client(srv: Any) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


def sdk_extra(obj: Any, name: str) -> Any:
    """A field the SDK's model does not declare (vLLM's reasoning_content), as the SDK keeps it."""
    return (obj.model_extra or {}).get(name)
