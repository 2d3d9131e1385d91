"""The model runner: one scheduled step in, one sampled token per finishing item out.

``execute`` lays the step out as a flat token batch (decodes first, then prefill chunks), builds every
tensor the step needs once (ids, positions, slot mapping, lengths, block tables, then the backend's
own indices), runs the model once, projects only the sampled rows onto the vocabulary, and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime import cpu_linear
from runtime.attention.base import AttentionBackend, AttentionMetadata
from runtime.attention.selector import select_backend
from runtime.batch import BatchItem, RunnerOutput, SequenceView, TokenLogprobs
from runtime.config import ModelConfig
from runtime.kv_cache import KVPool
from runtime.weights import load_model

try:  # written in parallel by the sampler helper; greedy argmax until it exists
    from runtime.sampler import Sampler
except ImportError:  # pragma: no cover - depends on the checkout
    Sampler = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """The flat tensors of one step, in computed order (decodes first)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # as returned by the backend's build_metadata
    order: list[int]  # order[i] = index in the caller's item list of the i-th computed sequence
    sample_rows: torch.Tensor  # [R] int64: the hidden rows to sample (last token of each sampling item)
    sample_items: list[int]  # caller's item index of each sampled row


def is_decode(item: BatchItem) -> bool:
    """One new token on top of a cached context: served by the decode attention path."""
    return item.num_new_tokens == 1 and item.seq.num_computed_tokens > 0


class ModelRunner:
    """Owns the model, the KV pool and the attention backend; ``execute`` runs one step."""

    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        backend: AttentionBackend | None = None,
        seed: int | None = None,
    ) -> None:
        """``seed`` seeds the sampler's generator for requests without their own seed (None: from the OS)."""
        self.model_config = model_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        if backend is None:
            backend = select_backend(
                self.device, block_size=block_size, dtype=dtype, head_dim=model_config.head_dim
            )
        self.backend = backend
        backend_bs = getattr(self.backend, "block_size", block_size)
        if backend_bs != block_size:
            raise ValueError(f"attention backend expects block_size {backend_bs}, the pool uses {block_size}")
        self.model = load_model(model_dir, model_config, self.backend, dtype=dtype, device=self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.packed_linears = self.device.type == "cpu" and cpu_linear.onednn_linear_available(dtype)
        self.small_m_linear = None
        if self.packed_linears:
            if dtype == torch.float32:
                self.small_m_linear = cpu_linear.small_m_kernel()
            self.model.pack_cpu_weights(self.small_m_linear)
        self.kv_pool = KVPool(
            model_config.num_layers,
            num_blocks,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
            self.device,
        )
        self.model.bind_kv_cache(self.kv_pool.k_cache, self.kv_pool.v_cache)
        self.sampler = Sampler(seed) if Sampler is not None else None
        if self.sampler is None:
            log.warning("runtime.sampler is unavailable: sampling greedily (argmax)")
        log.info(
            "model runner ready: %s; %r; backend %s; matmuls %s",
            model_config.architecture,
            self.kv_pool,
            self.backend.name,
            ("oneDNN (packed weights)" if self.packed_linears else "torch")
            + (f" + few-row kernel (<= {self.small_m_linear[1]} rows)" if self.small_m_linear else ""),
        )

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, items: list[BatchItem]) -> RunnerOutput:
        """Compute every item's new tokens and sample the items with ``sample=True`` (results in item order)."""
        tokens: list[int | None] = [None] * len(items)
        logprobs: list[TokenLogprobs | None] = [None] * len(items)
        if not items:
            return RunnerOutput(tokens, logprobs)
        inputs = self.prepare(items)
        hidden = self.forward(inputs)
        if inputs.sample_items:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows)).float()
            seqs = [items[i].seq for i in inputs.sample_items]
            ids, lps = self._sample(logits, seqs)
            for i, tok, lp in zip(inputs.sample_items, ids, lps):
                tokens[i] = tok
                logprobs[i] = lp
        return RunnerOutput(tokens, logprobs)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the step's tokens: final hidden states ``[T, hidden]`` (a hook for CUDA graphs)."""
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    def _sample(
        self, logits: torch.Tensor, seqs: list[SequenceView]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self.sampler is not None:
            return self.sampler.sample(logits, seqs)
        return logits.argmax(dim=-1).tolist(), [None] * len(seqs)

    def prepare(self, items: list[BatchItem]) -> StepInputs:
        """Lay the step out (decodes first) and build its tensors and attention metadata, once."""
        bs = self.block_size
        decodes = [i for i, it in enumerate(items) if is_decode(it)]
        prefills = [i for i, it in enumerate(items) if not is_decode(it)]
        order = decodes + prefills
        if len(order) > self.max_num_seqs:
            raise ValueError(f"step has {len(order)} sequences, max_num_seqs is {self.max_num_seqs}")

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_items: list[int] = []
        for idx in order:
            item = items[idx]
            seq = item.seq
            start = seq.num_computed_tokens
            n = item.num_new_tokens
            end = start + n
            table = seq.block_table
            if n < 1 or end > len(seq.token_ids):
                raise ValueError(
                    f"seq {seq.seq_id}: cannot compute tokens {start}..{end - 1} of {len(seq.token_ids)}"
                )
            if len(table) * bs < end:
                raise ValueError(f"seq {seq.seq_id}: {len(table)} blocks cannot hold {end} tokens")
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(table[: -(-end // bs)])
            if item.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_items.append(idx)

        num_tokens = len(input_ids)
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"step has {num_tokens} tokens, max_num_batched_tokens is {self.max_num_batched_tokens}")
        max_seq_len = max(seq_lens)
        if max_seq_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"sequence of {max_seq_len} tokens exceeds the model's "
                f"{self.model_config.max_position_embeddings} positions"
            )
        width = max(len(t) for t in tables)
        dev = self.device
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        query_lens_t = torch.tensor(query_lens, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            num_decodes=len(decodes),
            num_decode_tokens=len(decodes),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=seq_lens_t,
            context_lens=seq_lens_t - query_lens_t,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=self.backend.build_metadata(meta),
            order=order,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            sample_items=sample_items,
        )
