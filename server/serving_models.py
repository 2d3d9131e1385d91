"""``/v1/models`` over the model registry: every model with its state on a server of several models,
the one model and its LoRA adapters as always on a one-model server."""

from __future__ import annotations

import time

from servelm.server.model_registry import ModelRegistry
from servelm.server.protocol import ModelCard
from servelm.server.serving_lora import lora_cards

# When a server of several models started: the ``created`` of models not loaded yet.
_STARTED = int(time.time())


def model_cards(models: ModelRegistry) -> list[ModelCard]:
    """The cards /v1/models lists: on a server of several models each carries ``state`` (loaded,
    loading, unloaded, failed), its ``aliases``, and ``error`` when its load failed."""
    if not models.multi:
        ctx = models.default.ctx
        assert ctx is not None
        own = ModelCard(
            id=ctx.served_model_name, created=ctx.created, root=ctx.model_path, max_model_len=ctx.max_model_len
        )
        return [own, *lora_cards(ctx)]
    cards: list[ModelCard] = []
    for h, item in zip(models.handles.values(), models.describe(), strict=True):
        ctx = h.ctx
        extra = {k: item[k] for k in ("state", "aliases", "error", "expires_at") if k in item}
        if ctx is not None:
            cards.append(
                ModelCard(id=h.id, created=ctx.created, root=ctx.model_path, max_model_len=ctx.max_model_len, **extra)
            )
            cards.extend(lora_cards(ctx))
        else:
            cards.append(ModelCard(id=h.id, created=_STARTED, root=h.spec.config.model, **extra))
    return cards


__all__ = ["model_cards"]
