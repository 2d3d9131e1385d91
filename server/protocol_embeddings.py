"""The wire format of ``POST /v1/embeddings`` (OpenAI's), ``POST /v1/rerank`` (Jina's and Cohere's, as vLLM
and llama-server take it) and ``POST /v1/score`` (vLLM's)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelm.server.limits import RequestBody

# A string, strings, token ids, or lists of token ids (OpenAI's four input shapes).
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestBody):
    """``POST /v1/embeddings``. ``truncate_prompt_tokens`` (vLLM's): keep at most that many tokens of each
    input (-1: the model's limit) instead of refusing a longer one."""

    model_config = ConfigDict(extra="allow")  # clients add fields of their own (``user``, ``input_type``)

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(RequestBody):
    """``POST /v1/rerank``: the documents ordered by relevance to the query, best first."""

    model_config = ConfigDict(extra="allow")

    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    model: str | None = None
    top_n: int | None = Field(default=None, ge=0)  # None or 0: all of them
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(RequestBody):
    """``POST /v1/score`` (vLLM's): ``text_1`` against each ``text_2`` (one to many), or pair by pair."""

    model_config = ConfigDict(extra="allow")

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage
