"""The model runner: one scheduled step in, one sampled token per finishing item out.

``execute`` lays the step out as a flat token batch (decodes first, then prefill chunks), builds every
tensor the step needs once (ids, positions, slot mapping, lengths, block tables, then the backend's
own indices), runs the model once, projects only the sampled rows onto the vocabulary, and samples.

It is ``launch`` (inputs + forward), ``sample`` (LM head + sampler) and ``StepOutput.result`` (the
tokens on the host) in a row. Apart, they let the engine schedule ahead (``--async-scheduling``): on a
GPU nothing before ``result`` waits for the device, and a decode whose input is the token its
previous step sampled (``PENDING_TOKEN`` in ``token_ids``) reads it from that step's device output.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from servelm.runtime import lora
from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata
from servelm.runtime.batch import BatchItem, RunnerOutput, SequenceView
from servelm.runtime.capacity import kv_bytes_per_token
from servelm.runtime.config import ModelConfig, UnsupportedModelError
from servelm.runtime.gguf import layer as stored_layer
from servelm.runtime.gguf.folder import gguf_source
from servelm.runtime.gguf.projection import GGUF_ACTIVATIONS, use_int8_activations
from servelm.runtime.kv_cache import KVPool
from servelm.runtime.lora_updates import LoRAContext
from servelm.runtime.model_kernels import FewRowKernels
from servelm.runtime.platform import platform_of
from servelm.runtime.quantization import AUTO, NONE, QUANTIZATION_LABELS, check_group_widths, projection_widths
from servelm.runtime.quantization_setup import check_quantization, quantize_model
from servelm.runtime.sampled_rows import LogprobTensors, logprob_tensors
from servelm.runtime.sampler import Sampler
from servelm.runtime.spec_sampling import row_seqs, verify_sampled_drafts
from servelm.runtime.step import LaunchedStep, PromptScoring, StepInputs, StepOutput
from servelm.runtime.step_builder import CapturedSteps, build_step
from servelm.runtime.weights import load_model

if TYPE_CHECKING:
    from servelm.runtime.models.llama import CausalLM

log = logging.getLogger(__name__)

# Prompt rows scored at once (prompt logprobs): their float32 logits take SCORE_ROWS x vocab x 4 bytes.
SCORE_ROWS = 128


def serves_as_stored(model_dir: str | Path, quantization: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a folder's GGUF file keeps its quantized weights as stored: unless another form is asked
    for, or the device or dtype has no kernels for them (CPU float32 only), as llama.cpp serves it."""
    return (
        gguf_source(model_dir) is not None
        and quantization in (None, AUTO)
        and platform_of(device).quantization
        and dtype == torch.float32
    )


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
        num_blocks: int | None,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        backend: AttentionBackend | None = None,
        seed: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        quantization: str | None = None,
        kv_dtype: torch.dtype | None = None,
        gguf_activations: str = "float32",
    ) -> None:
        """``seed`` seeds the sampler's generator for requests without their own seed (None: from the OS).

        On CUDA, unless ``enforce_eager``, decode-only steps of up to ``max_num_seqs`` sequences replay
        CUDA graphs captured at start-up (``runtime.cuda.graphs``) for block tables up to
        ``max_model_len`` tokens (default: the model's max positions).

        ``num_blocks=None`` loads the weights only: measure what is left with ``measure_kv_budget``,
        then call ``allocate_kv_pool`` before the first ``execute``.

        ``quantization="int8"`` or ``"int4"`` (CPU, float32): weight-only quantized projections and head
        (``runtime.quantization``); ``"auto"``: int4 if that is exact for these weights, else none
        (``self.quantization`` says which runs).

        ``gguf_activations="int8"``: a GGUF file served as stored multiplies its quantized projections
        with activations rounded to int8 per block, as llama.cpp does (faster; no longer the float32 sum).
        """
        check_quantization(quantization, torch.device(device), dtype)
        self.platform = platform_of(device)
        if not self.platform.serves_gemma and model_config.gemma_norms:
            raise UnsupportedModelError(
                f"{model_config.architecture} is served on CPU only (its sliding windows and norms have no CUDA path yet)"
            )
        widths = projection_widths(model_config)
        check_group_widths(widths, quantization)
        self.model_config = model_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        if backend is None:
            backend = self.platform.attention_backend(
                block_size=block_size, dtype=dtype, head_dim=model_config.head_dim, use_cpu_kernel=True
            )
            log.info("attention backend: %s on %s (block size %d)", backend.name, self.device, block_size)
        self.backend = backend
        backend_bs = getattr(self.backend, "block_size", block_size)
        if backend_bs != block_size:
            raise ValueError(f"attention backend expects block_size {backend_bs}, the pool uses {block_size}")
        self.weights_as_stored = serves_as_stored(model_dir, quantization, self.device, dtype)
        if self.weights_as_stored:
            quantization = None
        if gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"unknown gguf_activations {gguf_activations!r}; supported: {', '.join(GGUF_ACTIVATIONS)}")
        if gguf_activations == "int8" and not self.weights_as_stored:
            raise ValueError(
                "--gguf-activations int8 applies to a GGUF file served as stored "
                "(CPU, --dtype float32, --quantization auto or unset)"
            )
        self.gguf_activations = gguf_activations
        self.model = self.load_model(model_dir, model_config)
        if gguf_activations == "int8":
            use_int8_activations(self.model.stored_methods())
        if self.weights_as_stored:
            stored_layer.attach(self.model)
        kernels = self.platform.quantized_kernels() if quantization not in (None, NONE) else {}
        quantization = quantize_model(self.model, quantization, kernels, self.device, dtype, widths)
        self.quantized_kernels = kernels if quantization else {}
        self.quantization = quantization  # what runs ("auto" resolved): "int8", "int4" or None
        quant_rows = self.quantized_kernels[quantization][1] if quantization and self.quantized_kernels else 0
        # What a decode step reads (MBU, the device check's floor): quantized weights count their own bytes.
        self.weight_bytes = self.model.weight_bytes_read()
        installed = self.platform.install_kernels(self.model, dtype, quant_rows)
        self.packed_linears = installed.packed_linears
        self.few_row_linear = installed.few_row_linear
        self.fused_ops = installed.fused_ops
        self.few_rows: FewRowKernels | None = installed.few_rows
        self.few_rows_mode = installed.few_rows_mode
        self.few_rows_limit = installed.few_rows_limit  # most rows the fused few-row projections take
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        self.enforce_eager = enforce_eager
        self.kv_pool: KVPool = None  # type: ignore[assignment]  # set by allocate_kv_pool
        self.graph_runner: CapturedSteps | None = None
        if num_blocks is not None:
            self.allocate_kv_pool(num_blocks)
        self.sampler = Sampler(seed)
        self.spec_generator = (
            torch.Generator().manual_seed(seed + 1) if seed is not None else None
        )  # draft verification
        self.lora_context: LoRAContext | None = None  # set when the first adapter is added
        self.lora_ids: set[int] = set()
        # The last sampling step's tokens (where they were drawn) and its sequences, row by row: what
        # a PENDING_TOKEN in the next step's inputs stands for.
        self.last_tokens: torch.Tensor | None = None
        self.last_seqs: list[SequenceView] = []
        self.last_rows: dict[int, int] | None = None  # seq_id -> row, built on first use
        log.info(
            "model runner ready: %s; backend %s; matmuls %s",
            model_config.architecture,
            self.backend.name,
            ("oneDNN (packed weights)" if self.packed_linears else "torch")
            + (f" + few-row kernel (<= {self.few_row_linear[1]} rows)" if self.few_row_linear else "")
            + (f" + {quantization} few-row kernel (<= {quant_rows} rows)" if quant_rows else "")
            + (f"; weights {QUANTIZATION_LABELS[quantization]}" if quantization else "")
            + ("; weights as stored in the GGUF file" if self.weights_as_stored else "")
            + ("; int8-rounded activations" if gguf_activations == "int8" else "")
            + ("; fused Triton norms/activation/RoPE" if self.fused_ops else "")
            + (f"; fused few-row projections: {self.few_rows_mode}" if self.few_rows is not None else ""),
        )

    def load_model(self, model_dir: Path, model_config: ModelConfig) -> CausalLM:
        """The loaded model (a tensor-parallel runner, ``runtime.distributed``, loads its rank's shard)."""
        return load_model(
            model_dir,
            model_config,
            self.backend,
            dtype=self.dtype,
            device=self.device,
            gguf_as_stored=self.weights_as_stored,
            ops=self.platform.layer_ops(self.dtype),
        )

    # ---- the KV pool -----------------------------------------------------------------------------
    def _new_pool(self, num_blocks: int) -> KVPool:
        mc = self.model_config
        return KVPool(
            mc.num_layers, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype, self.device
        )

    def allocate_kv_pool(self, num_blocks: int) -> None:
        """Allocate the pool, bind it to the layers, and (CUDA, not eager) capture the decode graphs."""
        if self.kv_pool is not None:
            raise RuntimeError("the KV pool is already allocated")
        self.kv_pool = self._new_pool(num_blocks)
        self.model.bind_kv_cache(self.kv_pool.k_cache, self.kv_pool.v_cache)
        if not self.enforce_eager:
            self.graph_runner = self.platform.capture_decode_graphs(self, num_blocks)
        log.info("KV pool: %r", self.kv_pool)

    @torch.inference_mode()
    def warm_up(self) -> int:
        """The largest step the scheduler can build, on a scratch pool: a prefill of
        ``max_num_batched_tokens`` tokens and logits (plus a softmax, as sampling does) for
        ``max_num_seqs`` rows. Returns the scratch pool's bytes; the pool is released afterwards.

        Run under ``runtime.cuda.memory.profile_memory`` it shows the activation peak. Must be called
        before ``allocate_kv_pool``.
        """
        if self.kv_pool is not None:
            raise RuntimeError("warm_up runs before the KV pool is allocated")
        n = self.max_num_batched_tokens
        blocks = -(-n // self.block_size)
        scratch = self._new_pool(blocks)
        self.model.bind_kv_cache(scratch.k_cache, scratch.v_cache)
        try:
            dev = self.device
            meta = AttentionMetadata(
                num_tokens=n,
                num_decodes=0,
                num_decode_tokens=0,
                slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                context_lens=torch.zeros(1, dtype=torch.int32, device=dev),
                block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
                max_query_len=n,
                max_seq_len=n,
                query_lens_list=[n],
                seq_lens_list=[n],
            )
            ids = torch.zeros(n, dtype=torch.int64, device=dev)
            hidden = self.model(ids, torch.arange(n, dtype=torch.int64, device=dev), self.backend.build_metadata(meta))
            rows = torch.arange(min(self.max_num_seqs, n), device=dev)
            torch.softmax(self.model.compute_logits(hidden.index_select(0, rows)).float(), dim=-1)
            return scratch.nbytes
        finally:
            self.model.bind_kv_cache([None] * len(scratch.k_cache), [None] * len(scratch.v_cache))
            del scratch

    def measure_kv_budget(self, gpu_memory_utilization: float, reserve_bytes: int = 0) -> int:
        """CUDA: bytes the KV pool may take, measured around ``warm_up`` (``runtime.cuda.memory``)."""
        return self.platform.kv_budget_bytes(
            self.device,
            gpu_memory_utilization,
            self.warm_up,
            kv_bytes_per_token(self.model_config, self.kv_dtype)
            * self.block_size
            * -(-self.max_num_batched_tokens // self.block_size),
            reserve_bytes,
        )

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def add_lora(self, adapter_id: int, adapter: lora.LoRAAdapter) -> None:
        """Serve ``adapter`` (``runtime.lora.load_lora_adapter``) to sequences whose ``lora_id`` is
        ``adapter_id`` (> 0). Its tensors are copied to the model's device and dtype."""
        if adapter_id <= 0 or adapter_id in self.lora_ids:
            raise ValueError(f"LoRA adapter id {adapter_id} is not positive or already in use")
        if self.lora_context is None:
            kernel = self.platform.lora_kernel()
            self.lora_context = lora.attach(self.model, kernel)
        lora.add_adapter(self.model, adapter_id, adapter.to(self.device, self.dtype))
        self.lora_ids.add(adapter_id)

    def remove_lora(self, adapter_id: int) -> None:
        """Drop an adapter (no running sequence may use it any more)."""
        if adapter_id in self.lora_ids:
            lora.remove_adapter(self.model, adapter_id)
            self.lora_ids.discard(adapter_id)

    def prepare(self, items: list[BatchItem]) -> StepInputs:
        """Lay the step out (decodes first) and build its tensors and attention metadata, once (``step_builder``)."""
        return build_step(self, items)

    # ---- one step ------------------------------------------------------------------------------
    def execute(self, items: list[BatchItem]) -> RunnerOutput:
        """Compute every item's new tokens and sample the items with ``sample=True`` (results in item order)."""
        if not items:
            return RunnerOutput([], [])
        return self.sample(self.launch(items)).result()

    @torch.inference_mode()
    def launch(self, items: list[BatchItem]) -> LaunchedStep:
        """Build the step's inputs and issue its forward."""
        inputs = self.prepare(items)
        out = self.forward(inputs)
        return LaunchedStep(items, inputs, out, self.forward_returns_logits(inputs))

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> StepOutput:
        """Issue the LM head over the sampled rows and the sampler; the tokens start towards the host.

        The sampler reads each sequence's ``token_ids`` (penalties, min_tokens): they must hold no
        ``PENDING_TOKEN`` by now. Items whose rows raise in the sampler are in the output's ``errors``;
        the others are sampled all the same.
        """
        inputs = step.inputs
        scored = None
        if inputs.score is not None:
            scored = (inputs.score, self.score_prompt(inputs.score, step.hidden, step.logits))
        rows = None
        if inputs.sample_items:
            logits = self.sampled_logits(inputs, step.hidden, step.logits)
            if step.logits and logits.data_ptr() == step.hidden.data_ptr():
                logits = logits.clone()  # the sampler edits its logits: keep the graph's output for a retry
            seqs = row_seqs(step.items, inputs.sample_items)
            verified = verify_sampled_drafts(logits, step.items, inputs.sample_items, seqs, self.spec_generator)
            rows = self.sampler.sample_rows(
                logits, seqs, reload=lambda: self.sampled_logits(inputs, step.hidden, step.logits)
            )
            for at, tokens in verified:  # a draft model's sampled drafts: verification chose these rows' tokens
                rows.tokens[at : at + len(tokens)] = torch.tensor(tokens, device=rows.tokens.device)
            self.last_tokens, self.last_seqs, self.last_rows = rows.tokens, seqs, None
        else:
            self.last_tokens, self.last_seqs, self.last_rows = None, [], None
        ready = None
        if self.platform.copies_results_async and (rows is not None or scored is not None):
            # Into pinned host memory without blocking; ``result`` waits on this event alone.
            if rows is not None:
                rows = rows.with_tensors([t.to("cpu", non_blocking=True) for t in rows.tensors()])
            if scored is not None:
                scored = (
                    scored[0],
                    [p.with_tensors([t.to("cpu", non_blocking=True) for t in p.tensors()]) for p in scored[1]],
                )
            ready = self.platform.results_ready_event(self.device)
        return StepOutput(len(step.items), inputs.sample_items, rows, ready, scored)

    def score_prompt(self, score: PromptScoring, out: torch.Tensor, is_logits: bool) -> list[LogprobTensors]:
        """Logprobs of prompt tokens from the raw logits of the rows before them, in slices of
        ``SCORE_ROWS`` rows (a 512-token chunk's logits would be 100 MB at a 49k vocabulary)."""
        parts = []
        for a in range(0, len(score.rows), SCORE_ROWS):
            rows = score.rows[a : a + SCORE_ROWS]
            h = out.index_select(0, self.platform.host_to_device(rows, out.device))
            logits = (h if is_logits else self.model.compute_logits(h)).float()
            targets = self.platform.host_to_device(score.targets[a : a + SCORE_ROWS], out.device)
            parts.append(
                logprob_tensors(logits.log_softmax(-1), targets, list(range(len(rows))), score.ks[a : a + SCORE_ROWS])
            )
        return parts

    def sampled_logits(self, inputs: StepInputs, out: torch.Tensor, is_logits: bool) -> torch.Tensor:
        """Float32 logits of the rows to sample from ``forward``'s output (hidden states, or logits)."""
        # Sampled rows are increasing: as many as the output's rows means all of them, in order.
        if len(inputs.sample_items) != out.shape[0]:
            out = out.index_select(0, inputs.sample_rows)
        return (out if is_logits else self.model.compute_logits(out)).float()

    def forward_returns_logits(self, inputs: StepInputs) -> bool:
        """Whether ``forward(inputs)`` gives logits: a graph with the LM head inside (few-row sizes)."""
        return inputs.graph and self.graph_runner is not None and self.graph_runner.returns_logits(len(inputs.order))

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the step's tokens: final hidden states ``[T, hidden]``; for a graph with the
        LM head inside (``forward_returns_logits``), the logits ``[T, vocab]``."""
        if inputs.graph:  # staged by prepare
            assert self.graph_runner is not None
            return self.graph_runner.replay(len(inputs.order))
        if inputs.lora is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)
        ctx = self.lora_context
        assert ctx is not None
        ctx.set(inputs.lora.plan, inputs.lora.row_adapter)
        try:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)
        finally:
            ctx.clear()
