"""Helpers shared by the GGUF tests: write a GGUF file of given tensors, and time a call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    """A GGUF file holding ``tensors`` (name -> (data, format)); quantized data as uint8 block rows."""
    writer = gguf.GGUFWriter(path, arch="llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)  # typed arrays name their own format
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)  # uint8 rows; the writer derives the shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def median_seconds(fn: Callable[[], object], runs: int = 7) -> float:
    """Median wall time of ``fn`` over ``runs`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
