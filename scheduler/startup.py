"""What the engine settles before it serves: device, dtype, context length, KV capacity, tokenizer,
EOS ids and the runner; and what the engine needs of a runner."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from servelm.runtime.batch import BatchItem
from servelm.runtime.capacity import Capacity, kv_bytes_per_token, plan_capacity
from servelm.runtime.config import ModelConfig
from servelm.runtime.gguf.folder import stored_weight_bytes
from servelm.runtime.model_files import resolve_model_path
from servelm.runtime.platform import platform_of, resolve_device
from servelm.runtime.runner import ModelRunner, serves_as_stored
from servelm.runtime.serving_defaults import (
    DTYPE_NAMES,
    eos_ids,
    resolve_dtype,
    resolve_gguf_activations,
    resolve_kv_dtype,
    resolve_max_model_len,
)
from servelm.runtime.tokenizer import load_tokenizer
from servelm.scheduler.block_manager import BlockManager
from servelm.scheduler.config import EngineConfig
from servelm.scheduler.draft_model import check_draft_serving, load_draft_config, new_draft_proposer, target_share
from servelm.scheduler.kv_events import KVEventsConfig, ZmqEventPublisher, make_publisher
from servelm.scheduler.scheduler import Scheduler
from servelm.scheduler.speculative import DraftModelConfig, NgramProposer, Proposer, parse_speculative_config
from servelm.scheduler.step_plan import StepResult

if TYPE_CHECKING:
    from servelm.runtime.kv_cache import KVPool

log = logging.getLogger(__name__)


class RunnerLike(Protocol):
    """What the engine needs of ``runtime.runner.ModelRunner`` (tests pass fakes implementing it).

    A step is issued in two halves so that, scheduling ahead, host work runs between them while the
    device computes: ``launch`` starts the forward, ``sample`` issues the sampling.
    """

    # Read-only: the engine reads them, and the runner's own declarations may be narrower.
    @property
    def block_size(self) -> int: ...

    @property
    def kv_pool(self) -> KVPool | None:  # None until allocated
        ...

    @property
    def weight_bytes(self) -> int | None:  # what a step reads of the weights (None: parameters x dtype)
        ...

    def launch(self, items: list[BatchItem]) -> Any: ...

    def sample(self, launched: Any) -> StepResult: ...


@dataclass
class StartUp:
    """What ``start_up`` settled: the configuration with every default resolved, what it loaded, and
    the scheduler over the KV blocks sized for it."""

    config: EngineConfig
    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    capacity: Capacity
    served_model_name: str
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    runner: RunnerLike
    async_scheduling: bool
    enable_lora: bool
    block_manager: BlockManager
    proposer: Proposer | None
    scheduler: Scheduler
    kv_events: ZmqEventPublisher | None = None


def start_up(config: EngineConfig, runner: RunnerLike | None = None) -> StartUp:
    """Resolve every default of ``config`` (from the model and the device), size the KV pool and load
    the runner, unless ``runner`` is given (it must match the blocks the engine will hand out)."""
    model_dir = resolve_model_path(config.model)
    mc = ModelConfig.from_dir(model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    # A GGUF file served as stored runs llama.cpp's arithmetic unless asked otherwise: int8 activations, float16 KV.
    activations = resolve_gguf_activations(
        config.gguf_activations, serves_as_stored(model_dir, config.quantization, device, dtype)
    )
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, device, like_llama_cpp=activations == "int8")
    config = dataclasses.replace(
        config, gguf_activations=activations, kv_cache_dtype=DTYPE_NAMES.get(kv_dtype, config.kv_cache_dtype)
    )
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    # Refused before the weights are loaded.
    speculative = parse_speculative_config(config.speculative_config) if config.speculative_config else None
    kv_events = KVEventsConfig.parse(config.kv_events_config, host=config.host) if config.kv_events_config else None
    if kv_events is not None and kv_events.active and not config.enable_prefix_caching:
        log.warning("KV events describe the prefix cache, which is off: only AllBlocksCleared can be published")
    enable_lora = config.enable_lora or bool(config.lora_modules)
    if enable_lora and (config.max_loras < 1 or config.max_lora_rank < 1):
        raise ValueError("max_loras and max_lora_rank must be at least 1")
    if enable_lora and config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ValueError(f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras ({config.max_loras})")
    draft = None
    if isinstance(speculative, DraftModelConfig):
        check_draft_serving(config, enable_lora)
        draft = load_draft_config(speculative, mc)
    tp = config.tensor_parallel_size
    if tp != 1:
        check_tensor_parallel_serving(config, mc, model_dir, device, enable_lora, injected=runner is not None)

    defaults = platform_of(device).defaults(dtype, mc.head_dim)
    max_model_len = resolve_max_model_len(mc, config.max_model_len, sliding_window_supported=defaults.sliding_window)
    max_batched = config.max_num_batched_tokens or defaults.max_num_batched_tokens
    block_size = config.block_size if config.block_size is not None else defaults.block_size

    kv_memory = config.kv_cache_memory
    unpooled: ModelRunner | None = None  # weights loaded first, the pool sized from what is left
    if defaults.sizes_kv_from_memory and runner is None:
        # Weights first, then the largest step the scheduler can build, once, on a scratch pool:
        # it measures the activation peak when the pool is sized from GPU memory, and it compiles
        # the step's Triton kernels at start-up rather than in the first request.
        unpooled = new_runner(model_dir, mc, device, dtype, block_size, None, max_batched, max_model_len, config)
        if kv_memory is None:
            kv_memory = unpooled.measure_kv_budget(
                config.gpu_memory_utilization, 0 if config.enforce_eager else defaults.graph_reserve_bytes
            )
        else:
            unpooled.warm_up()
            platform_of(device).release_cached_memory()
    if kv_memory is None:
        kv_memory = defaults.kv_cache_memory
    if kv_memory is None:  # an injected runner, where the pool is sized from memory
        if runner is None or runner.kv_pool is None:
            raise ValueError(f"an injected runner on {device} needs kv_cache_memory or a kv_pool")
        kv_memory = runner.kv_pool.nbytes
    target_kv = (
        kv_memory if draft is None else target_share(kv_memory, mc, draft[1], kv_dtype)
    )  # the draft's pool has as many blocks
    if config.max_model_len is None and not defaults.sizes_kv_from_memory:
        # The pool's size is known before any weights: serve the model's whole context when it fits (a
        # 16k-token prompt to a 32k model is not a 400 by default), as vLLM does on a GPU.
        pool_tokens = target_kv // (kv_bytes_per_token(mc, kv_dtype) // tp * block_size) * block_size
        max_model_len = resolve_max_model_len(mc, None, defaults.sliding_window, pool_tokens)
    # Under tensor parallelism the budget is each rank's, as vLLM's memory settings are per GPU.
    capacity = plan_capacity(
        mc, dtype, target_kv, block_size, max_model_len, stored_weight_bytes(model_dir), kv_dtype, tp
    )
    log.info("KV capacity: %s", capacity.describe())

    resolved = dataclasses.replace(
        config,
        device=str(device),
        dtype=DTYPE_NAMES.get(dtype, str(dtype)),
        kv_cache_dtype=DTYPE_NAMES.get(kv_dtype, str(kv_dtype)),
        block_size=block_size,
        kv_cache_memory=kv_memory,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_batched,
    )
    gguf = Path(config.model).suffix == ".gguf" if config.model else False
    served_model_name = config.served_model_name or (Path(config.model).stem if gguf else model_dir.name)  # type: ignore[arg-type]
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    eos_token_ids = eos_ids(model_dir, mc, tokenizer)

    num_blocks = capacity.num_blocks
    if runner is not None:
        # A runner built elsewhere (tests, device checks) must match the blocks handed out here.
        if runner.block_size != block_size:
            raise ValueError(f"the runner's KV pool uses block_size {runner.block_size}, the engine {block_size}")
        if runner.kv_pool is not None and runner.kv_pool.num_blocks < num_blocks:
            raise ValueError(
                f"the runner's KV pool has {runner.kv_pool.num_blocks} blocks, the KV budget asks for {num_blocks}"
            )
    if unpooled is not None:
        unpooled.allocate_kv_pool(num_blocks)
        runner = unpooled
    elif runner is None:
        runner = new_runner(model_dir, mc, device, dtype, block_size, num_blocks, max_batched, max_model_len, config)
    block_manager = BlockManager(
        num_blocks,
        block_size,
        config.enable_prefix_caching,
        kv_events=bool(kv_events and kv_events.active),
        window=released_window(mc, runner, config),
    )
    proposer: Proposer | None = None
    if draft is not None:
        draft_config = dataclasses.replace(
            config,
            gguf_activations=config.gguf_activations
            if serves_as_stored(draft[0], config.quantization, device, dtype)
            else "float32",
        )
        draft_runner = new_runner(
            draft[0], draft[1], device, dtype, block_size, num_blocks, max_batched, max_model_len, draft_config
        )
        proposer = new_draft_proposer(speculative, *draft, draft_runner, config.seed, max_model_len)  # type: ignore[arg-type]
    elif speculative is not None:
        proposer = NgramProposer(speculative)  # type: ignore[arg-type]
        log.info("speculative decoding: %s", proposer.config)
    scheduler = Scheduler(
        block_manager,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max_batched,
        policy=config.scheduling_policy,
        proposer=proposer,
        max_loras=config.max_loras if enable_lora else None,
        max_request_share=config.max_request_share,
    )

    # Default: on where the forward runs in the background (CUDA), off elsewhere.
    ahead = defaults.async_scheduling if config.async_scheduling is None else config.async_scheduling
    if ahead and speculative is not None:
        log.warning(
            "speculative decoding needs each step's tokens before the next is scheduled: off while scheduling ahead"
        )
    if ahead and not defaults.async_scheduling:
        log.warning(
            "--async-scheduling on %s: the forward does not run in the background here, so every token "
            "reaches its client one step later and nothing is overlapped",
            device,
        )
    return StartUp(
        config=resolved,
        model_dir=model_dir,
        model_config=mc,
        device=device,
        dtype=dtype,
        capacity=capacity,
        served_model_name=served_model_name,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        runner=runner,
        async_scheduling=ahead,
        enable_lora=enable_lora,
        block_manager=block_manager,
        proposer=proposer,
        scheduler=scheduler,
        kv_events=make_publisher(kv_events),  # last: its sockets open once nothing else can fail
    )


def released_window(mc: ModelConfig, runner: RunnerLike, config: EngineConfig) -> int | None:
    """The sliding window whose left-behind blocks the pool hands back: where the model has windowed
    layers and the pool's memory can be handed back piecewise (one process's CPU pool)."""
    pool = runner.kv_pool
    if (
        config.swa_full
        or not mc.window_layers
        or pool is None
        or not pool.releases_pages
        or config.tensor_parallel_size > 1
    ):
        return None
    return mc.sliding_window


def new_runner(
    model_dir: Path,
    mc: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    num_blocks: int | None,
    max_batched: int,
    max_model_len: int,
    config: EngineConfig,
) -> ModelRunner:
    """The real runner for the settled configuration (``num_blocks`` None: its pool comes later);
    under tensor parallelism rank 0's, its workers spawned and loading their shards alongside."""
    kwargs: dict[str, Any] = dict(
        device=device,
        dtype=dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_batched,
        max_num_seqs=config.max_num_seqs,
        seed=config.seed,
        max_model_len=max_model_len,
        enforce_eager=config.enforce_eager,
        # auto is int4 only where that is exact and runs: never under tensor parallelism (shards
        # run unquantized there), as on CUDA.
        quantization=None if config.tensor_parallel_size > 1 and config.quantization == "auto" else config.quantization,
        kv_dtype=resolve_kv_dtype(config.kv_cache_dtype, dtype, device),
        gguf_activations=config.gguf_activations,
    )
    tp = config.tensor_parallel_size
    if tp == 1:
        return ModelRunner(model_dir, mc, **kwargs)
    from servelm.runtime.distributed.launcher import TensorParallelGroup  # torch.distributed only when asked

    # The ranks share the host's cores: each gets its part of them unless --num-threads says otherwise.
    threads = config.num_threads or max(1, torch.get_num_threads() // tp)
    torch.set_num_threads(threads)
    log.info("tensor parallelism: %d ranks (this process is rank 0), %d torch thread(s) each", tp, threads)
    return TensorParallelGroup(tp, num_threads=threads, device=device).load(model_dir, **kwargs)


def check_tensor_parallel_serving(
    config: EngineConfig, mc: ModelConfig, model_dir: Path, device: torch.device, enable_lora: bool, injected: bool
) -> None:
    """Refuse, by name and before anything loads, what ``--tensor-parallel-size`` does not serve yet."""
    from servelm.runtime.config import UnsupportedModelError
    from servelm.runtime.distributed.sharding import check_tensor_parallel

    n = config.tensor_parallel_size
    if n < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {n}")
    if injected:
        raise ValueError("--tensor-parallel-size starts its own runners: it cannot be given an injected runner")
    if enable_lora:
        raise UnsupportedModelError(
            "LoRA adapters (--enable-lora, --lora-modules) are not supported with --tensor-parallel-size > 1 yet"
        )
    check_tensor_parallel(mc, n, device=device, model_dir=model_dir, quantization=config.quantization)
