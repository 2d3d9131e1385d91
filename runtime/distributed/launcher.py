"""The processes of a tensor-parallel group: rank 0 in the calling process (where the scheduler
runs), ranks 1..N-1 spawned, all joined in one process group (gloo on CPU, NCCL on CUDA).

The workers outlive a model: ``load`` tells them which folder to shard (one pickled control
message), the runner's ``release`` sends them back to wait for the next ``load`` or ``shutdown``.
A worker that dies is noticed by a watcher thread on rank 0 (within a second, whether or not a step
is running), and a worker whose rank 0 dies exits too: no rank outlives the group.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servelm.runtime.config import ModelConfig
from servelm.runtime.distributed.comm import Communicator
from servelm.runtime.distributed.sharding import check_tensor_parallel
from servelm.runtime.distributed.tp_runner import TensorParallelRunner
from servelm.runtime.platform import platform_of

log = logging.getLogger(__name__)

LOAD = "load"
SHUTDOWN = "shutdown"
# A collective inside a step waits this long for a rank that never joins it (a hung worker); the
# wait between steps has no useful bound (an idle server sends nothing), so it gets a year.
STEP_TIMEOUT_S = 60.0
IDLE_TIMEOUT = timedelta(days=365)
# How often a worker checks that rank 0 is still its parent.
PARENT_POLL_S = 1.0


def backend_for(device: torch.device) -> str:
    """The one place the collectives' backend is chosen: NCCL between CUDA devices, gloo on CPU."""
    return platform_of(device).distributed_backend


def _join(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float) -> Communicator:
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    idle = dist.new_group(list(range(world_size)), timeout=IDLE_TIMEOUT, backend=backend)
    return Communicator(rank, world_size, idle_group=idle)


def _exit_with_parent(parent: int) -> None:
    """A worker whose rank 0 is gone (killed, crashed) ends itself rather than wait in a collective."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _worker_main(
    rank: int, world_size: int, init_method: str, backend: str, timeout_s: float, num_threads: int, parent: int
) -> None:
    """Ranks 1..N-1: load what rank 0 names, serve its steps, until it shuts the group down."""
    threading.Thread(target=_exit_with_parent, args=(parent,), name="servelm-tp-parent", daemon=True).start()
    torch.set_num_threads(num_threads)
    comm = _join(rank, world_size, init_method, backend, timeout_s)
    try:
        while True:
            message: Any = comm.broadcast_object()
            if message[0] == SHUTDOWN:
                return
            _, model_dir, kwargs = message
            runner = TensorParallelRunner(Path(model_dir), ModelConfig.from_dir(model_dir), comm=comm, **kwargs)
            runner.serve()
            del runner
    finally:
        dist.destroy_process_group()


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited while its group was serving: rank 0 cannot run the model alone."""


class TensorParallelGroup:
    """``world_size`` ranks: this process is rank 0; ``num_threads`` torch threads per worker.

    ``on_worker_death(error)`` is called from the watcher thread when a worker exits before
    ``shutdown`` (after the error is logged).
    """

    def __init__(
        self,
        world_size: int,
        *,
        num_threads: int = 1,
        timeout_s: float = STEP_TIMEOUT_S,
        device: torch.device | str = "cpu",
        on_worker_death: Callable[[WorkerDiedError], None] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"tensor parallel size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.on_worker_death = on_worker_death
        self.failure: WorkerDiedError | None = None
        self._runner: TensorParallelRunner | None = None  # loaded and not released
        self._closing = threading.Event()
        # A file rendezvous: no port to pick (and none to collide with another group on the machine).
        self._rendezvous = tempfile.mkdtemp(prefix="servelm-tp-")
        init_method = f"file://{self._rendezvous}/store"
        backend = backend_for(torch.device(device))
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, init_method, backend, timeout_s, num_threads, os.getpid()),
                name=f"servelm-tp-rank{r}",
                daemon=True,
            )
            for r in range(1, world_size)
        ]
        for w in self.workers:
            w.start()
        atexit.register(self._kill_workers)  # whatever happens to rank 0's shutdown, no worker outlives it
        self.comm = _join(0, world_size, init_method, backend, timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="servelm-tp-watch", daemon=True)
        self._watcher.start()

    def load(self, model_dir: Path, **runner_kwargs: Any) -> TensorParallelRunner:
        """Rank 0's runner for the folder's model, every worker loading its own shard alongside.
        ``runner_kwargs`` are ``ModelRunner``'s (picklable: they travel to the workers)."""
        cfg = ModelConfig.from_dir(model_dir)
        device = torch.device(runner_kwargs.get("device", "cpu"))
        # Refused here, before the workers are told: a worker that failed to load would leave rank 0 waiting.
        check_tensor_parallel(
            cfg,
            self.world_size,
            device=device,
            model_dir=Path(model_dir),
            quantization=runner_kwargs.get("quantization"),
        )
        self.comm.broadcast_object((LOAD, str(model_dir), runner_kwargs))
        self._runner = TensorParallelRunner(Path(model_dir), cfg, comm=self.comm, group=self, **runner_kwargs)
        return self._runner

    def released(self, runner: TensorParallelRunner) -> None:
        if self._runner is runner:
            self._runner = None

    def shutdown(self) -> None:
        """Stop the workers (releasing a loaded runner first) and leave the process group; after a
        worker died, only stop the others (a collective would fail)."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            if self.failure is None:
                if self._runner is not None:
                    self._runner.release()
                self.comm.broadcast_object((SHUTDOWN,))
                for w in self.workers:
                    w.join(timeout=30)
        finally:
            self._kill_workers()
            dist.destroy_process_group()
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            atexit.unregister(self._kill_workers)

    def _kill_workers(self) -> None:
        self._closing.set()
        for w in self.workers:
            if w.is_alive():
                w.kill()
        for w in self.workers:
            w.join(timeout=10)

    def _watch(self) -> None:
        sentinels = {w.sentinel: rank for rank, w in enumerate(self.workers, start=1)}
        while sentinels and not self._closing.is_set():
            for s in wait(list(sentinels), timeout=PARENT_POLL_S):
                rank = sentinels.pop(s)  # type: ignore[arg-type]  # wait() hands back the sentinels (ints) it was given
                if self._closing.is_set():
                    return
                w = self.workers[rank - 1]
                # The sentinel closes as the worker's files close, a moment before the kernel lets its
                # exit status be reaped: wait for the status rather than report "unknown".
                w.join(timeout=5)
                code = w.exitcode if w.exitcode is not None else "unknown"
                how = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit status {code}"
                self.failure = WorkerDiedError(
                    f"tensor-parallel worker rank {rank} (pid {w.pid}) died ({how}): the model cannot run without it"
                )
                log.error("%s", self.failure)
                if self.on_worker_death is not None:
                    self.on_worker_death(self.failure)
                return

    def __enter__(self) -> TensorParallelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
