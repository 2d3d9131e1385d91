"""Offline use: run a list of prompts to completion on an engine and return their results in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from servelm.runtime.lora import LoRAAdapter
from servelm.scheduler.lora_registry import LoRALimitError, LoRANotLoadedError
from servelm.scheduler.outputs import ChoiceGroup, GeneratedChoice, GenerationResult
from servelm.scheduler.sampling_params import SamplingParams


class LoRAReader(Protocol):
    """Reads an adapter folder for a request that names an adapter not loaded (``LoRARegistry.read``)."""

    def read(self, path: str) -> LoRAAdapter: ...


class Engine(Protocol):
    """What ``generate`` drives (``scheduler.engine.Engine``)."""

    tokenizer: Any

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        lora_name: str | None = None, lora_adapter: LoRAAdapter | None = None,
    ) -> None: ...  # fmt: skip

    @property
    def loras(self) -> LoRAReader: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> Any: ...

    def abort(self, request_id: str) -> None: ...

    def new_offline_id(self) -> str: ...

    def choice_group(self, request_id: str) -> ChoiceGroup: ...

    def forget(self, request_id: str) -> None: ...


def generate(
    engine: Engine,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    lora_names: str | Sequence[str | None] | None = None,
) -> list[GenerationResult]:
    """``Engine.generate``: steps ``engine`` until every prompt's choices have finished."""
    if isinstance(params, SamplingParams):
        plist = [params] * len(prompts)
    else:
        plist = list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
    if lora_names is None or isinstance(lora_names, str):
        loras: list[str | None] = [lora_names] * len(prompts)
    else:
        loras = list(lora_names)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA names")
    groups: list[ChoiceGroup] = []
    try:
        for prompt, p, lora_name in zip(prompts, plist, loras):
            # Text is tokenized as the tokenizer does by default (BOS where the model expects one).
            ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = engine.new_offline_id()
            _add(engine, rid, ids, p, lora_name)
            groups.append(engine.choice_group(rid))
    except Exception:
        for g in groups:
            engine.abort(g.request_id)
        raise
    while any(not g.finished for g in groups):
        engine.step()
    for g in groups:  # drop their pending abort/error news: the caller gets the results below
        engine.forget(g.request_id)
    return [_result(g) for g in groups]


def _add(engine: Engine, rid: str, ids: list[int], params: SamplingParams, lora_name: str | None) -> None:
    """``add_request``, reading an adapter unloaded to make room (offline, nothing else waits on this
    thread) and stepping until a loaded adapter is free when every one is in use."""
    adapter = None
    while True:
        try:
            engine.add_request(rid, ids, params, lora_name=lora_name, lora_adapter=adapter)
            return
        except LoRANotLoadedError as e:
            adapter = engine.loras.read(e.path)
        except LoRALimitError:
            if not engine.has_unfinished_requests():
                raise
            engine.step()


def _result(group: ChoiceGroup) -> GenerationResult:
    if group.results is not None:  # beam search: the finished hypotheses, not the beams that were running
        choices = [
            GeneratedChoice(
                c.index,
                c.new_text,
                c.new_token_ids,
                c.finish_reason,
                c.stop_reason,
                c.new_logprobs,
                cumulative_logprob=c.cumulative_logprob,
            )
            for c in group.results
        ]
        return GenerationResult(group.request_id, group.prompt_token_ids, choices)
    return GenerationResult(
        group.request_id,
        group.prompt_token_ids,
        [
            GeneratedChoice(
                index=r.index,
                text=r.text.text if r.text is not None else "",
                token_ids=r.output_token_ids,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                logprobs=r.output_logprobs,
                error=r.error,
            )
            for r in group.choices
        ],
        group.complete_prompt_logprobs(),
    )
