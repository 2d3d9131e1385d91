"""nomic-embed-text-v1.5 (F16 GGUF, nomic-bert: rotary positions, SwiGLU, mean pooling, Matryoshka) against
llama.cpp's own ``llama-server --embedding`` on the same file: the same token ids for every text, and
embeddings equal to cosine >= 0.9999 on varied texts and a document at the 2,048-token limit.

Second tier: it loads a 274 MB GGUF file and starts llama-server (built by scripts/bench_vs_llama_cpp.sh).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from encoder_cases import TEXTS, cosines, text_of_tokens

from servelm.runtime.model_fetch import ensure
from servelm.runtime.model_files import cache_dir
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.encoder_engine import EncoderEngine

pytestmark = pytest.mark.slow  # a 274 MB GGUF file and a llama-server process

LLAMA_SERVER = Path(
    os.environ.get(
        "LLAMA_SERVER", cache_dir() / "peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
    )
)


def _free_port() -> int:
    for port in range(18450, 18460):  # the ports this project's tests and benchmarks may take
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 18450-18459")


@pytest.fixture(scope="module")
def nomic() -> Path:
    return ensure("nomic")


@pytest.fixture(scope="module")
def engine(nomic: Path) -> EncoderEngine:
    return EncoderEngine(EngineConfig(model=str(nomic), max_num_seqs=8, max_num_batched_tokens=4096))


@pytest.fixture(scope="module")
def llama(nomic: Path) -> Iterator[str]:
    if not LLAMA_SERVER.is_file():
        pytest.fail(
            f"no llama-server at {LLAMA_SERVER}: build it with scripts/bench_vs_llama_cpp.sh (or set LLAMA_SERVER)"
        )
    port = _free_port()
    # One slot of the whole trained context; -nr: no weight repacking (it crashed at start-up on some CPUs here).
    argv = [str(LLAMA_SERVER), "-m", str(nomic), "--embedding", "-nr", "-t", "2", "--port", str(port)]
    argv += ["-c", "2048", "-np", "1", "-b", "2048", "-ub", "2048"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_equals_llama_cpp(engine: EncoderEngine, llama: str) -> None:
    tok = engine.tokenizer
    texts = [f"search_query: {t}" for t in TEXTS] + [f"search_document: {TEXTS[1]}", text_of_tokens(tok, 2048)]
    ids = [tok(t)["input_ids"] for t in texts]
    for t, i in zip(texts, ids):
        theirs = httpx.post(f"{llama}/tokenize", json={"content": t, "add_special": True}).json()["tokens"]
        assert theirs == i, t
    got = engine.embed(ids)  # batched: padded attention within a step
    ref = httpx.post(f"{llama}/v1/embeddings", json={"input": ids}, timeout=600).json()
    ref_t = torch.tensor([d["embedding"] for d in ref["data"]])
    assert min(cosines(got, ref_t)) >= 0.9999
    assert engine.block_manager.num_used_blocks == 0
