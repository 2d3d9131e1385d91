"""The resident memory of a server of a GGUF file: the file (mapped, shared with the page cache), the KV
pool, and a bounded working set; never a float32 copy of the weights.

Measured from ``/proc/<pid>/status`` of the real ``servelm serve`` process after it has served
requests. The Gemma 3 270M Q4_K_M file (253 MB) dequantizes to 1022 MiB of float32 weights: a server
that held them would exceed the bound by that much.
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proc_harness import ServeProcess

pytestmark = pytest.mark.slow  # servelm serve processes on real GGUF files

KV_MIB = 256
# Everything but the weights and the KV pool: the Python runtime with torch (~250 MiB with its
# libraries), one Gemma tokenizer shared by the server and the engine (262k tokens, 515k merges; ~80
# MiB once its 6,242 placeholder tokens are left out, see runtime.tokenizer), and the activations of the
# largest step. A second tokenizer copy (and the garbage of making it) or RoPE tables of every
# position would not fit under it.
WORKING_SET_MIB = 450
FLOAT32_WEIGHTS_MIB = 1022


def status(pid: int) -> dict[str, int]:
    """The process's memory counters in MiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return {
        k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) // 1024
        for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    }


@pytest.fixture(scope="module")
def server(gemma3_gguf: Path) -> Iterator[ServeProcess]:
    with ServeProcess(
        "--model", str(gemma3_gguf), "--kv-cache-memory", f"{KV_MIB}MiB", "--max-model-len", "7000"
    ) as server:  # (entering starts it)
        yield server


def test_gemma3_q4_k_m_is_served_in_its_file_size(gemma3_gguf: Path, server: ServeProcess) -> None:
    file_mib = gemma3_gguf.stat().st_size // 2**20
    assert "weights as stored in the GGUF file" in server.log, server.log

    def complete(i: int) -> str:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 24, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(complete, range(4)))
    assert all(texts)
    mem = status(server.proc.pid)
    bound = file_mib + KV_MIB + WORKING_SET_MIB
    message = (
        f"servelm serving {gemma3_gguf.name} ({file_mib} MiB): VmHWM {mem['VmHWM']} MiB, VmRSS {mem['VmRSS']} MiB "
        f"(anonymous {mem['RssAnon']}, file {mem['RssFile']}); bound: file + KV {KV_MIB} + {WORKING_SET_MIB} = {bound} MiB"
    )
    print(message)
    assert mem["VmHWM"] <= bound, message
    # The weights are the file's pages, not anonymous memory: float32 copies would add ~1 GiB there.
    assert mem["RssAnon"] - KV_MIB < FLOAT32_WEIGHTS_MIB + 300, message


def test_sliding_window_layers_keep_only_their_windows(server: ServeProcess) -> None:
    """Gemma 3's 15 sliding-window layers (of 18) read only a sequence's last 512 positions: after a
    6,000-token prompt the pool holds the 3 global layers' 6,000 positions and a window or two of the
    local ones, not 6,000 positions of every layer."""

    def anon() -> int:
        time.sleep(1.0)  # the engine thread hands freed heap back once idle
        return status(server.proc.pid)["RssAnon"]

    random.seed(0)
    prompt = [random.randrange(1000, 200_000) for _ in range(6000)]
    before = anon()
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=600
    )
    r.raise_for_status()
    grown = anon() - before
    # K and V of a position in a layer: 2 x 256 x 4 bytes (a float32 pool) = 2 KiB. In every layer: 18 x
    # 6000 x 2 KiB = 211 MiB. The global layers' (35 MiB) and the local layers' last window, which is
    # also the prompt's last window, kept for its repeats (15 x ~540 x 2 KiB = 16 MiB): ~51 MiB.
    message = f"a 6000-token prompt made {grown} MiB more anonymous memory resident (every layer's K/V: 211 MiB)"
    print(message)
    assert grown < 120, message
