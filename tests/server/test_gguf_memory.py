"""The resident memory of a server of a GGUF file: the file (mapped, shared with the page cache), the KV
pool, and a bounded working set; never a float32 copy of the weights.

Measured from ``/proc/<pid>/status`` of the real ``servelm serve`` process after it has served
requests. The Gemma 3 270M Q4_K_M file (253 MB) dequantizes to 1022 MiB of float32 weights: a server
that held them would exceed the bound by that much.
"""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import httpx
import pytest

from proc_harness import ServeProcess

pytestmark = pytest.mark.slow

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
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) // 1024 for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}  # type: ignore[union-attr]


def test_gemma3_q4_k_m_is_served_in_its_file_size(gemma3_gguf: Path) -> None:
    file_mib = gemma3_gguf.stat().st_size // 2**20
    with ServeProcess(
        "--model", str(gemma3_gguf), "--kv-cache-memory", f"{KV_MIB}MiB", "--max-model-len", "2048"
    ) as server:  # (entering starts it)
        assert "weights as stored in the GGUF file" in server.log, server.log

        def complete(i: int) -> str:
            body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 24, "temperature": 0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
            r.raise_for_status()
            return str(r.json()["choices"][0]["text"])

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, range(4)))
        assert all(texts)
        mem = status(server.proc.pid)  # type: ignore[union-attr]
    bound = file_mib + KV_MIB + WORKING_SET_MIB
    message = (
        f"servelm serving {gemma3_gguf.name} ({file_mib} MiB): VmHWM {mem['VmHWM']} MiB, VmRSS {mem['VmRSS']} MiB "
        f"(anonymous {mem['RssAnon']}, file {mem['RssFile']}); bound: file + KV {KV_MIB} + {WORKING_SET_MIB} = {bound} MiB"
    )
    print(message)
    assert mem["VmHWM"] <= bound, message
    # The weights are the file's pages, not anonymous memory: float32 copies would add ~1 GiB there.
    assert mem["RssAnon"] - KV_MIB < FLOAT32_WEIGHTS_MIB + 300, message
