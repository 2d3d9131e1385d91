"""``servelm``: the command line (``serve``, plus ``bench`` and ``plan`` from their own modules)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from servelm.scheduler.config import EngineConfig
from servelm.server.cli_serve import make_uvicorn_server as _make_uvicorn_server
from servelm.server.cli_serve import serve_api
from servelm.server.cli_types import (
    fraction,
    kv_events_config,
    lora_module,
    parse_size,
    positive_float,
    positive_int,
    speculative_config,
)
from servelm.server.reasoning.parsers import PARSERS as REASONING_PARSERS
from servelm.server.tool_parsers import PARSERS as TOOL_PARSERS

# runtime.quantization.QUANTIZATIONS, spelled out here: this module must not import torch (`servelm bench`
# and `--help` stay light); a test keeps the two equal.
QUANTIZATIONS = ("int8", "int4", "auto", "none")

log = logging.getLogger("servelm")

# Above --max-waiting-requests' default plus --max-num-seqs': the queue's own 503 (OpenAI-shaped, with
# Retry-After) comes first.
DEFAULT_MAX_CONNECTIONS = 2048
# Time to a complete request head: generous for a slow link (a head is a few hundred bytes), short
# enough that stalled connections do not pile up.
DEFAULT_HEADER_TIMEOUT_S = 20.0
# Time from a complete head to a complete body: a 32 MiB body needs ~4.5 Mbit/s; a client that drips
# one holds its connection no longer.
DEFAULT_BODY_TIMEOUT_S = 60.0

# ---------------------------------------------------------------------------------------- serve


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a Llama-family model over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
    )
    d = EngineConfig()
    # One flag a line: the table of serve's flags, which docs/configuration.md is generated from.
    # fmt: off
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, action=ModelFlag, help="Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct); given again, each is one more model of the server, loaded when a request names it (the first is the default). See docs/models-several.md")
    g.add_argument("--models-file", default=None, metavar="PATH", help="a YAML file of models to serve, each with its id, path, aliases, keep_alive and flags of its own (quantization, kv_cache_memory, tool_call_parser...), loaded when a request names them; after those of --model. See docs/models-several.md (default: none)")
    g.add_argument("--models-memory-budget", type=parse_size, default=None, help="with several models: the memory the loaded ones may take together, e.g. 8GiB (each counted as its weight files plus its KV pool); the least recently used idle model is unloaded to load one that does not fit (default: no budget)")
    g.add_argument("--keep-alive", default=None, metavar="DURATION", help="with several models: how long an idle model stays loaded, as Ollama's keep_alive (5m, 1h, 30s; 0: unloaded when its last request ends; -1: kept); a model's own keep_alive and a request's come first (default: kept)")
    g.add_argument("--served-model-name", default=None, help="model id clients send and /v1/models lists (default: the model folder name)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--chat-template", default=None, metavar="PATH|TEMPLATE", help="render chat requests (chat, Responses, Messages, /tokenize) with this Jinja chat template instead of the model's own, as vLLM's flag: a file, or the template itself (a value holding {, } or a newline that names no file). Checked before the model loads: it must compile and render a one-message conversation. GET /props shows the template served. See docs/tools.md (default: the model's own)")
    g.add_argument("--chat-template-as-stored", action="store_true", help="serve the model's own chat template exactly as its files store it. By default servelm corrects the known quirks of a few published templates (server/template_fixes.py; e.g. the Qwen2.5-Coder-1.5B GGUF's tool-call example with doubled braces, which the model copies) and logs each correction; GET /props shows the template served")
    g.add_argument("--trust-request-chat-template", action="store_true", help="let a chat request's chat_template field replace the served template, as vLLM's flag: the client's Jinja then runs in the server (sandboxed, its work unbounded), so for trusted clients only; without it such a request gets a 400 naming chat_template")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None, help="split the thinking a reasoning model writes before its answer (<think>...</think>) into chat's reasoning_content, a Responses reasoning item and Messages thinking blocks, as vLLM's flag: qwen3 (Qwen3, SmolLM3, QwQ), deepseek_r1 (DeepSeek-R1 and its distills, which think first even without <think>); constrained outputs then constrain the answer after the thinking. See docs/reasoning.md (default: off, the text is all answer)")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None, help="read tool calls in the model's own format, as vLLM's flag: hermes (Qwen2.5, Qwen3: <tool_call>{...}</tool_call>), llama3_json (Llama 3.x JSON, after <|python_tag|> or alone), mistral ([TOOL_CALLS]), granite (<|tool_call|>[...]); the tools then go to the chat template, required and named calls are held to the family's format by the grammar, and calls stream as their arguments arrive. See docs/tools.md (default: off, one JSON-array convention for every model)")
    g.add_argument("--split-special-tokens-in-content", action=argparse.BooleanOptionalAction, default=True, help="encode the special tokens a client's chat text spells (<|im_start|> typed in a message, a system or tool text, tool schemas, call arguments) as plain text on /v1/chat/completions, /v1/responses, /v1/messages and /tokenize, so only the chat template's own markers are control tokens and a client cannot forge a turn; --no-split-special-tokens-in-content reads them as tokens, as vLLM does. /v1/completions prompts are raw text either way: their special tokens are tokens. See docs/errors.md (default: on)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", help="with --tool-call-parser: tool_choice auto lets the model write a text answer or calls in its own format (the grammar takes over at its start marker); without it auto is refused, as in vLLM")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"], help="weight and KV dtype (default: auto = float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "float32", "bfloat16", "float16"], help="KV cache dtype (default: auto = --dtype, or float16 where a GGUF file runs with int8 activations, as llama.cpp's default cache). On CPU, bfloat16 or float16 under float32 weights halve the KV pool's bytes per token, as llama.cpp's f16 cache does; attention still computes in float32, but greedy tokens are then no longer exactly transformers' float32 ones. On CUDA it must equal --dtype")
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N] (default: auto = cuda when available)")
    g.add_argument("--max-model-len", type=positive_int, default=None, help="longest prompt + completion in tokens (default: the model's max positions where the KV pool holds them, else what it holds, at least min(them, 8192); on CUDA min(them, 8192))")

    g = p.add_argument_group("memory and batching")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV pool size, e.g. 2GiB, 512MiB or bytes (default: 2 GiB on CPU)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=d.gpu_memory_utilization, help="CUDA: fraction of device memory for weights + KV pool (default: %(default)s)")
    g.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block (default: 16 on CPU; what the attention backend needs on CUDA)")
    g.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs, help="most sequences in one engine step (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget of one engine step; longer prompts are chunked (default: 512 on CPU, 8192 on CUDA)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching, help="reuse KV blocks of identical prompt prefixes (default: on)")
    g.add_argument("--swa-full", action="store_true", help="keep every position of a model's sliding-window layers, as llama.cpp's --swa-full: a prefix shared by later requests then hits wherever it ends, for more memory. By default (CPU) the blocks every window has left give their windowed layers' memory back, and a hit is cut back to where the window before it is whole: the end of a prompt seen before, of a whole earlier sequence, or of a prefix an earlier prompt shared (so a shared prefix is recomputed once at most)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority", "static"], default=d.scheduling_policy, help="fcfs: continuous batching, first come first served; priority: the same, requests admitted by their 'priority' (lower first, then arrival) and the lowest-priority one preempted first; static: run each admitted batch to completion, for comparison only (default: %(default)s)")
    g.add_argument("--max-waiting-requests", type=positive_int, default=d.max_waiting_requests, help="queue bound in sequences: beyond it requests get 503 with Retry-After (default: %(default)s)")
    g.add_argument("--max-request-share", type=fraction, default=d.max_request_share, help="while other requests wait, one request's sequences (its n choices, its prompts) hold at most this share of --max-num-seqs and of the KV blocks: its further sequences wait, and its latest give way to a waiting request (preempted by recompute); its first sequence is never held back; 1 turns the bound off (default: %(default)s)")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: do not capture CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None, help="schedule the next step while the device computes this one; its host work (outputs, detokenization) then overlaps the device (default: on for CUDA, off for CPU, where nothing runs in the background)")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=d.quantization, help="weight-only quantization (CPU, float32 activations). int8: projections and vocabulary head in int8, one float32 scale per output row: a quarter of the weight bytes a decode step reads; tokens differ from the float32 model's. int4: projections in 4 bits, groups of 32 with an fp16 scale and minimum (llama.cpp's Q4_1), head in int8 groups of 32 (Q8_0): a sixth of the bytes; exact for the default model, which ships in those formats. auto: int4 where that is exact for the checkpoint's weights (checked at load: the default model, or a model dequantized from such a GGUF file), else none; for a GGUF file on CPU float32, the weights as stored in the file (as they are by default too). none: no quantization; a GGUF file is then dequantized into --dtype (default: %(default)s, which changes no token: it only takes int4 where the weights already are int4's values)")
    g.add_argument("--gguf-activations", choices=["auto", "float32", "int8"], default=d.gguf_activations, help="what a GGUF file's quantized projections multiply (CPU, weights as stored). int8: activations rounded to int8 per block of 32 (256 for K-quants) and integer dot products, llama.cpp's arithmetic, with a float16 KV cache unless --kv-cache-dtype says otherwise: the fast one; tokens may differ from transformers' float32 ones. float32 (exact mode): the activations as they are and a float32 cache, so logits equal transformers' float32 ones within summation noise. auto: int8 for a GGUF file served as stored, else float32 (default: %(default)s)")
    g.add_argument("--num-threads", type=positive_int, default=None, help="CPU: torch intra-op threads (default: torch's choice)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=d.tensor_parallel_size, help="split the model Megatron-style over N ranks: this process is rank 0 (scheduler, sampling), N-1 worker processes are spawned, joined over torch.distributed (gloo on CPU); --kv-cache-memory is then each rank's pool, --num-threads each rank's threads, the cores / N when not given. Refused by name: LoRA, --quantization, GGUF files, CUDA (unproven), shapes not divisible by N. See docs/tensor-parallel.md (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="sampling seed for requests without one (default: %(default)s)")
    g.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON", help='speculative decoding, as vLLM\'s: by n-gram lookup, \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "max_running": 1}\', or with a draft model of the same vocabulary (a folder or a GGUF file; its KV pool has as many blocks as the model\'s, from the same --kv-cache-memory), \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3, "max_running": 1}\' (greedy and unseeded sampled requests without penalties; drafts only while at most max_running requests run; off while scheduling ahead; a draft model not with LoRA) (default: off)')
    g.add_argument("--kv-events-config", type=kv_events_config, default=None, metavar="JSON", help='publish KV-cache events (blocks entering and leaving the prefix cache) for KV-aware routers such as vllm-router --policy kv_aware, as vLLM\'s: \'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000}\' (ZMQ PUB of msgpack batches; they carry prompts\' token ids: without an endpoint it binds --host, port 5557; a wildcard or other non-loopback endpoint is logged with a warning; see docs/scale-out.md) (default: off)')

    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders) beside the base model, chosen per request by the 'model' field")
    g.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=[], metavar="NAME=PATH", help="adapters served from start-up, as name=path or vLLM's JSON '{\"name\": ..., \"path\": ...}' (implies --enable-lora)")
    g.add_argument("--max-loras", type=positive_int, default=d.max_loras, help="most distinct adapters among running requests; requests of another adapter wait (default: %(default)s)")
    g.add_argument("--max-cpu-loras", type=positive_int, default=None, help="most adapters kept loaded in memory, at least --max-loras: beyond it the least recently used adapter no unfinished request uses is unloaded, its name still served and its folder read again when a request names it; when every loaded adapter is in use, a load or a request for an unloaded one gets 429 (default: --max-loras)")
    g.add_argument("--max-lora-rank", type=positive_int, default=d.max_lora_rank, help="adapters of a higher rank are refused (default: %(default)s)")
    g.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction, default=os.environ.get("SERVELM_ALLOW_RUNTIME_LORA_UPDATING", "") not in ("", "0", "false", "False"), help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which read folders of the server's file system: for trusted clients only (default: $SERVELM_ALLOW_RUNTIME_LORA_UPDATING; off)")

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all interfaces (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one and logs it (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("SERVELM_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: $SERVELM_API_KEY; unset = open)")
    g.add_argument("--max-request-bytes", type=parse_size, default=None, help="largest /v1, /tokenize or /detokenize request body, e.g. 32MiB or bytes; a larger one gets 413 before it is parsed (default: 32MiB)")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get to finish on SIGTERM/SIGINT; those still running then end with a 'server shutting down' error (an error event and [DONE] on streams, response.failed on Responses streams, 503 otherwise) (default: %(default)s)")
    g.add_argument("--header-timeout", type=positive_float, default=DEFAULT_HEADER_TIMEOUT_S, help="seconds a connection gets to send a complete request head, from its opening or its previous response; then it is closed (half-sent headers hold no connection for ever) (default: %(default)s)")
    g.add_argument("--body-timeout", type=positive_float, default=DEFAULT_BODY_TIMEOUT_S, help="seconds a request gets to send its whole body once its head is complete; then it gets a 408 (if no response has started) and the connection is closed (dripped bodies hold no connection for ever) (default: %(default)s)")
    g.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, help="most HTTP connections (idle keep-alive ones included) and in-flight requests served at once; a request on one more connection gets uvicorn's plain-text 503 and the connection is closed, except body-less GET/HEAD /health, /live and /metrics, answered and then closed (default: %(default)s)")
    g.add_argument("--playground", action=argparse.BooleanOptionalAction, default=True, help="serve the chat page at / and /playground (it calls /v1/* with the key typed into it); --no-playground leaves / a JSON 404 (default: on)")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True, help="log one line per HTTP request (default: on)")
    g.add_argument("--api-server-count", type=positive_int, default=1, help="HTTP API processes in front of the one engine core, sharing the port (SO_REUSEPORT: the kernel spreads connections): for the CPU cost of HTTP, JSON and tokenizing at high concurrency; each loads its own tokenizer (default: %(default)s)")
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1, help="engine cores behind the API process, each a whole copy of the model with its own KV pool: one per GPU (N x --tensor-parallel-size GPUs needed; CUDA_VISIBLE_DEVICES chooses which), on CPU each pinned to its share of the allowed CPUs with that many threads (--num-threads overrides). A request goes to the least-loaded core (4 x waiting + running + KV use), or to the core its prompt's first KV blocks hash to unless that one is overloaded, so a shared prefix meets its prefix cache; /metrics labels every core's series engine=\"i\". With --api-server-count every API process talks to every core. One core's death stops the server (exit status 1). Not with --engine-in-process or several models (default: %(default)s)")
    g.add_argument("--engine-in-process", action="store_true", help="step the engine in a thread of the HTTP server's process instead of an engine-core process of its own (for debugging: tokenizing, HTTP and JSON then share one interpreter with the engine loop)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity (default: %(default)s)")
    # fmt: on
    p.set_defaults(func=run_serve, more_models=[])
    return p


class ModelFlag(argparse.Action):
    """``--model``: the first is ``args.model`` (the one-model server's, as it always was), the
    others go to ``args.more_models``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is None:
            setattr(namespace, self.dest, values)
        else:
            namespace.more_models = [*getattr(namespace, "more_models", []), values]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        swa_full=args.swa_full,
        scheduling_policy=args.scheduling_policy,
        max_waiting_requests=args.max_waiting_requests,
        max_request_share=args.max_request_share,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        quantization=args.quantization,
        gguf_activations=args.gguf_activations,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed,
        speculative_config=args.speculative_config,
        kv_events_config=args.kv_events_config,
        host=args.host,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
    )


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from servelm.runtime.capacity import CapacityError
    from servelm.runtime.config import UnsupportedModelError
    from servelm.server.app import ObserverProxy, create_prometheus_observer
    from servelm.server.async_engine import AsyncEngine
    from servelm.server.engine_info import serving_engine
    from servelm.server.engine_thread import run_in_transient_thread
    from servelm.server.heap import return_free_heap

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        log.error(
            "cannot start: --enable-auto-tool-choice needs --tool-call-parser (the format the model writes calls in)"
        )
        return 1
    chat_template = None
    if args.chat_template is not None:
        from servelm.server.chat_template import check_chat_template, load_chat_template

        try:  # before the model loads: a bad template should not wait for it
            chat_template = load_chat_template(args.chat_template)
            check_chat_template(chat_template)
        except ValueError as e:
            log.error("cannot start: --chat-template: %s", e)
            return 1
    config = engine_config_from_args(args)
    if args.api_server_count > 1 and (args.engine_in_process or args.more_models or args.models_file):
        log.error("cannot start: --api-server-count needs the engine-core process and one model")
        return 1
    several = (
        args.more_models or args.models_file or args.models_memory_budget is not None or args.keep_alive is not None
    )
    if args.data_parallel_size > 1 and (args.engine_in_process or several):
        log.error("cannot start: --data-parallel-size needs the engine-core process and one model")
        return 1
    if several:
        from servelm.server.cli_models import run_models

        return run_models(args, config, _make_uvicorn_server)
    metrics_registry = None
    if args.engine_in_process:
        proxy = ObserverProxy()

        def build() -> tuple[Any, Any]:
            engine = serving_engine(config, proxy)
            return engine, create_prometheus_observer(engine)  # (measures the CPU peaks)

        try:
            # Not in the main thread: it must not keep an OpenMP team beside the engine thread's.
            engine, observer = run_in_transient_thread(build)
        except (CapacityError, UnsupportedModelError, ValueError) as e:
            log.error("cannot start: %s", e)
            return 1
        proxy.target = observer
        metrics_registry = getattr(observer, "registry", None)
        async_engine = AsyncEngine(engine, observer=proxy, max_waiting_requests=engine.config.max_waiting_requests)
    else:
        from servelm.server.engine_process import EngineStartError, start_engine_core

        try:  # the engine builds and steps in an engine-core process (docs/architecture.md)
            if args.data_parallel_size > 1:
                from servelm.server.data_parallel import start_data_parallel

                n = args.data_parallel_size
                async_engine = start_data_parallel(config, n, args.log_level, args.api_server_count)
            else:
                async_engine = start_engine_core(config, args.log_level, args.api_server_count)
        except EngineStartError as e:
            log.error("cannot start: %s", e)
            return 1
    info = async_engine.info
    log.info("model %s (%s); capacity: %s", info.served_model_name, info.config.model or "default", info.capacity)
    # Loading's garbage (for Gemma 3 270M the tokenizer's, ~280 MiB) stays resident otherwise.
    return_free_heap()
    if args.api_server_count > 1:
        from servelm.server.api_servers import serve_behind_api_processes

        return serve_behind_api_processes(args, async_engine, chat_template, _make_uvicorn_server)
    return serve_api(args, async_engine, chat_template, metrics_registry, _make_uvicorn_server)


# ----------------------------------------------------------------------------------------- main


def _add_delegated(subparsers: Any, module: str, name: str, help_text: str) -> None:
    """``bench`` and ``plan`` live in their own modules; a build without them still serves."""
    try:
        mod = __import__(module, fromlist=["add_parser", "run"])
        p = mod.add_parser(subparsers)
        p.set_defaults(func=mod.run)
    except ImportError as e:
        p = subparsers.add_parser(name, help=f"{help_text} (unavailable: {e})")
        p.set_defaults(func=lambda _a, _e=e: _unavailable(name, _e))


def _unavailable(name: str, e: Exception) -> int:
    print(f"servelm {name} is unavailable in this build: {e}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelm", description="An OpenAI-compatible LLM serving daemon.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,bench,plan}")
    add_serve_parser(sub)
    _add_delegated(sub, "servelm.bench.loadgen", "bench", "load-test an OpenAI-compatible server")
    _add_delegated(sub, "servelm.bench.plan", "plan", "plan KV capacity for a model and device")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
