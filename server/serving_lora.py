"""LoRA adapters over HTTP: model cards, and vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.

A request's ``model`` names the base model or one of the adapters (``ServingContext.resolve_model``).
Adapters come from ``--lora-modules`` at start-up and, with ``--allow-runtime-lora-updating``, from
these endpoints: the folder is read and checked in a worker thread (the engine keeps stepping), then
handed to the engine thread between two steps. Unloading stops new requests at once; requests already
queued with the adapter finish with it. Beyond ``--max-cpu-loras`` loaded adapters the engine unloads
the least recently used one no request uses; its name stays served and a request naming it has it
read again (``serving_common.add_requests``); with every loaded adapter in use, a 429.
"""

from __future__ import annotations

from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict, Field

from servelm.scheduler.lora_registry import LoRALimitError
from servelm.server.errors import APIError, bad_request, lora_limit_reached
from servelm.server.limits import MAX_LORA_NAME_CHARS, MAX_PATH_CHARS, RequestBody
from servelm.server.protocol import ModelCard
from servelm.server.serving_common import ServingContext, engine_error


class LoadLoRAAdapterRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


class UnloadLoRAAdapterRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_int_id: int | None = None  # vLLM's; ignored (names are unique)


def lora_cards(ctx: ServingContext) -> list[ModelCard]:
    return [
        ModelCard(
            id=name, created=ctx.created, root=path, parent=ctx.served_model_name, max_model_len=ctx.max_model_len
        )
        for name, path in ctx.loras.items()
    ]


async def load_lora_adapter(ctx: ServingContext, req: LoadLoRAAdapterRequest) -> PlainTextResponse:
    name = req.lora_name
    if name == ctx.served_model_name or name in ctx.loras:
        raise bad_request(
            f"The lora adapter '{name}' has already been loaded.", param="lora_name", code="lora_adapter_exists"
        )
    try:
        async with ctx.lora_reads:  # one read at a time: each holds a whole adapter until the engine takes it
            adapter = await ctx.async_engine.read_lora(req.lora_path)
            await ctx.async_engine.call("loras.add", name, adapter)
    except ValueError as e:  # runtime.lora.LoRAError: the folder, or the name, is not servable
        raise bad_request(
            f"Cannot load LoRA adapter '{name}': {e}", param="lora_path", code="invalid_lora_adapter"
        ) from None
    except LoRALimitError as e:
        raise lora_limit_reached(f"Cannot load LoRA adapter '{name}': {e}.", param="lora_name") from None
    except APIError:
        raise
    except Exception as e:  # engine gone, shutting down...: the right status
        raise engine_error(e) from None
    ctx.loras[name] = adapter.path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(ctx: ServingContext, req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
    name = req.lora_name
    if name not in ctx.loras:
        raise APIError(
            404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_adapter_not_found"
        )
    del ctx.loras[name]  # new requests naming it get 404 from now on
    try:
        await ctx.async_engine.call("loras.remove", name)
    except Exception as e:
        raise engine_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


__all__ = [
    "LoadLoRAAdapterRequest",
    "UnloadLoRAAdapterRequest",
    "load_lora_adapter",
    "lora_cards",
    "unload_lora_adapter",
]
