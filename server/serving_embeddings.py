"""``POST /v1/embeddings``, ``/v1/rerank`` and ``/v1/score`` over an encoder engine
(``scheduler.encoder_engine``): inputs are tokenized in the tokenizer thread, each becomes one
prompt-only engine request, and the pooled vectors come back in the requests' outputs.

Rerank and score are bi-encoder cosines: the query and the documents are embedded alike and compared.
A generative model refuses these paths with a 400, and an encoder refuses the generation paths
(``wrong_model_kind``, checked by the app's gate before the body is read).
"""

from __future__ import annotations

import array
import base64
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from servelm.scheduler.encoder_engine import PoolingParams
from servelm.server.engine_info import EngineInfo
from servelm.server.errors import APIError, bad_request, error_responses
from servelm.server.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from servelm.server.serving_common import (
    RequestFailed,
    ServingContext,
    add_requests,
    check_token_ids,
    random_id,
    until_disconnect,
)

POOLING_PATHS = frozenset({"/v1/embeddings", "/v1/rerank", "/v1/score"})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})


def is_encoder(info: EngineInfo) -> bool:
    return info.is_encoder


def wrong_model_kind(path: str, engine: EngineInfo) -> APIError | None:
    """The 400 for a generation path on an embedding model, or an embedding path on a generative one."""
    if is_encoder(engine) and path in GENERATION_PATHS:
        return bad_request(
            f"The model `{engine.served_model_name}` is an embedding model: it serves /v1/embeddings, /v1/rerank "
            "and /v1/score, not text generation.",
            param="model",
            code="model_not_generative",
        )
    if not is_encoder(engine) and path in POOLING_PATHS:
        return bad_request(
            f"The model `{engine.served_model_name}` generates text; {path} needs an embedding model "
            "(serve a sentence-transformers folder or an embedding GGUF file with --model).",
            param="model",
            code="model_not_embedding",
        )
    return None


def _truncate(ids: list[int], keep: int | None, limit: int, specials: tuple[list[int], list[int]]) -> list[int]:
    """At most ``keep`` tokens (-1: the model's limit): the first ones, the closing special tokens kept."""
    if keep is None or len(ids) <= (limit if keep == -1 else keep):
        return ids
    keep = limit if keep == -1 else keep
    head, tail = specials
    if (
        len(ids) >= len(head) + len(tail)
        and ids[: len(head)] == head
        and ids[len(ids) - len(tail) :] == tail
        and keep > len(head) + len(tail)
    ):
        return ids[: keep - len(tail)] + tail
    return ids[:keep]


def _special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text (``[CLS]`` and ``[SEP]`` for BERT)."""
    empty = list(tokenizer("")["input_ids"])
    return empty[:1], empty[1:]


async def embed_inputs(
    ctx: ServingContext, raw: Request, inputs: list[str] | list[list[int]], truncate: int | None, param: str
) -> tuple[list[list[float]], int]:
    """Each input's pooled vector (in order) and the tokens they took; 4xx for bad inputs."""
    if not inputs:
        raise bad_request(f"'{param}' is empty: nothing to embed.", param=param)
    ctx.check_sequences(len(inputs), 1)
    tok = ctx.tokenizer
    specials: tuple[list[int], list[int]] = ([], [])
    if isinstance(inputs[0], str):
        texts: list[str] = inputs
        ctx.check_prompt_chars(sum(map(len, texts)), param, "the inputs have", "Please shorten the inputs.")

        def encode() -> tuple[list[list[int]], tuple[list[int], list[int]]]:
            return [list(ids) for ids in tok(texts)["input_ids"]], _special_tokens(tok)

        ids, specials = await ctx.async_engine.run_blocking(encode)
    else:
        ids = [list(i) for i in inputs]
        check_token_ids(ids, ctx.vocab_size, param)
    if truncate is not None:
        ids = [_truncate(i, truncate, ctx.max_model_len, specials) for i in ids]
    for i, seq in enumerate(ids):
        if not seq:
            raise bad_request(f"'{param}[{i}]' is empty: nothing to embed.", param=param)
        if len(seq) > ctx.max_model_len:
            raise bad_request(
                f"This model's maximum input length is {ctx.max_model_len} tokens. However, '{param}[{i}]' has "
                f"{len(seq)} tokens. Please shorten it, or send truncate_prompt_tokens.",
                param=param,
            )
    base = random_id("embd")
    rids = [f"{base}-{i}" for i in range(len(ids))]
    requests: list[Any] = [(r, s, PoolingParams()) for r, s in zip(rids, ids)]  # prompt-only: no SamplingParams
    group = await add_requests(ctx, requests, time.monotonic(), {"input": param})
    index = {r: i for i, r in enumerate(rids)}

    async def collect() -> list[list[float]]:
        found: list[list[float] | None] = [None] * len(rids)
        async for out in group:
            if out.embedding is None:
                raise RequestFailed(out.error or "the request ended without an embedding")
            found[index[out.request_id]] = out.embedding
        return [v for v in found if v is not None]

    vectors = await until_disconnect(raw, collect(), group)
    return vectors, sum(map(len, ids))


def _matryoshka(engine: EngineInfo, dimensions: int | None) -> int | None:
    """The dimensions to truncate to (None: all), or the 400 for a model not trained for them."""
    if dimensions is None:
        return None
    size, trained = int(engine.dimensions or 0), engine.matryoshka
    if dimensions == size:
        return None
    if not trained:
        raise bad_request(
            f"The model `{engine.served_model_name}` was not trained for shorter embeddings (Matryoshka); "
            f"'dimensions' must be {size} or absent.",
            param="dimensions",
        )
    if dimensions > size:
        raise bad_request(f"'dimensions' must be at most {size} for this model.", param="dimensions")
    return dimensions


def _norm(v: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in v))


def _shaped(v: list[float], dims: int | None, fmt: str) -> list[float] | str:
    """Truncated to ``dims`` and normalised again (Matryoshka), in the format asked for."""
    if dims is not None:
        v = v[:dims]
        scale = 1.0 / max(_norm(v), 1e-12)
        v = [x * scale for x in v]
    if fmt == "base64":  # OpenAI's: the little-endian float32 bytes
        packed = array.array("f", v)
        if sys.byteorder == "big":
            packed.byteswap()
        return base64.b64encode(packed.tobytes()).decode()
    return v


async def create_embeddings(ctx: ServingContext, body: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
    ctx.resolve_model(body.model)
    dims = _matryoshka(ctx.async_engine.info, body.dimensions)
    inputs: Any = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    vectors, tokens = await embed_inputs(ctx, raw, inputs, body.truncate_prompt_tokens, "input")
    data = [EmbeddingData(index=i, embedding=_shaped(v, dims, body.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(
        data=data, model=ctx.served_model_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )


def _cosine(a: list[float], b: list[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b)) / max(_norm(a) * _norm(b), 1e-12)


async def create_rerank(ctx: ServingContext, body: RerankRequest, raw: Request) -> RerankResponse:
    ctx.resolve_model(body.model)
    texts = body.texts()
    vectors, tokens = await embed_inputs(ctx, raw, [body.query, *texts], body.truncate_prompt_tokens, "documents")
    scores = [_cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [
        RerankResult(index=i, relevance_score=scores[i], document={"text": texts[i]} if body.return_documents else None)
        for i in order
    ]
    return RerankResponse(
        id=random_id("rerank"), model=ctx.served_model_name, usage=RerankUsage(total_tokens=tokens), results=results
    )


async def create_score(ctx: ServingContext, body: ScoreRequest, raw: Request) -> ScoreResponse:
    ctx.resolve_model(body.model)
    left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(left) != 1 and len(left) != len(right):
        raise bad_request(
            f"'text_1' has {len(left)} texts and 'text_2' {len(right)}: give one 'text_1', or as many as 'text_2'.",
            param="text_1",
        )
    vectors, tokens = await embed_inputs(ctx, raw, [*left, *right], body.truncate_prompt_tokens, "text_2")
    a, b = vectors[: len(left)], vectors[len(left) :]
    scores = [_cosine(a[0] if len(a) == 1 else a[i], v) for i, v in enumerate(b)]
    return ScoreResponse(
        id=random_id("score"), created=int(time.time()), model=ctx.served_model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)], usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )  # fmt: skip


def install_embeddings(app: FastAPI, serving: Callable[[Request], ServingContext]) -> None:
    """The three routes (under ``/v1/``, where the app's gate checks the API key); ``serving``: the
    context of the model a request names."""
    errors = error_responses(400, 401, 404, 413, 500, 503)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        return await create_embeddings(serving(raw), body, raw)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=errors)
    async def rerank(body: RerankRequest, raw: Request) -> RerankResponse:
        return await create_rerank(serving(raw), body, raw)

    @app.post("/v1/score", response_model=ScoreResponse, responses=errors)
    async def score(body: ScoreRequest, raw: Request) -> ScoreResponse:
        return await create_score(serving(raw), body, raw)


__all__ = ["GENERATION_PATHS", "POOLING_PATHS", "install_embeddings", "wrong_model_kind"]
