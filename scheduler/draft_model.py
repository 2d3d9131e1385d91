"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes
``num_speculative_tokens`` tokens for every running request that may speculate, batched in a few
forwards of its own, and the target verifies them all in one step (``runtime.spec_sampling``).

The scheduler reserves the drafts' slots (``propose`` hands it placeholders); once the step is
planned, ``fill`` runs the draft model over the step's speculating requests and writes the drafts,
and for sampled requests the distributions they were drawn from, into their batch items. The
draft's K/V sits in a pool of its own indexed by the target's block tables (``runtime.draft_runner``);
each request remembers only how far the draft has computed.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from servelm.runtime.batch import BatchItem, SamplingOptions
from servelm.runtime.capacity import kv_bytes_per_token
from servelm.runtime.config import ModelConfig
from servelm.runtime.draft_runner import DraftRunner, DraftView
from servelm.runtime.model_files import resolve_model_path
from servelm.runtime.sampler import GREEDY_TEMPERATURE
from servelm.scheduler.speculative import DraftCounts, DraftModelConfig

if TYPE_CHECKING:
    from servelm.runtime.runner import ModelRunner
    from servelm.scheduler.config import EngineConfig
    from servelm.scheduler.request import Request

log = logging.getLogger(__name__)


@dataclass
class DraftProgress:
    """How far the draft model has computed a request (positions before ``num_computed``), valid while
    the request keeps the blocks it had (``preemptions`` unchanged)."""

    num_computed: int
    preemptions: int


class DraftModelProposer:
    """Drafts from a draft model for the requests that may speculate (see the module docstring)."""

    def __init__(self, config: DraftModelConfig, runner: DraftRunner) -> None:
        self.config = config
        self.runner = runner
        self.counts = DraftCounts()

    @staticmethod
    def eligible(req: Request) -> bool:
        """Greedy requests, and sampled ones without a seed (their draws would depend on the load) or
        logprobs (the verification draws the token itself); none with penalties, which depend on
        the tokens before each position, nor before ``min_tokens``."""
        p = req.params
        greedy = p.temperature < GREEDY_TEMPERATURE
        return (
            (greedy or (req.generator is None and p.logprobs is None))
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and req.num_output_tokens >= p.min_tokens
        )

    def propose(self, req: Request, limit: int) -> list[int]:
        """Placeholders for up to ``limit`` drafts (``fill`` computes them once the step is planned)."""
        k = min(self.config.num_speculative_tokens, limit)
        if k <= 0 or not self.eligible(req):
            return []
        state = req.drafting
        if not isinstance(state, DraftProgress) or state.preemptions != req.num_preemptions:
            # New, or preempted since: its blocks are new, so the draft starts over.
            req.drafting = DraftProgress(0, req.num_preemptions)
        return [0] * k

    def fill(self, items: list[BatchItem]) -> int:
        """Run the draft model for every item with drafts and write them (and their distributions) in;
        returns how many of the drafts scheduled were dropped (after a structured output completes)."""
        views: list[tuple[BatchItem, DraftView]] = []
        for item in items:
            if not item.draft:
                continue
            req: Request = item.seq  # type: ignore[assignment]
            p = req.params
            params = SamplingOptions(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, logit_bias=p.logit_bias
            )
            view = DraftView(
                seq_id=req.seq_id,
                token_ids=list(req.token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                num_computed_tokens=req.drafting.num_computed,
                block_table=req.block_table,
                params=params,
                num_drafts=len(item.draft),
                grammar=req.grammar.copy() if req.grammar is not None else None,
            )
            views.append((item, view))
        self.runner.propose([v for _, v in views])
        dropped = 0
        for item, view in views:
            n = len(item.draft) - len(view.drafts)  # type: ignore[arg-type]
            item.num_new_tokens -= n  # (their slots stay reserved until the request uses or frees them)
            dropped += n
            item.draft = view.drafts
            if view.probs:
                item.draft_probs = torch.stack(view.probs)
            if view.grammar is not None:
                item.draft_grammars = view.grammars
        return dropped

    def observe(self, req: Request, kept: int, proposed: int) -> None:
        """The draft's K/V is right up to the last draft kept that it computed (it never computes its
        last draft's position)."""
        self.counts.add(kept, proposed)
        state = req.drafting
        if isinstance(state, DraftProgress) and not req.is_finished:
            base = len(req.token_ids) - kept - 1  # tokens before this step's first new one
            state.num_computed = base + min(kept, proposed - 1)


def load_draft_config(config: DraftModelConfig, target: ModelConfig) -> tuple[Path, ModelConfig]:
    """The draft model's folder and configuration, refused by name where it cannot draft for ``target``."""
    path = resolve_model_path(config.model)
    mc = ModelConfig.from_dir(path)
    if mc.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {mc.vocab_size} tokens, the served model's {target.vocab_size}: a draft must share it"
        )
    for m, who in ((target, "served model"), (mc, "draft model")):
        if m.window_layers:
            raise ValueError(
                f"the {who} has sliding-window layers: a draft model is not served with sliding windows yet"
            )
    return path, mc


def check_draft_serving(config: EngineConfig, enable_lora: bool) -> None:
    """Refuse, before anything loads, what a draft model is not served with."""
    if enable_lora:
        raise ValueError(
            "a draft model (--speculative-config method draft_model) is not served with LoRA adapters (--enable-lora, --lora-modules)"
        )
    if config.tensor_parallel_size != 1:
        raise ValueError("a draft model is not served with --tensor-parallel-size > 1 yet")


def target_share(kv_memory: int, target: ModelConfig, draft: ModelConfig, kv_dtype: torch.dtype) -> int:
    """The target's part of the KV budget: the draft's pool has as many blocks, so each block costs
    both models' bytes and the budget is split in that ratio."""
    t, d = kv_bytes_per_token(target, kv_dtype), kv_bytes_per_token(draft, kv_dtype)
    return kv_memory * t // (t + d)


def new_draft_proposer(
    config: DraftModelConfig, path: Path, mc: ModelConfig, runner: ModelRunner, seed: int | None, max_model_len: int
) -> DraftModelProposer:
    """The proposer over the draft model's ``runner`` (loaded as the served model is, with as many blocks)."""
    if mc.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model has {mc.max_position_embeddings} positions, fewer than --max-model-len {max_model_len}"
        )
    log.info("draft model %s: %s, %d drafts a step while at most %d requests run", path, mc.architecture,
             config.num_speculative_tokens, config.max_running)  # fmt: skip
    return DraftModelProposer(
        dataclasses.replace(config, model=str(path)), DraftRunner(runner, None if seed is None else seed + 1)
    )
