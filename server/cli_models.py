"""``servelm serve`` with several models (``--model`` given again, ``--models-file``, a memory budget
or ``--keep-alive``): the model registry, each model loaded when a request first names it."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from servelm.scheduler.config import EngineConfig
from servelm.server.model_specs import (
    ModelSpec,
    ModelSpecError,
    estimate_memory,
    parse_keep_alive,
    read_models_file,
    specs_from_entries,
)

log = logging.getLogger("servelm")


def model_specs(args: argparse.Namespace, base: EngineConfig) -> tuple[list[ModelSpec], int | None]:
    """The models the flags and the models file name, and the memory budget (the flag's, else the file's)."""
    from servelm.scheduler.encoder_engine import is_encoder_model
    from servelm.server.cli_types import parse_size

    options = {
        "tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser,
        "enable_auto_tool_choice": args.enable_auto_tool_choice, "chat_template": args.chat_template,
    }  # fmt: skip
    keep = parse_keep_alive(args.keep_alive) if args.keep_alive is not None else None
    entries: list[Any] = []
    if args.model is not None or not args.models_file:
        entries = [{"path": args.model}] + [{"path": p} for p in args.more_models]
        if args.served_model_name:
            entries[0]["id"] = args.served_model_name
    budget = args.models_memory_budget
    if args.models_file:
        more, settings = read_models_file(args.models_file)
        entries += more
        if budget is None and settings.get("memory_budget") is not None:
            try:
                budget = parse_size(str(settings["memory_budget"]))
            except Exception as e:
                raise ModelSpecError(f"--models-file: memory_budget: {e}") from None
    specs = specs_from_entries(entries, base, options)
    for spec, entry in zip(specs, entries, strict=True):
        if "keep_alive" not in entry:
            spec.keep_alive_s = keep
        spec.memory_bytes = estimate_memory(spec.config, is_encoder_model)
    return specs, budget


def configure_serving(ctx: Any, spec: ModelSpec, args: argparse.Namespace) -> None:
    """A loaded model's serving options: its own (models file), else the server's flags."""
    from servelm.server.chat_template import check_chat_template, load_chat_template
    from servelm.server.reasoning.parsers import PARSERS as REASONING_PARSERS
    from servelm.server.tool_parsers import PARSERS as TOOL_PARSERS

    o = spec.options
    ctx.reasoning_parser = REASONING_PARSERS[o["reasoning_parser"]] if o.get("reasoning_parser") else None
    ctx.tool_parser = TOOL_PARSERS[o["tool_call_parser"]] if o.get("tool_call_parser") else None
    ctx.auto_tool_choice = bool(o.get("enable_auto_tool_choice"))
    ctx.split_special_tokens_in_content = args.split_special_tokens_in_content
    ctx.trust_request_chat_template = args.trust_request_chat_template
    template = None
    if o.get("chat_template"):
        template = load_chat_template(o["chat_template"])
        check_chat_template(template)
    elif not args.chat_template_as_stored:
        template = corrected_own_template(ctx)
    ctx.chat_template = template


def corrected_own_template(serving: Any) -> str | None:
    """The model's own template with its known quirks corrected (None: served as stored)."""
    from servelm.server.chat_template import served_chat_template
    from servelm.server.template_fixes import fix_known_quirks

    own = served_chat_template(serving)
    if own is None:
        return None
    fixed, applied = fix_known_quirks(own)
    if not applied:
        return None
    log.info(
        "chat template: the model's own, with %s corrected (--chat-template-as-stored serves it as stored)",
        ", ".join(applied),
    )
    return fixed


def run_models(args: argparse.Namespace, base: EngineConfig, make_server: Callable[..., Any]) -> int:
    from prometheus_client import CollectorRegistry

    import servelm.server.app as app_module
    from servelm.metrics.models import ModelMetrics
    from servelm.runtime.platform import platform_of, resolve_device
    from servelm.server.engine_info import serving_engine
    from servelm.server.model_registry import ModelRegistry

    try:
        specs, budget = model_specs(args, base)
    except (ModelSpecError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
    bad = [
        s.id for s in specs if s.options.get("tool_call_parser") is None and s.options.get("enable_auto_tool_choice")
    ]
    if bad:
        log.error("cannot start: enable_auto_tool_choice needs tool_call_parser (models %s)", ", ".join(bad))
        return 1

    def build(spec: ModelSpec, observer: Any) -> tuple[Any, Any]:
        engine = serving_engine(spec.config, observer)
        return engine, app_module.create_prometheus_observer(engine, registry=CollectorRegistry())

    registry = ModelRegistry(
        specs,
        build,
        memory_budget=budget,
        configure=lambda ctx, spec: configure_serving(ctx, spec, args),
        metrics=ModelMetrics(),
    )
    for spec in specs:
        keep = "kept" if spec.keep_alive_s is None else f"{spec.keep_alive_s:g} s"
        log.info(
            "model %s (%s): ~%.0f MiB, keep-alive %s",
            spec.id,
            spec.config.model or "default",
            spec.memory_bytes / 2**20,
            keep,
        )
    if budget is not None:
        log.info("models memory budget: %.0f MiB", budget / 2**20)
    interval = platform_of(resolve_device(base.device)).gil_switch_interval
    if interval is not None:
        sys.setswitchinterval(interval)
    app = app_module.build_app(
        registry=registry, api_key=args.api_key or None, drain_timeout_s=args.drain_timeout,
        max_request_bytes=args.max_request_bytes, allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        playground=args.playground,
    )  # fmt: skip
    server = make_server(app, args, lambda: registry.begin_drain(args.drain_timeout))
    server.drained = lambda: registry.drained(args.drain_timeout)
    return serve_until_stopped(server, lambda: registry.dead_reason)


def serve_until_stopped(server: Any, dead_reason: Callable[[], object], sock: Any = None) -> int:
    """Run ``server`` until a signal drains and stops it: exit status 0, or 1 where it never started or
    an engine died (a tensor-parallel worker lost: a supervisor restarts it)."""
    # uvicorn re-raises the signal that stopped it once it has shut down, with the handlers it found
    # installed; make those no-ops so a graceful SIGTERM/SIGINT ends with exit status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    if sock is None:
        server.run()
    else:
        server.run(sockets=[sock])
    if not server.started:
        return 1
    log.info("servelm stopped")
    return 1 if dead_reason() else 0


__all__ = ["corrected_own_template", "model_specs", "run_models", "serve_until_stopped"]
