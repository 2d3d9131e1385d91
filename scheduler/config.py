"""The one configuration dataclass, built from the CLI (``servelm serve``) or by hand in tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Everything the engine needs to start; ``None`` means "derive a default at start-up"."""

    model: str | None = None  # HF folder, .gguf file, or None for the embedded default model
    served_model_name: str | None = None
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"  # auto => float32 on CPU, bfloat16 on CUDA
    kv_cache_dtype: str = "auto"  # auto => dtype, float16 with int8 GGUF activations; bfloat16/float16 halve a float32 model's KV pool (CPU)
    device: str = "auto"  # auto => cuda when available, else cpu
    block_size: int | None = None  # None => 16 on CPU, what the attention backend needs on CUDA
    kv_cache_memory: int | None = None  # bytes for the KV pool (CPU); None => 2 GiB on CPU
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = (
        None  # None => the model's max positions as far as the KV pool holds them (CPU), else min(them, 8192)
    )
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None => 512 on CPU, 8192 on CUDA
    enable_prefix_caching: bool = True
    swa_full: bool = (
        False  # keep sliding-window layers' K/V of every position (by default CPU pools hand back what windows left)
    )
    scheduling_policy: str = (
        "fcfs"  # "fcfs" (continuous batching) | "priority" (the same, by request priority) | "static"
    )
    max_waiting_requests: int = 1024
    max_request_share: float = (
        0.5  # of the slots and KV blocks one request's sequences may hold while others wait (1: no bound)
    )
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    async_scheduling: bool | None = (
        None  # schedule step k+1 before step k's tokens reach the host; None => on CUDA only
    )
    quantization: str | None = (
        "auto"  # "int8" | "int4" (weight-only, CPU float32) | "auto": int4 where exact, else none | "none"
    )
    gguf_activations: str = (
        "auto"  # auto => "int8" for a GGUF file served as stored (llama.cpp's arithmetic), else "float32" (exact)
    )
    num_threads: int | None = None  # CPU: torch intra-op threads (None => torch's default)
    tensor_parallel_size: int = 1  # ranks the model is split over (rank 0 in this process, workers spawned)
    seed: int = 0  # for requests without a seed
    # Speculative decoding, vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 3, ...}' (None => off)
    speculative_config: str | None = None
    # KV-cache events for KV-aware routers, vLLM's JSON: '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    kv_events_config: str | None = None
    host: str = "127.0.0.1"  # where HTTP listens: KV events bind there when their endpoint is not given
    # LoRA adapters (PEFT folders) served by name beside the base model
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start-up (implies enable_lora)
    max_loras: int = 4  # most distinct adapters among running requests
    max_cpu_loras: int | None = (
        None  # most adapters kept loaded (least recently used unloaded first); None => max_loras
    )
    max_lora_rank: int = 64  # adapters of a higher rank are refused
