"""The model runner of one tensor-parallel rank.

Every rank builds the same ``TensorParallelRunner`` (its model shard, its KV heads' pool, its
kernels). Rank 0 is driven like any ``ModelRunner`` (by the engine): ``forward`` broadcasts the
step it built before running its shard, and the head's gather brings the sampled rows' full logits
to it, where the ordinary sampler runs. Ranks 1..N-1 run ``serve``: receive a step, run the same
forward, hand their logits slice to the gather, until rank 0 releases the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from servelm.runtime import lora
from servelm.runtime.config import ModelConfig, UnsupportedModelError
from servelm.runtime.distributed.comm import Communicator
from servelm.runtime.distributed.sharding import check_tensor_parallel, load_tensor_parallel_model
from servelm.runtime.distributed.step_message import receive_step, send_release, send_step
from servelm.runtime.kv_cache import KVPool
from servelm.runtime.models.llama import CausalLM
from servelm.runtime.runner import SCORE_ROWS, ModelRunner
from servelm.runtime.step import StepInputs


class WorkerGroup(Protocol):
    """Rank 0's worker processes as the runner uses them (``launcher.TensorParallelGroup``)."""

    on_worker_death: Callable[..., None] | None

    @property
    def failure(self) -> BaseException | None: ...

    def released(self, runner: TensorParallelRunner) -> None: ...

    def shutdown(self) -> None: ...


class TensorParallelRunner(ModelRunner):
    """A ``ModelRunner`` over one rank's shard; ``comm`` says which rank (0 drives, samples)."""

    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        *,
        comm: Communicator,
        group: WorkerGroup | None = None,
        **kwargs: Any,
    ) -> None:
        check_tensor_parallel(
            model_config,
            comm.world_size,
            device=torch.device(kwargs.get("device", "cpu")),
            model_dir=model_dir,
            quantization=kwargs.get("quantization"),
        )
        self.comm = comm
        self.group = group  # rank 0's: the processes ``close`` stops
        self._logits_of: StepInputs | None = None  # the step whose gathered logits are kept
        self._logits: torch.Tensor | None = None
        kwargs["enforce_eager"] = True  # no CUDA graphs: a replay would skip the broadcast
        super().__init__(model_dir, model_config, **kwargs)

    def load_model(self, model_dir: Path, model_config: ModelConfig) -> CausalLM:
        return load_tensor_parallel_model(
            model_dir, model_config, self.backend, self.comm, dtype=self.dtype, device=self.device
        )

    def _new_pool(self, num_blocks: int) -> KVPool:
        mc = self.model_config
        kv_heads = mc.num_kv_heads // self.comm.world_size  # this rank's heads only
        return KVPool(mc.num_layers, num_blocks, self.block_size, kv_heads, mc.head_dim, self.kv_dtype, self.device)

    def warm_up(self) -> int:
        raise UnsupportedModelError("measuring the KV budget (warm_up) is not supported with tensor parallelism yet")

    def add_lora(self, adapter_id: int, adapter: lora.LoRAAdapter) -> None:
        raise UnsupportedModelError("LoRA adapters are not supported with tensor parallelism yet")

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Rank 0: send the step to the other ranks, then run this rank's shard over it."""
        if not self.comm.is_driver:
            raise RuntimeError("only rank 0 is driven step by step; the other ranks run serve()")
        send_step(self.comm, inputs)
        return super().forward(inputs)

    def sampled_logits(self, inputs: StepInputs, out: torch.Tensor, is_logits: bool) -> torch.Tensor:
        # The gather is collective: the sampler's retry (``reload``) gets a kept copy, not a second gather.
        if self._logits_of is inputs and self._logits is not None:
            return self._logits.clone()
        logits = super().sampled_logits(inputs, out, is_logits)
        self._logits_of, self._logits = inputs, logits.clone()
        return logits

    @torch.inference_mode()
    def serve(self) -> int:
        """Ranks 1..N-1: run rank 0's steps until it releases the model; returns the steps run."""
        steps = 0
        while (step := receive_step(self.comm)) is not None:
            hidden = self.model(step.input_ids, step.positions, self.backend.build_metadata(step.meta))
            # The gathers in rank 0's order (``ModelRunner.sample``): the scored prompt rows, in
            # ``score_prompt``'s slices, then the sampled rows.
            for a in range(0, step.score_rows.numel(), SCORE_ROWS):
                self.model.compute_logits(hidden.index_select(0, step.score_rows[a : a + SCORE_ROWS]))
            rows = step.sample_rows
            if rows.numel():
                self.model.compute_logits(hidden if rows.numel() == hidden.shape[0] else hidden.index_select(0, rows))
            steps += 1
        return steps

    def release(self) -> None:
        """Rank 0: let the other ranks leave ``serve`` (this runner takes no more steps)."""
        if self.comm.is_driver:
            send_release(self.comm)
            if self.group is not None:
                self.group.released(self)

    def watch_workers(self, on_death: Callable[[BaseException], None]) -> None:
        """Rank 0: call ``on_death(error)`` (from a watcher thread) if a worker dies, at once if one has."""
        if self.group is None:
            return
        self.group.on_worker_death = on_death
        if self.group.failure is not None:
            on_death(self.group.failure)

    def close(self) -> None:
        """Rank 0: release the model and stop the group's workers (the engine's last call)."""
        if self.group is not None:
            self.group.shutdown()
