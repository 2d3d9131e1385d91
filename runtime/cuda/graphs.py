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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from servelm.runtime.cuda import pdl
from servelm.runtime.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from servelm.runtime.models.layers import FewRowKernels

log = logging.getLogger(__name__)

# Fused and unfused graphs of one size must give hidden states this close (relative L2 norm of the
# difference) for the fused one to be kept: they differ by the order of float32 sums, then rounding,
# compounded over the layers. Measured on an H200 with the Llama-3-8B shape (32 layers, random
# weights): 2.9e-6 in float32, 3.1e-2 in bfloat16 (4e-2 eager); a wrong kernel gives ~1.
FEW_ROW_TOLERANCE = {torch.float32: 1e-3}
FEW_ROW_TOLERANCE_16BIT = 0.1


def few_row_tolerance(dtype: torch.dtype) -> float:
    return FEW_ROW_TOLERANCE.get(dtype, FEW_ROW_TOLERANCE_16BIT)

# forward(input_ids [T], positions [T], meta) -> hidden [T, hidden_size]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Captured = tuple["torch.cuda.CUDAGraph", torch.Tensor]  # a graph and its static output


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs, plus max_num_seqs itself when it is not a power of two."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size holding ``n`` rows (None when none does)."""
    for b in sizes:
        if b >= n:
            return b
    return None


# ``GraphInputs.stage`` copies whole block-table rows (one copy, no device-side scatter) while
# the rows it sends stay under this many bytes; above it (long contexts x many rows) it sends only
# the used columns, which the device then scatters into the table.
FULL_TABLE_ROWS_MAX_BYTES = 64 << 10


@dataclass
class GraphInputs:
    """The static buffers every captured graph reads (rows [0, B) for a graph of size B).

    The int64 inputs are rows of one buffer and the int32 lengths rows of another, so a step is
    staged with one host-to-device copy each (``stage``), plus one for the block tables."""

    i64: torch.Tensor  # [5, max_bs]: input ids, positions, slot mapping; pending rows and their sources
    i32: torch.Tensor  # [2, max_bs]: seq lens, context lens
    query_start_loc: torch.Tensor  # [max_bs + 1] int32, fixed 0..max_bs (one token per sequence)
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_seq] int32
    rows: torch.Tensor  # [max_bs] int64, fixed 0..max_bs - 1 (a decode step's sampled rows)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.i64[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.i64[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.i64[2]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.i32[0]

    @property
    def context_lens(self) -> torch.Tensor:
        return self.i32[1]

    @classmethod
    def allocate(cls, max_bs: int, max_blocks_per_seq: int, device: torch.device) -> "GraphInputs":
        i32 = dict(dtype=torch.int32, device=device)
        g = cls(
            i64=torch.zeros(5, max_bs, dtype=torch.long, device=device),
            i32=torch.zeros(2, max_bs, **i32),
            query_start_loc=torch.arange(max_bs + 1, **i32),
            block_tables=torch.zeros(max_bs, max_blocks_per_seq, **i32),
            rows=torch.arange(max_bs, dtype=torch.long, device=device),
        )
        g.slot_mapping.fill_(-1)
        g.seq_lens.fill_(1)
        return g

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        padded_to: int,
    ) -> None:
        """Copy ``n`` real decode rows in from device tensors and reset rows [n, padded_to) to harmless
        padding. (The runner stages its steps from the host instead: ``stage``.)"""
        n = input_ids.shape[0]
        width = block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block table of {width} blocks exceeds the captured {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        # A decode's context before this step is everything but the new token.
        torch.sub(self.seq_lens[:n], 1, out=self.context_lens[:n])
        # Columns past `width` keep stale ids: kernels never read entries beyond ceil(seq_len / block).
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if padded_to > n:
            self.input_ids[n:padded_to].zero_()
            self.positions[n:padded_to].zero_()
            self.slot_mapping[n:padded_to].fill_(-1)
            self.seq_lens[n:padded_to].fill_(1)
            self.context_lens[n:padded_to].zero_()
            self.block_tables[n:padded_to, 0].zero_()

    def metadata(self, n: int, width: int, seq_lens: list[int]) -> AttentionMetadata:
        """Unbuilt metadata of ``n`` decode rows over these buffers (block-table columns [0, width));
        ``seq_lens``: their lengths on the host."""
        return AttentionMetadata(
            num_tokens=n,
            num_decodes=n,
            num_decode_tokens=n,
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            context_lens=self.context_lens[:n],
            block_tables=self.block_tables[:n, :width],
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_list=[1] * n,
            seq_lens_list=seq_lens,
        )

    def stage(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        seq_lens: Sequence[int],
        flat_tables: Sequence[int],
        width: int,
        padded_to: int,
        pending_at: Sequence[int] = (),
        pending_from: Sequence[int] = (),
        last_tokens: torch.Tensor | None = None,
    ) -> None:
        """A decode step of ``n = len(input_ids)`` rows straight from host lists: rows [n, padded_to)
        become padding, and the rows ``pending_at`` take ``last_tokens[pending_from]`` (the tokens the
        previous step drew, still on the device). ``flat_tables``: ``[n, width]`` row by row.

        Three host-to-device copies without blocking (from freshly pinned memory, so an earlier step's
        copies still in the queue keep their data), and the pending tokens' gather: in stream order
        after the graphs already issued, so a graph replayed before still reads its own step."""
        n, p = len(input_ids), len(pending_at)
        max_bs, max_width = self.block_tables.shape
        if not 0 < n <= padded_to <= max_bs:
            raise ValueError(f"{n} rows padded to {padded_to} do not fit the captured {max_bs}")
        if width > max_width:
            raise ValueError(f"block table of {width} blocks exceeds the captured {max_width}")
        a = np.zeros((5, max_bs), dtype=np.int64)
        a[0, :n] = input_ids
        a[1, :n] = positions
        a[2, :n] = slots
        a[2, n:] = -1  # padding writes nothing
        a[3, :p] = pending_at
        a[4, :p] = pending_from
        b = np.empty((2, max_bs), dtype=np.int32)
        b[0, :n] = seq_lens
        b[1, :n] = b[0, :n] - 1  # a decode's context before this step: all but the new token
        b[0, n:] = 1  # padding reads one slot of block 0
        b[1, n:] = 0
        self.i64.copy_(_host(a, self.i64.device), non_blocking=True)
        self.i32.copy_(_host(b, self.i32.device), non_blocking=True)
        full_rows = padded_to * max_width * 4 <= FULL_TABLE_ROWS_MAX_BYTES
        t = np.zeros((padded_to, max_width if full_rows else width), dtype=np.int32)
        t[:n, :width] = np.asarray(flat_tables, dtype=np.int32).reshape(n, width)
        # Unsent columns keep stale ids: kernels never read entries beyond ceil(seq_len / block).
        dst = self.block_tables[:padded_to] if full_rows else self.block_tables[:padded_to, :width]
        dst.copy_(_host(t, dst.device), non_blocking=True)
        if p:
            if last_tokens is None:
                raise ValueError(f"{p} pending tokens without the last step's tokens")
            self.input_ids.index_copy_(0, self.i64[3, :p], last_tokens.index_select(0, self.i64[4, :p]))


def _host(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor to copy to ``device``: pinned when that is a GPU (the copy then does not block)."""
    t = torch.from_numpy(a)
    return t.pin_memory() if device.type == "cuda" else t


@dataclass
class VariantTiming:
    """One batch size's capture-time A/B: median replay times, the relative difference of the fused
    graph's outputs from the plain graph's, and whether the PDL graph's equal the fused graph's."""

    fused_ms: float
    plain_ms: float | None  # None: no plain graph (SERVELM_DECODE_GEMV=on)
    rel_diff: float  # NaN without a plain graph
    tolerance: float
    pdl_ms: float | None = None  # the fused graph launched with PDL (None: not captured)
    pdl_identical: bool = False
    chosen: str = field(init=False)

    def __post_init__(self) -> None:
        self.chosen = choose_variant(
            self.fused_ms, self.plain_ms, self.rel_diff, self.tolerance, self.pdl_ms, self.pdl_identical
        )

    def describe(self) -> str:
        parts = [f"fused few-row projections {self.fused_ms:.3f} ms"]
        if self.pdl_ms is not None:
            parts.append(f"with PDL {self.pdl_ms:.3f} ms ({'identical' if self.pdl_identical else 'DIFFERENT'} outputs)")
        if self.plain_ms is not None:
            parts.append(f"plain {self.plain_ms:.3f} ms, fused outputs differ by {self.rel_diff:.1e}")
        return ", ".join(parts) + f" -> {self.chosen}"


def choose_variant(
    fused_ms: float,
    plain_ms: float | None,
    rel_diff: float,
    tolerance: float,
    pdl_ms: float | None = None,
    pdl_identical: bool = False,
) -> str:
    """The fastest graph that may be kept: "plain"; "fused" if it agrees with plain (always, without
    a plain graph); "fused+pdl" if fused may be kept and the PDL graph gave the same bits. Ties: plain."""
    candidates: list[tuple[str, float]] = []
    if plain_ms is not None:
        candidates.append(("plain", plain_ms))
        if not rel_diff <= tolerance:  # NaN included
            return "plain"
    candidates.append(("fused", fused_ms))
    if pdl_ms is not None and pdl_identical:
        candidates.append(("fused+pdl", pdl_ms))
    return min(candidates, key=lambda c: c[1])[0]


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
        few_rows: "FewRowKernels | None" = None,
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
        self._pool: object | None = None
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
            "captured CUDA graphs for decode batch sizes %s in %.1f s%s",
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
