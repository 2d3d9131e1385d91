"""The processes of a tensor-parallel group: rank 0 in the calling process (where the scheduler
runs), ranks 1..N-1 spawned, all joined in one gloo process group.

The workers outlive a model: ``load`` tells them which folder to shard (one pickled control
message), the runner's ``release`` sends them back to wait for the next ``load`` or ``shutdown``.
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servelm.runtime.config import ModelConfig
from servelm.runtime.distributed.comm import Communicator
from servelm.runtime.distributed.sharding import check_tensor_parallel
from servelm.runtime.distributed.tp_runner import TensorParallelRunner

LOAD = "load"
SHUTDOWN = "shutdown"


def _worker_main(rank: int, world_size: int, init_method: str, timeout_s: float, num_threads: int) -> None:
    """Ranks 1..N-1: load what rank 0 names, serve its steps, until it shuts the group down."""
    torch.set_num_threads(num_threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    comm = Communicator(rank, world_size)
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


class TensorParallelGroup:
    """``world_size`` ranks: this process is rank 0; ``num_threads`` torch threads per worker."""

    def __init__(self, world_size: int, *, num_threads: int = 1, timeout_s: float = 300.0) -> None:
        if world_size < 1:
            raise ValueError(f"tensor parallel size must be at least 1, got {world_size}")
        self.world_size = world_size
        # A file rendezvous: no port to pick (and none to collide with another group on the machine).
        self._rendezvous = tempfile.mkdtemp(prefix="servelm-tp-")
        init_method = f"file://{self._rendezvous}/store"
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(target=_worker_main, args=(r, world_size, init_method, timeout_s, num_threads), daemon=True)
            for r in range(1, world_size)
        ]
        for w in self.workers:
            w.start()
        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self.comm = Communicator(0, world_size)

    def load(self, model_dir: Path, **runner_kwargs: Any) -> TensorParallelRunner:
        """Rank 0's runner for the folder's model, every worker loading its own shard alongside.
        ``runner_kwargs`` are ``ModelRunner``'s (picklable: they travel to the workers)."""
        cfg = ModelConfig.from_dir(model_dir)
        device = torch.device(runner_kwargs.get("device", "cpu"))
        # Refused here, before the workers are told: a worker that failed to load would leave rank 0 waiting.
        check_tensor_parallel(cfg, self.world_size, device=device, model_dir=Path(model_dir), quantization=runner_kwargs.get("quantization"))
        self.comm.broadcast_object((LOAD, str(model_dir), runner_kwargs))
        return TensorParallelRunner(Path(model_dir), cfg, comm=self.comm, **runner_kwargs)

    def shutdown(self) -> None:
        """Stop the workers (release any loaded runner first) and leave the process group."""
        try:
            self.comm.broadcast_object((SHUTDOWN,))
            for w in self.workers:
                w.join(timeout=60)
        finally:
            dist.destroy_process_group()
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def __enter__(self) -> TensorParallelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
