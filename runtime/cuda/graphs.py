"""CUDA graphs for decode-only steps.

A decode step of a large model on a fast GPU is short enough that launching its few hundred
kernels from Python costs as much as running them. So at start-up the model's forward over
``B`` decode tokens is captured once per batch size in a ladder (1, 2, 4, 8, ..., max_num_seqs);
a step with ``n`` decodes replays the smallest captured ``B >= n`` with the extra rows padded
(slot -1: nothing written; seq_len 1 on block 0: a harmless read; their outputs are dropped).

The graphs read fixed input buffers (input ids, positions, slot mapping, seq/context lengths,
block tables) that ``run`` fills before each replay, and share one memory pool (captured largest
first, so smaller graphs reuse its memory). The KV pool must not move after capture.

With the fused few-row projections (``runtime.cuda.triton_gemv``, via the model's ``FewRowKernels``), each
size they can serve is captured twice, with and without them; both are replayed and timed, and the
faster is kept (``choose_variant``; kept unfused when the two disagree beyond a rounding tolerance,
``few_row_tolerance``). Where programmatic dependent launch is available (``runtime.cuda.pdl``: Hopper
and newer) the fused graph is also captured with it, and kept when it replays faster still and its
outputs equal the fused graph's bit for bit. The A/B runs real decodes (a few positions of a short
context written into the first pool blocks, which hold no sequence yet), not the padding rows.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata
from servelm.runtime.cuda import pdl
from servelm.runtime.cuda.graph_inputs import GraphInputs, capture_sizes, padded_size
from servelm.runtime.cuda.graph_variants import VariantTiming, few_row_tolerance

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from servelm.runtime.model_kernels import FewRowKernels

log = logging.getLogger(__name__)

# forward(input_ids [T], positions [T], meta) -> hidden [T, hidden_size]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Captured = tuple["torch.cuda.CUDAGraph", torch.Tensor]  # a graph and its static output


class CudaGraphRunner:
    """Captured decode-only forwards of ``model`` for a ladder of batch sizes.

    ``model(input_ids, positions, meta) -> hidden`` is the model (our Llama module, whose
    ``forward`` has that signature, or any callable like it). ``backend.build_metadata`` runs once
    per size at capture and must derive decode-half tensors as views (the CUDA backends do).
    """

    def __init__(
        self,
        model: ForwardFn,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        few_rows: FewRowKernels | None = None,
        few_rows_max: int = 0,
        few_rows_ab: bool = True,
        pdl: bool = False,
        num_kv_blocks: int = 0,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """``few_rows`` (the model's shared ``FewRowKernels``) with ``few_rows_max`` > 0: sizes up to
        that are captured with the fused few-row projections, after an A/B against the plain graph
        when ``few_rows_ab``, else unconditionally. ``pdl``: those sizes are also captured with
        programmatic dependent launch (``runtime.cuda.pdl``) and A/B'd against the fused graph.
        ``num_kv_blocks``: the pool's size; the A/B decodes use its first blocks. ``head`` (hidden ->
        logits): the sizes of the A/B (up to ``few_rows_max``) run it inside the graph, which then
        returns logits (``returns_logits``); it sees the same ``FewRowKernels`` switch as the model."""
        self.model = model
        self.backend = backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        self.inputs = GraphInputs.allocate(self.sizes[-1], max_blocks_per_seq, self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # Kept alive: anything a backend derived in build_metadata is read by the graph at replay.
        self._metas: dict[int, AttentionMetadata] = {}
        self._pool: _POOL_HANDLE | None = None
        self.few_rows = few_rows
        self.few_rows_max = few_rows_max if few_rows is not None else 0
        self.few_rows_ab = few_rows_ab
        self.pdl = pdl and self.few_rows_max > 0
        self.head = head
        self.head_max = self.few_rows_max if head is not None else 0
        self.num_kv_blocks = num_kv_blocks
        self.variants: dict[int, VariantTiming] = {}  # the A/B of each size that had one
        self.fused_sizes: set[int] = set()  # sizes whose kept graph uses the fused projections
        self.pdl_sizes: set[int] = set()  # ... and of those, the ones launched with PDL

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def static_metadata(self, bs: int) -> AttentionMetadata:
        """The metadata a graph of size ``bs`` is captured with: views of the static buffers."""
        # Python-side values are frozen into the graph: decode paths must not depend on them.
        longest = self.max_blocks_per_seq * self.block_size
        return self.backend.build_metadata(self.inputs.metadata(bs, self.max_blocks_per_seq, [longest] * bs))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first, one shared pool). Call after the KV pool is allocated."""
        t0 = time.perf_counter()
        self._pad_inputs()
        saved_max = self.few_rows.max_rows if self.few_rows is not None else 0
        try:
            for bs in reversed(self.sizes):
                meta = self.static_metadata(bs)
                graph, out = self._capture_size(bs, meta)
                self._graphs[bs] = graph
                self._outputs[bs] = out
                self._metas[bs] = meta
        finally:
            if self.few_rows is not None:  # back to what eager steps use (never a kernel that failed here)
                self.few_rows.max_rows = saved_max if self.few_rows_max else 0
        torch.cuda.synchronize(self.device)
        log.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s%s%s",
            ", ".join(map(str, self.sizes)),
            time.perf_counter() - t0,
            ("; fused few-row projections at sizes " + ", ".join(map(str, sorted(self.fused_sizes))))
            if self.fused_sizes
            else "",
            ("; programmatic dependent launch at sizes " + ", ".join(map(str, sorted(self.pdl_sizes))))
            if self.pdl_sizes
            else "",
        )
        for bs, v in sorted(self.variants.items()):
            log.info("decode graph, batch %d: %s", bs, v.describe())

    def _pad_inputs(self) -> None:
        """Every row a padding decode: the capture's own forwards write nothing into the pool."""
        self.inputs.input_ids.zero_()
        self.inputs.positions.zero_()
        self.inputs.slot_mapping.fill_(-1)
        self.inputs.seq_lens.fill_(1)
        self.inputs.context_lens.zero_()
        self.inputs.block_tables.zero_()

    def _decode_inputs(self, bs: int, position: int) -> bool:
        """Rows [0, bs) as real decodes for the A/B: row r is a sequence in pool block r whose token at
        ``position`` (< block size) is new, so the graph writes its K/V and attends over it. False
        (inputs left as padding) when the pool has fewer than ``bs`` blocks."""
        if bs > self.num_kv_blocks or position >= self.block_size:
            return False
        b = self.inputs
        rows = torch.arange(bs, device=self.device)
        # Token ids differ by batch size too: a slot an earlier size's A/B wrote gets new K/V.
        b.input_ids[:bs].copy_(rows + 1 + position + 8 * bs)
        b.positions[:bs].fill_(position)
        b.slot_mapping[:bs].copy_(rows * self.block_size + position)
        b.seq_lens[:bs].fill_(position + 1)
        b.context_lens[:bs].fill_(position)
        b.block_tables[:bs, 0].copy_(rows)
        return True

    def _capture_one(self, bs: int, meta: AttentionMetadata) -> Captured:
        ids, pos = self.inputs.input_ids[:bs], self.inputs.positions[:bs]
        head = self.head if bs <= self.head_max else None

        def step() -> torch.Tensor:
            hidden = self.model(ids, pos, meta)
            return head(hidden) if head is not None else hidden

        # Warm up outside the graph: compiles Triton kernels (and tunes their tiles), picks cuBLAS algorithms.
        step()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    def _capture_size(self, bs: int, meta: AttentionMetadata) -> Captured:
        """The graph of one size: plain, fused, fused with PDL, or the fastest that may be kept."""
        k = self.few_rows
        if k is not None:
            k.max_rows = 0
        if k is None or bs > self.few_rows_max:
            return self._capture_one(bs, meta)
        k.max_rows = bs
        try:
            fused = self._capture_one(bs, meta)
        except Exception as exc:  # e.g. a Triton compile failure on this GPU: keep the plain path
            log.warning("fused few-row projections failed at batch %d (%s); using plain projections", bs, exc)
            k.max_rows = 0
            self.few_rows_max = 0
            self.pdl = False
            return self._capture_one(bs, meta)
        with_pdl = self._capture_pdl(bs, meta) if self.pdl else None
        plain = None
        if self.few_rows_ab:
            k.max_rows = 0
            plain = self._capture_one(bs, meta)
        if plain is None and with_pdl is None:
            self.fused_sizes.add(bs)
            return fused
        timing = self._compare(fused, plain, with_pdl, bs)
        self.variants[bs] = timing
        if timing.chosen == "plain":
            assert plain is not None
            return plain
        self.fused_sizes.add(bs)
        if timing.chosen == "fused+pdl":
            assert with_pdl is not None
            self.pdl_sizes.add(bs)
            return with_pdl
        return fused

    def _capture_pdl(self, bs: int, meta: AttentionMetadata) -> Captured | None:
        try:
            with pdl.launching(True):
                return self._capture_one(bs, meta)
        except Exception as exc:  # e.g. a driver that cannot capture programmatic launches
            log.warning("programmatic dependent launch failed at batch %d (%s); capturing without it", bs, exc)
            self.pdl = False
            return None

    def _compare(
        self, fused: Captured, plain: Captured | None, with_pdl: Captured | None, bs: int, iters: int = 20
    ) -> VariantTiming:
        """Replay the graphs in turn (interleaved, so clock changes hit all): the median ms of one
        replay each, how far the fused outputs are from the plain ones, and whether the PDL outputs
        equal the fused ones exactly.

        The outputs are compared over a few real decodes, each writing a new token's K/V at a slot no
        replay wrote before, the PDL graph first: a kernel that read ahead of its producer would see
        the pool's zeros and differ."""
        graphs = {"fused": fused}
        if with_pdl is not None:
            graphs = {"fused+pdl": with_pdl, **graphs}
        if plain is not None:
            graphs["plain"] = plain
        rel_diffs: list[float] = []
        identical = with_pdl is not None
        try:
            for position in range(1, 5):
                self._decode_inputs(bs, position)
                outs = {}
                for name, (graph, out) in graphs.items():
                    graph.replay()
                    torch.cuda.synchronize(self.device)
                    outs[name] = out.float().clone()
                if "plain" in outs:
                    diff = (outs["fused"] - outs["plain"]).norm() / outs["plain"].norm().clamp_min(1e-12)
                    rel_diffs.append(diff.item())
                if with_pdl is not None:
                    identical = identical and torch.equal(outs["fused+pdl"], outs["fused"])
            times: dict[str, list[float]] = {name: [] for name in graphs}
            for _ in range(iters):
                for name, (graph, _) in graphs.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
        finally:
            self._pad_inputs()
        median = {name: statistics.median(t) for name, t in times.items()}
        return VariantTiming(
            median["fused"],
            median.get("plain"),
            float("nan") if not rel_diffs or any(math.isnan(d) for d in rel_diffs) else max(rel_diffs),
            few_row_tolerance(fused[1].dtype),
            median.get("fused+pdl"),
            identical,
        )

    def returns_logits(self, num_decodes: int) -> bool:
        """Whether ``run`` for this many decodes returns logits ``[n, vocab]`` (the head is in the graph)."""
        bs = padded_size(self.sizes, num_decodes)
        return bs is not None and bs <= self.head_max

    def can_run(self, num_decodes: int, num_tokens: int, block_table_width: int) -> bool:
        """A step can replay a graph when it is decode-only and fits the captured shapes."""
        return (
            self.captured
            and num_tokens == num_decodes
            and 0 < num_decodes <= self.max_batch_size
            and block_table_width <= self.max_blocks_per_seq
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        slot_mapping: torch.Tensor,  # [n] int64
        seq_lens: torch.Tensor,  # [n] int32 (context after this step, the new token included)
        block_tables: torch.Tensor,  # [n, width] int32, width <= max_blocks_per_seq
    ) -> torch.Tensor:
        """Replay the graph for ``n`` decodes; returns hidden states ``[n, hidden]``, or the logits
        ``[n, vocab]`` where ``returns_logits(n)``.

        The result is a view of the graph's static output: consume it (LM head, sampling) before
        the next ``run``.
        """
        n = input_ids.shape[0]
        self.inputs.fill(input_ids, positions, slot_mapping, seq_lens, block_tables, self.padded(n))
        return self.replay(n)

    def padded(self, num_decodes: int) -> int:
        """The captured size a step of ``num_decodes`` replays (its inputs are staged up to it)."""
        bs = padded_size(self.sizes, num_decodes)
        if bs is None:
            raise ValueError(f"{num_decodes} decodes exceed the largest captured batch {self.max_batch_size}")
        return bs

    def replay(self, num_decodes: int) -> torch.Tensor:
        """Replay the graph for ``num_decodes`` decodes whose inputs are already in ``inputs``
        (``inputs.stage`` up to ``padded(num_decodes)``); the output as ``run`` returns it."""
        bs = self.padded(num_decodes)
        self._graphs[bs].replay()
        return self._outputs[bs][:num_decodes]
