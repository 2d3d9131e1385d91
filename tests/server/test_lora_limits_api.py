"""--max-cpu-loras over HTTP: a real engine on the tiny Llama with PEFT adapters loaded through
``/v1/load_lora_adapter``. Loading more than the limit works (the least recently used adapter is
unloaded and read again when a request names it), an adapter in use is never unloaded, and when
every loaded adapter is in use a load or a request for an unloaded one gets a 429 naming the limit."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_files import save_lora_adapter
from srv_harness import ServerThread

from servelm.scheduler.config import EngineConfig
from servelm.scheduler.sampling_params import SamplingParams
from servelm.server.app import build_app
from servelm.server.async_engine import AsyncEngine

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
LIMIT = 2  # --max-cpu-loras
LONG = 200  # tokens of a request kept running while the test looks on


@dataclass
class Served:
    srv: ServerThread
    engine: Any
    ae: AsyncEngine
    folders: list[Path]
    texts: dict[Path, str]  # greedy completion of PROMPT per adapter folder
    slow: threading.Event  # set: each step first sleeps, so LONG requests stay unfinished for seconds

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.srv.url}{path}", json=body, timeout=60)

    def load(self, name: str, folder: Path) -> httpx.Response:
        return self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})

    def complete(self, model: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return self.post("/v1/completions", body)

    def loaded_ids(self) -> set[int]:
        """The adapter ids in the runner (read between the engine's changes: the test serialises them)."""
        return set(self.engine.runner.lora_ids)

    def idle(self) -> None:
        deadline = time.monotonic() + 60
        snap = self.ae.snapshot
        while snap.num_running or snap.num_waiting or self.ae._groups:
            assert time.monotonic() < deadline, snap
            time.sleep(0.02)
            snap = self.ae.snapshot

    def wait_for(self, running: int, waiting: int) -> None:
        deadline = time.monotonic() + 30
        while (self.ae.snapshot.num_running, self.ae.snapshot.num_waiting) != (running, waiting):
            assert time.monotonic() < deadline, self.ae.snapshot
            time.sleep(0.01)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from servelm.scheduler.engine import Engine

    tmp = tmp_path_factory.mktemp("api-lora-limits")
    folders = [save_lora_adapter(tiny_llama_dir, tmp / f"f{i}", seed=60 + i, r=4) for i in range(3)]
    config = EngineConfig(
        model=str(tiny_llama_dir),
        kv_cache_memory=4 * 2**20,
        max_model_len=256,
        max_loras=1,
        max_cpu_loras=LIMIT,
        lora_modules=(("m0", str(folders[0])),),
    )
    engine = Engine(config)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = engine.tokenizer.encode(PROMPT)
    texts = {}
    for i, folder in enumerate(folders):
        engine.loras.add(f"ref{i}", str(folder))
        texts[folder] = engine.generate([ids], greedy, lora_names=f"ref{i}")[0].outputs[0].text
        engine.loras.remove(f"ref{i}")
    assert len(set(texts.values())) == 3  # the adapters change the answer
    slow = threading.Event()
    launch = engine.runner.launch

    def slowed(items: Any) -> Any:
        if slow.is_set():
            time.sleep(0.05)
        return launch(items)

    engine.runner.launch = slowed
    ae = AsyncEngine(engine)
    app = build_app(ae, allow_runtime_lora_updating=True)
    srv = ServerThread(app).start()
    try:
        yield Served(srv, engine, ae, folders, texts, slow)
    finally:
        slow.clear()
        srv.stop()


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_loading_more_than_the_limit_evicts_the_least_recently_used(served: Served) -> None:
    names = {f"n{i}": served.folders[i % 3] for i in range(6)}
    for name, folder in names.items():
        r = served.load(name, folder)
        assert r.status_code == 200, r.text
        assert len(served.loaded_ids()) <= LIMIT
    models = {m["id"] for m in httpx.get(f"{served.srv.url}/v1/models", timeout=10).json()["data"]}
    assert set(names) | {"m0"} <= models  # every name is still served
    # Each name answers as its own folder: the unloaded ones are read again.
    for name, folder in [*names.items(), ("m0", served.folders[0])]:
        assert _text(served.complete(name)) == served.texts[folder], name
        served.idle()
        assert len(served.loaded_ids()) <= LIMIT
    # Several requests for two unloaded adapters at once: each read once, all answered.
    assert set(served.engine.loras.loaded) == {"n5", "m0"}
    jobs = ["n0", "n1"] * 3
    reads: list[str] = []
    read = served.engine.loras.read
    served.engine.loras.read = lambda path: (reads.append(path), read(path))[1]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda n: _text(served.complete(n)), jobs))
    finally:
        del served.engine.loras.read
    assert got == [served.texts[names[n]] for n in jobs]
    assert sorted(reads) == [str(names["n0"]), str(names["n1"])]
    served.idle()
    assert len(served.loaded_ids()) <= LIMIT and not served.engine.loras.in_use
    assert "n3" not in served.engine.loras.loaded  # chat (and what is built on it) reads it again too
    chat = {"model": "n3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert served.post("/v1/chat/completions", chat).status_code == 200
    served.idle()
    for name in names:
        assert served.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_an_adapter_in_use_is_never_evicted(served: Served) -> None:
    assert served.load("held", served.folders[1]).status_code == 200
    held_id = served.engine.loras.loaded["held"]
    served.slow.set()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(served.complete, "held", LONG)
            served.wait_for(running=1, waiting=0)
            for i in range(3):  # each evicts the other loaded adapter, never "held"
                assert served.load(f"new{i}", served.folders[i % 3]).status_code == 200
                assert held_id in served.loaded_ids() and len(served.loaded_ids()) <= LIMIT
            assert not long.done()
            served.slow.clear()
            text = _text(long.result(timeout=60))
    finally:
        served.slow.clear()
    served.idle()
    assert text == _text(served.complete("held", LONG))  # its tokens were the adapter's throughout
    for name in ("held", "new0", "new1", "new2"):
        assert served.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_every_loaded_adapter_in_use_gives_429(served: Served) -> None:
    for name, folder in (("p", served.folders[1]), ("q", served.folders[2]), ("evicted", served.folders[0])):
        assert served.load(name, folder).status_code == 200
    served.slow.set()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(served.complete, "p", LONG)]
            served.wait_for(running=1, waiting=0)
            runs.append(pool.submit(served.complete, "q", LONG))  # waits (--max-loras 1), holding "q"
            served.wait_for(running=1, waiting=1)
            for r, param in (
                (served.load("more", served.folders[0]), "lora_name"),
                (served.complete("evicted"), "model"),
            ):
                assert r.status_code == 429, r.text
                err = r.json()["error"]
                assert err["code"] == "lora_limit_reached" and err["param"] == param, err
                assert f"--max-cpu-loras {LIMIT}" in err["message"], err
                assert r.headers.get("retry-after")
            assert "more" not in {m["id"] for m in httpx.get(f"{served.srv.url}/v1/models", timeout=10).json()["data"]}
            served.slow.clear()
            assert [_text(f.result(timeout=60)) for f in runs]
    finally:
        served.slow.clear()
    served.idle()
    assert _text(served.complete("evicted")) == served.texts[served.folders[0]]
    assert served.load("more", served.folders[0]).status_code == 200
    paths = httpx.get(f"{served.srv.url}/openapi.json", timeout=10).json()["paths"]
    assert all("429" in paths[p]["post"]["responses"] for p in ("/v1/completions", "/v1/load_lora_adapter"))
    for name in ("p", "q", "evicted", "more"):
        assert served.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_a_vanished_folder_is_a_clear_400(served: Served, tmp_path: Path) -> None:
    gone = shutil.copytree(served.folders[2], tmp_path / "gone")
    assert served.load("gone", gone).status_code == 200
    for i in range(LIMIT):  # unload "gone" from memory
        assert served.load(f"pad{i}", served.folders[i]).status_code == 200
    assert "gone" not in served.engine.loras.loaded
    shutil.rmtree(gone)
    r = served.complete("gone")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "invalid_lora_adapter" and str(gone) in err["message"], err
    # Nothing else is harmed.
    assert _text(served.complete("pad0")) == served.texts[served.folders[0]]
    assert served.complete(served.engine.served_model_name).status_code == 200
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "gone"}).status_code == 200
    served.idle()
    assert not served.engine.loras.in_use
