"""Where each engine core of ``--data-parallel-size N`` runs: on CPU, its own share of this process's allowed
CPUs (pinned before torch starts its threads, with as many threads as the share has CPUs); with CUDA,
its own ``tensor_parallel_size`` GPUs (``CUDA_VISIBLE_DEVICES``). A machine without
enough CPUs or GPUs for N cores is refused at start-up with why, never oversubscribed quietly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from servelm.scheduler.config import EngineConfig


class PlacementError(ValueError):
    """This machine cannot give every engine core its own CPUs or GPUs."""


@dataclass(frozen=True)
class Placement:
    """Engine core ``index``'s share of the machine."""

    index: int
    cpus: tuple[int, ...] | None = None  # CPU: the CPUs it is pinned to
    cuda_devices: str | None = None  # CUDA: its CUDA_VISIBLE_DEVICES
    threads: int | None = None  # CPU: each of its ranks' torch threads

    def describe(self) -> str:
        if self.cuda_devices is not None:
            return f"engine core {self.index}: GPU {self.cuda_devices}"
        assert self.cpus is not None
        return f"engine core {self.index}: CPUs {','.join(map(str, self.cpus))}"


def plan_placements(config: EngineConfig, n: int, gpus: int | None) -> list[tuple[Placement, EngineConfig]]:
    """Each of ``n`` cores' share and its own configuration. ``gpus``: the CUDA devices this process sees
    (None: the model runs on CPU). Raises ``PlacementError``."""
    tp = config.tensor_parallel_size
    if gpus is not None:
        if ":" in config.device:
            raise PlacementError(
                f"--device {config.device} names one GPU; with --data-parallel-size each engine core gets its own "
                "(give --device cuda, and CUDA_VISIBLE_DEVICES to choose which)"
            )
        visible = _visible_gpus(gpus)
        if len(visible) < n * tp:
            raise PlacementError(
                f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs; "
                f"this process sees {len(visible)}"
            )
        return [
            (Placement(i, cuda_devices=",".join(visible[i * tp : (i + 1) * tp])), _for_core(config, i))
            for i in range(n)
        ]
    cpus = sorted(os.sched_getaffinity(0))
    if n * tp > len(cpus):
        raise PlacementError(
            f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs at least {n * tp} CPUs (one per rank); "
            f"this process may use {len(cpus)}"
        )
    out = []
    for i in range(n):
        share = tuple(cpus[i * len(cpus) // n : (i + 1) * len(cpus) // n])
        threads = config.num_threads or max(1, len(share) // tp)  # each tensor-parallel rank's, as without DP
        out.append((Placement(i, cpus=share, threads=threads), _for_core(config, i, num_threads=threads)))
    return out


def _visible_gpus(count: int) -> list[str]:
    """The ids to hand out: the ones CUDA_VISIBLE_DEVICES names (as written: indices or UUIDs), else 0..count-1."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given:
        return [d.strip() for d in given.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


def _for_core(config: EngineConfig, index: int, num_threads: int | None = None) -> EngineConfig:
    changes: dict[str, Any] = {}
    if num_threads is not None:
        changes["num_threads"] = num_threads
    if config.kv_events_config:
        changes["kv_events_config"] = kv_events_for_core(config.kv_events_config, config.host, index)
    return dataclasses.replace(config, **changes) if changes else config


def kv_events_for_core(text: str, host: str, index: int) -> str:
    """Core ``index``'s ``--kv-events-config``: the sockets it binds moved by ``index`` (the port of a
    ``tcp://`` endpoint, a suffix on an ``ipc://`` path), as vLLM offsets them by the DP rank; an
    endpoint it connects to (a broker) is shared."""
    from servelm.scheduler.kv_events import KVEventsConfig

    cfg = KVEventsConfig.parse(text, host=host)
    if index == 0 or not cfg.active:
        return text
    if cfg.binds and cfg.endpoint is not None:
        cfg.endpoint = _offset(cfg.endpoint, index)
    if cfg.replay_endpoint is not None:
        cfg.replay_endpoint = _offset(cfg.replay_endpoint, index)
    return json.dumps(dataclasses.asdict(cfg))


def _offset(endpoint: str, index: int) -> str:
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if m:
        return f"{m.group(1)}{int(m.group(2)) + index}"
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-{index}"
    return endpoint


def run_placed_engine_core(placement: Placement, config: EngineConfig, *args: Any) -> None:
    """A data-parallel engine core's main: its GPUs, CPUs and thread count set first, before anything in
    this fresh process imports torch (CUDA reads CUDA_VISIBLE_DEVICES when it starts, OpenMP its thread
    count, and threads inherit the CPUs of the thread that starts them)."""
    if placement.cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.cuda_devices
    if placement.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(placement.threads)
    if placement.cpus is not None:
        os.sched_setaffinity(0, placement.cpus)
    from servelm.server.engine_core import run_engine_core

    run_engine_core(config, *args)
