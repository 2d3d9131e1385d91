"""CPU-checkable parts of the CUDA path: the CUDA-graph size ladder and buffers, the fused-or-plain
choice per graph size, KV budget arithmetic."""

from __future__ import annotations

import pytest
import torch

from servelm.runtime.cuda import pdl as pdl_state
from servelm.runtime.cuda.graph_inputs import GraphInputs, capture_sizes, padded_size
from servelm.runtime.cuda.graph_variants import VariantTiming, choose_variant, few_row_tolerance
from servelm.runtime.cuda.graphs import CudaGraphRunner
from servelm.runtime.cuda.memory import MemoryProfile

GiB = 2**30


def test_capture_sizes_double_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_a_batch_pads_to_the_next_captured_size() -> None:
    sizes = capture_sizes(48)
    assert [padded_size(sizes, n) for n in (1, 3, 8, 9, 33, 48)] == [1, 4, 8, 16, 48, 48]
    assert padded_size(sizes, 49) is None


def test_fill_copies_real_rows_and_neutralises_padding() -> None:
    buf = GraphInputs.allocate(8, 4, torch.device("cpu"))
    # Leftovers from a previous, larger step.
    buf.slot_mapping.fill_(123)
    buf.seq_lens.fill_(50)
    buf.block_tables.fill_(7)
    buf.fill(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([10, 3, 0]),
        slot_mapping=torch.tensor([42, 19, 0]),
        seq_lens=torch.tensor([11, 4, 1], dtype=torch.int32),
        block_tables=torch.tensor([[2, 9], [4, 0], [1, 0]], dtype=torch.int32),
        padded_to=4,
    )
    assert buf.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert buf.slot_mapping[:4].tolist() == [42, 19, 0, -1]
    assert buf.seq_lens[:4].tolist() == [11, 4, 1, 1]
    assert buf.context_lens[:4].tolist() == [10, 3, 0, 0]
    assert buf.block_tables[:3, :2].tolist() == [[2, 9], [4, 0], [1, 0]]
    assert buf.block_tables[3, 0] == 0
    assert buf.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        buf.fill(
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.int32),
            torch.zeros(1, 5, dtype=torch.int32),
            padded_to=1,
        )


@pytest.mark.parametrize("full_rows", [True, False])
def test_stage_writes_a_step_from_host_lists_with_padding_and_pending_tokens(
    monkeypatch: pytest.MonkeyPatch, full_rows: bool
) -> None:
    import servelm.runtime.cuda.graph_inputs as cg

    if not full_rows:  # long contexts x many rows: only the used columns are sent
        monkeypatch.setattr(cg, "FULL_TABLE_ROWS_MAX_BYTES", 0)
    buf = GraphInputs.allocate(8, 4, torch.device("cpu"))
    # Leftovers from a previous, larger step.
    buf.i64.fill_(123)
    buf.i32.fill_(50)
    buf.block_tables.fill_(7)
    last = torch.tensor([900, 901, 902])  # the previous step's tokens, row by row
    buf.stage(
        [5, 0, 7],
        [10, 3, 0],
        [42, 19, 0],
        [11, 4, 1],
        [2, 9, 4, 0, 1, 0],
        2,
        4,
        pending_at=[1],
        pending_from=[2],
        last_tokens=last,
    )
    assert buf.input_ids[:4].tolist() == [5, 902, 7, 0]  # row 1 took the pending token
    assert buf.positions[:4].tolist() == [10, 3, 0, 0]
    assert buf.slot_mapping.tolist() == [42, 19, 0] + [-1] * 5
    assert buf.seq_lens.tolist() == [11, 4, 1] + [1] * 5
    assert buf.context_lens.tolist() == [10, 3, 0] + [0] * 5
    assert buf.block_tables[:3, :2].tolist() == [[2, 9], [4, 0], [1, 0]] and buf.block_tables[3, 0] == 0
    # Whole rows sent: the unused columns are cleared too; else they keep stale ids (never read).
    assert buf.block_tables[:4, 2:].unique().tolist() == ([0] if full_rows else [7])
    assert buf.block_tables[4:].unique().tolist() == [7]  # rows past the padded size untouched
    assert buf.rows[:3].tolist() == [0, 1, 2] and buf.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="exceeds"):
        buf.stage([1], [0], [0], [1], [0] * 5, 5, 1)
    with pytest.raises(ValueError, match="do not fit"):
        buf.stage([1] * 3, [0] * 3, [0] * 3, [1] * 3, [0] * 3, 1, 2)
    with pytest.raises(ValueError, match="pending"):
        buf.stage([0], [0], [0], [1], [0], 1, 1, pending_at=[0], pending_from=[0])


def test_kv_budget_is_the_allowed_fraction_minus_everything_else() -> None:
    prof = MemoryProfile(total=100 * GiB, torch_peak=20 * GiB, non_torch=2 * GiB, scratch=1 * GiB)
    # 90 allowed - (20 - 1) torch peak without the scratch pool - 2 outside torch - 1 reserved.
    assert prof.kv_budget(0.9, reserve_bytes=1 * GiB) == 68 * GiB
    assert prof.kv_budget(0.2) < 0
    assert "KV" in prof.describe(0.9)


def test_the_fused_graph_is_kept_only_when_faster_and_in_agreement() -> None:
    assert choose_variant(fused_ms=4.1, plain_ms=4.4, rel_diff=3e-3, tolerance=1e-2) == "fused"
    assert choose_variant(fused_ms=4.5, plain_ms=4.4, rel_diff=3e-3, tolerance=1e-2) == "plain"
    assert (
        choose_variant(fused_ms=4.1, plain_ms=4.4, rel_diff=0.5, tolerance=1e-2) == "plain"
    )  # a wrong kernel is never kept
    assert choose_variant(fused_ms=4.1, plain_ms=4.4, rel_diff=float("nan"), tolerance=1e-2) == "plain"
    assert VariantTiming(4.1, 4.4, 1e-3, 1e-2).chosen == "fused"


def test_the_agreement_needed_scales_with_the_activation_dtype() -> None:
    # What an H200 measured after 32 layers of the Llama-3-8B shape (float32 2.9e-6, bfloat16 3.1e-2)
    # passes; a kernel off by a few percent in float32, or by O(1) in any dtype, does not.
    assert VariantTiming(3.97, 4.33, 2.9e-6, few_row_tolerance(torch.float32)).chosen == "fused"
    assert VariantTiming(3.97, 4.33, 3e-2, few_row_tolerance(torch.float32)).chosen == "plain"
    for dtype in (torch.bfloat16, torch.float16):
        assert VariantTiming(3.97, 4.33, 3.1e-2, few_row_tolerance(dtype)).chosen == "fused"
        assert VariantTiming(3.97, 4.33, 0.7, few_row_tolerance(dtype)).chosen == "plain"


class _Backend:
    def build_metadata(self, meta):
        return meta


def _graph_runner(
    kernels,
    few_rows_max: int,
    ab: bool,
    captures: list,
    compare=None,
    fail_fused: bool = False,
    pdl: bool = False,
    fail_pdl: bool = False,
):
    """A CudaGraphRunner on CPU whose capture and timing are recorded instead of run."""
    g = CudaGraphRunner(
        lambda *a: None,
        _Backend(),
        8,
        4,
        16,
        torch.device("cpu"),
        few_rows=kernels,
        few_rows_max=few_rows_max,
        few_rows_ab=ab,
        pdl=pdl,
    )

    def capture_one(bs, meta):
        launched = pdl_state.active()
        captures.append((bs, kernels.max_rows, "pdl") if launched else (bs, kernels.max_rows))
        if fail_fused and kernels.max_rows:
            raise RuntimeError("no kernel image for this GPU")
        if fail_pdl and launched:
            raise RuntimeError("operation not permitted when stream is capturing")
        return (f"graph {bs} max_rows {kernels.max_rows}" + (" pdl" if launched else ""), None)

    g._capture_one = capture_one
    g._compare = compare or (lambda fused, plain, with_pdl, bs: VariantTiming(1.0, 2.0, 1e-3, 1e-2))
    return g


def test_each_small_size_is_captured_both_ways_and_the_faster_kept() -> None:
    from servelm.runtime.model_kernels import FewRowKernels

    kernels = FewRowKernels(None, None, None, max_rows=0)
    captures: list = []
    g = _graph_runner(kernels, 4, True, captures)
    for bs in (8, 4, 2, 1):
        g._capture_size(bs, g.static_metadata(bs))
    # Largest first; sizes above 4 only plain; each of 4, 2, 1 fused (max_rows = size) then plain.
    assert captures == [(8, 0), (4, 4), (4, 0), (2, 2), (2, 0), (1, 1), (1, 0)]
    assert g.fused_sizes == {1, 2, 4} and sorted(g.variants) == [1, 2, 4]
    assert kernels.max_rows == 0  # eager steps stay plain in auto mode

    # Plain faster at one size: that size keeps the plain graph.
    captures.clear()
    slow = {2}
    state = {"bs": 0}

    def compare(fused, plain, with_pdl, bs):
        return VariantTiming(3.0, 2.0, 1e-3, 1e-2) if state["bs"] in slow else VariantTiming(1.0, 2.0, 1e-3, 1e-2)

    g = _graph_runner(kernels, 4, True, captures, compare)
    kept = {}
    for bs in (2, 1):
        state["bs"] = bs
        kept[bs] = g._capture_size(bs, g.static_metadata(bs))[0]
    assert kept == {2: "graph 2 max_rows 0", 1: "graph 1 max_rows 1"}
    assert g.fused_sizes == {1} and g.variants[2].chosen == "plain"


def test_forced_fused_graphs_skip_the_ab_and_a_failing_kernel_falls_back_to_plain() -> None:
    from servelm.runtime.model_kernels import FewRowKernels

    kernels = FewRowKernels(None, None, None, max_rows=4)
    captures: list = []
    g = _graph_runner(kernels, 4, False, captures)
    assert g._capture_size(2, g.static_metadata(2))[0] == "graph 2 max_rows 2"
    assert captures == [(2, 2)] and g.fused_sizes == {2} and not g.variants

    captures.clear()
    g = _graph_runner(kernels, 4, True, captures, fail_fused=True)
    assert g._capture_size(4, g.static_metadata(4))[0] == "graph 4 max_rows 0"
    assert g._capture_size(2, g.static_metadata(2))[0] == "graph 2 max_rows 0"
    # After the failure no size tries the fused kernels again.
    assert captures == [(4, 4), (4, 0), (2, 0)] and g.few_rows_max == 0 and not g.fused_sizes


def test_decode_gemv_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from servelm.runtime.cuda.flash_backend import decode_gemv_mode

    monkeypatch.delenv("SERVELM_DECODE_GEMV", raising=False)
    assert decode_gemv_mode() == "auto"
    for value, mode in (("ON", "on"), (" off ", "off"), ("", "auto")):
        monkeypatch.setenv("SERVELM_DECODE_GEMV", value)
        assert decode_gemv_mode() == mode
    monkeypatch.setenv("SERVELM_DECODE_GEMV", "fast")
    with pytest.raises(ValueError, match="SERVELM_DECODE_GEMV"):
        decode_gemv_mode()


def test_the_pdl_graph_is_kept_only_when_faster_and_bit_identical() -> None:
    assert choose_variant(4.0, 4.4, 3e-2, 0.1, pdl_ms=3.8, pdl_identical=True) == "fused+pdl"
    assert (
        choose_variant(4.0, 4.4, 3e-2, 0.1, pdl_ms=3.8, pdl_identical=False) == "fused"
    )  # a race shows as a difference
    assert choose_variant(4.0, 4.4, 3e-2, 0.1, pdl_ms=4.1, pdl_identical=True) == "fused"
    assert choose_variant(4.0, 3.7, 3e-2, 0.1, pdl_ms=3.8, pdl_identical=True) == "plain"
    # The PDL graph is the fused graph launched differently: never kept when fused may not be.
    assert choose_variant(4.0, 4.4, 0.5, 0.1, pdl_ms=3.0, pdl_identical=True) == "plain"
    # Without a plain graph (SERVELM_DECODE_GEMV=on) fused stands alone against its PDL twin.
    assert choose_variant(4.0, None, float("nan"), 0.1, pdl_ms=3.9, pdl_identical=True) == "fused+pdl"
    assert choose_variant(4.0, None, float("nan"), 0.1) == "fused"
    v = VariantTiming(3.97, 4.33, 3.1e-2, 0.1, 3.80, True)
    assert v.chosen == "fused+pdl" and "with PDL 3.800 ms (identical outputs)" in v.describe()
    assert "plain 4.330 ms" in v.describe() and v.describe().endswith("-> fused+pdl")


def test_with_pdl_each_fused_size_is_also_captured_launched_with_it() -> None:
    from servelm.runtime.model_kernels import FewRowKernels

    kernels = FewRowKernels(None, None, None, max_rows=0)
    captures: list = []
    seen: list = []

    def compare(fused, plain, with_pdl, bs):
        seen.append((fused[0], plain[0] if plain else None, with_pdl[0] if with_pdl else None))
        return VariantTiming(4.0, 4.4, 1e-2, 0.1, 3.8, True)

    g = _graph_runner(kernels, 1, True, captures, compare, pdl=True)
    kept = [g._capture_size(bs, g.static_metadata(bs))[0] for bs in (2, 1)]
    assert captures == [(2, 0), (1, 1), (1, 1, "pdl"), (1, 0)]
    assert seen == [("graph 1 max_rows 1", "graph 1 max_rows 0", "graph 1 max_rows 1 pdl")]
    assert kept == ["graph 2 max_rows 0", "graph 1 max_rows 1 pdl"]
    assert g.fused_sizes == {1} and g.pdl_sizes == {1}
    assert not pdl_state.active()  # only the capture itself launched with it

    # Forced fused (no plain graph): the PDL twin is still A/B'd against the fused graph.
    captures.clear()
    seen.clear()
    g = _graph_runner(kernels, 1, False, captures, compare, pdl=True)
    assert g._capture_size(1, g.static_metadata(1))[0] == "graph 1 max_rows 1 pdl"
    assert captures == [(1, 1), (1, 1, "pdl")] and seen == [("graph 1 max_rows 1", None, "graph 1 max_rows 1 pdl")]


def test_a_pdl_capture_that_fails_leaves_the_fused_and_plain_a_b() -> None:
    from servelm.runtime.model_kernels import FewRowKernels

    kernels = FewRowKernels(None, None, None, max_rows=0)
    captures: list = []
    seen: list = []

    def compare(fused, plain, with_pdl, bs):
        seen.append(with_pdl)
        return VariantTiming(4.0, 4.4, 1e-2, 0.1)

    g = _graph_runner(kernels, 2, True, captures, compare, pdl=True, fail_pdl=True)
    assert g._capture_size(2, g.static_metadata(2))[0] == "graph 2 max_rows 2"
    assert g._capture_size(1, g.static_metadata(1))[0] == "graph 1 max_rows 1"
    assert captures == [(2, 2), (2, 2, "pdl"), (2, 0), (1, 1), (1, 0)]  # not tried again after the failure
    assert seen == [None, None] and not g.pdl and not g.pdl_sizes and not pdl_state.active()


def test_the_a_b_decodes_write_fresh_slots_of_the_first_blocks_then_the_rows_pad_again() -> None:
    g = CudaGraphRunner(lambda *a: None, _Backend(), 4, 4, 16, torch.device("cpu"), num_kv_blocks=3)
    b = g.inputs
    assert g._decode_inputs(2, 5)
    assert b.slot_mapping[:2].tolist() == [5, 16 + 5] and b.block_tables[:2, 0].tolist() == [0, 1]
    assert (
        b.positions[:2].tolist() == [5, 5]
        and b.seq_lens[:2].tolist() == [6, 6]
        and b.context_lens[:2].tolist() == [5, 5]
    )
    first = b.input_ids[:2].tolist()
    assert g._decode_inputs(1, 5) and b.input_ids[0].item() != first[0]  # another size: other tokens, other K/V
    assert not g._decode_inputs(4, 1)  # more rows than pool blocks
    assert not g._decode_inputs(1, 16)  # past the first block
    g._pad_inputs()
    assert b.slot_mapping.tolist() == [-1] * 4 and b.seq_lens.tolist() == [1] * 4
    assert b.context_lens.tolist() == [0] * 4 and b.block_tables.sum().item() == 0


def test_pdl_is_tried_only_where_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl_state.unavailable_reason(torch.device("cpu")) == "not a CUDA device"
    monkeypatch.setenv("SERVELM_PDL", "0")
    assert "SERVELM_PDL" in pdl_state.unavailable_reason(torch.device("cuda"))
    assert pdl_state.launch_kwargs() == {"PDL": False}
    with pdl_state.launching(True):
        assert pdl_state.launch_kwargs() == {"PDL": True, "launch_pdl": True}
        with pdl_state.launching(False):
            assert pdl_state.launch_kwargs() == {"PDL": False}
        assert pdl_state.active()
    assert not pdl_state.active()


class _Clock:
    now = 0.0


class _Event:
    """torch.cuda.Event on a fake clock that graph replays advance."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = _Clock.now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return end.t - self.t


class _Graph:
    """A 'graph' over the runner's static inputs and a KV 'pool' (one value per slot): it stores each
    row's new value at its slot, then sums the row's context. ``racy`` reads before it stores."""

    def __init__(
        self, g: CudaGraphRunner, pool: torch.Tensor, ms: float, scale: float = 1.0, racy: bool = False
    ) -> None:
        self.g, self.pool, self.ms, self.scale, self.racy = g, pool, ms, scale, racy
        self.out = torch.zeros(g.max_batch_size, 1)

    def replay(self) -> None:
        b = self.g.inputs
        for r in range(self.g.max_batch_size):
            slot, n = int(b.slot_mapping[r]), int(b.seq_lens[r])
            block = int(b.block_tables[r, 0])
            start = block * self.g.block_size
            early = self.pool[start : start + n].sum() if self.racy else None
            if slot >= 0:
                self.pool[slot] = float(b.input_ids[r]) * self.scale
            self.out[r] = early if early is not None else self.pool[start : start + n].sum()
        _Clock.now += self.ms


def test_the_a_b_times_each_graph_and_catches_a_pdl_graph_that_reads_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for racy in (False, True):
        g = CudaGraphRunner(lambda *a: None, _Backend(), 2, 4, 16, torch.device("cpu"), num_kv_blocks=8)
        pool = torch.zeros(8 * 16)
        graphs = [
            _Graph(g, pool, ms, scale, r) for ms, scale, r in ((4.0, 1.0, False), (4.4, 1.001, False), (3.8, 1.0, racy))
        ]
        fused, plain, with_pdl = ((gr, gr.out) for gr in graphs)
        v = g._compare(fused, plain, with_pdl, 1)
        assert (v.fused_ms, v.plain_ms, v.pdl_ms) == pytest.approx((4.0, 4.4, 3.8))
        assert 1e-4 < v.rel_diff < 2e-3  # the plain graph's 0.1% difference, measured on real decodes
        assert v.pdl_identical is not racy
        assert v.chosen == ("fused" if racy else "fused+pdl")
        assert pool[1:5].abs().sum() > 0 and g.inputs.slot_mapping.tolist() == [-1, -1]  # wrote slots, padded again


def test_the_head_runs_inside_the_graphs_of_the_a_b_sizes_only() -> None:
    from servelm.runtime.model_kernels import FewRowKernels

    kernels = FewRowKernels(None, None, None, max_rows=0)

    def build(**kw):
        return CudaGraphRunner(lambda *a: None, _Backend(), 8, 4, 16, torch.device("cpu"), few_rows=kernels, **kw)

    g = build(few_rows_max=1, head=lambda h: h)
    assert g.returns_logits(1) and not g.returns_logits(2) and not g.returns_logits(9)
    assert not build(few_rows_max=1).returns_logits(1)  # no head given
    assert not build(few_rows_max=0, head=lambda h: h).returns_logits(1)  # no few-row sizes: no head inside
    assert build(few_rows_max=4, head=lambda h: h).returns_logits(3)  # 3 decodes replay the graph of 4


def test_gpu_kernel_events_reads_real_profiler_events() -> None:
    """On a CPU-only run the profiler records CPU ops only: none of them is a GPU kernel."""
    from torch.profiler import ProfilerActivity, profile

    from servelm.runtime.cuda.profiling import gpu_kernel_events

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert prof.events() and gpu_kernel_events(prof) == []
