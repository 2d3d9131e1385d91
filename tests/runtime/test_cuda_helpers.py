"""CPU-checkable parts of the CUDA path: the CUDA-graph size ladder and buffers, the fused-or-plain
choice per graph size, KV budget arithmetic."""

from __future__ import annotations

import pytest
import torch

from runtime.cuda_graphs import (
    CudaGraphRunner,
    GraphInputs,
    VariantTiming,
    capture_sizes,
    choose_variant,
    few_row_tolerance,
    padded_size,
)
from runtime.gpu_memory import MemoryProfile

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
        buf.fill(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                 torch.ones(1, dtype=torch.int32), torch.zeros(1, 5, dtype=torch.int32), padded_to=1)


def test_kv_budget_is_the_allowed_fraction_minus_everything_else() -> None:
    prof = MemoryProfile(total=100 * GiB, torch_peak=20 * GiB, non_torch=2 * GiB, scratch=1 * GiB)
    # 90 allowed - (20 - 1) torch peak without the scratch pool - 2 outside torch - 1 reserved.
    assert prof.kv_budget(0.9, reserve_bytes=1 * GiB) == 68 * GiB
    assert prof.kv_budget(0.2) < 0
    assert "KV" in prof.describe(0.9)


def test_the_fused_graph_is_kept_only_when_faster_and_in_agreement() -> None:
    assert choose_variant(fused_ms=4.1, plain_ms=4.4, rel_diff=3e-3, tolerance=1e-2) == "fused"
    assert choose_variant(fused_ms=4.5, plain_ms=4.4, rel_diff=3e-3, tolerance=1e-2) == "plain"
    assert choose_variant(fused_ms=4.1, plain_ms=4.4, rel_diff=0.5, tolerance=1e-2) == "plain"  # a wrong kernel is never kept
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
    def build_metadata(self, meta):  # type: ignore[no-untyped-def]
        return meta


def _graph_runner(kernels, few_rows_max: int, ab: bool, captures: list, compare=None, fail_fused: bool = False):  # type: ignore[no-untyped-def]
    """A CudaGraphRunner on CPU whose capture and timing are recorded instead of run."""
    g = CudaGraphRunner(lambda *a: None, _Backend(), 8, 4, 16, torch.device("cpu"),  # type: ignore[arg-type]
                        few_rows=kernels, few_rows_max=few_rows_max, few_rows_ab=ab)

    def capture_one(bs, meta):  # type: ignore[no-untyped-def]
        captures.append((bs, kernels.max_rows))
        if fail_fused and kernels.max_rows:
            raise RuntimeError("no kernel image for this GPU")
        return (f"graph {bs} max_rows {kernels.max_rows}", None)

    g._capture_one = capture_one  # type: ignore[method-assign]
    g._compare = compare or (lambda fused, plain: VariantTiming(1.0, 2.0, 1e-3, 1e-2))  # type: ignore[method-assign]
    return g


def test_each_small_size_is_captured_both_ways_and_the_faster_kept() -> None:
    from runtime.models.llama import FewRowKernels

    kernels = FewRowKernels(None, None, None, max_rows=0)  # type: ignore[arg-type]
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

    def compare(fused, plain):  # type: ignore[no-untyped-def]
        return VariantTiming(3.0, 2.0, 1e-3, 1e-2) if state["bs"] in slow else VariantTiming(1.0, 2.0, 1e-3, 1e-2)

    g = _graph_runner(kernels, 4, True, captures, compare)
    kept = {}
    for bs in (2, 1):
        state["bs"] = bs
        kept[bs] = g._capture_size(bs, g.static_metadata(bs))[0]
    assert kept == {2: "graph 2 max_rows 0", 1: "graph 1 max_rows 1"}
    assert g.fused_sizes == {1} and g.variants[2].chosen == "plain"


def test_forced_fused_graphs_skip_the_ab_and_a_failing_kernel_falls_back_to_plain() -> None:
    from runtime.models.llama import FewRowKernels

    kernels = FewRowKernels(None, None, None, max_rows=4)  # type: ignore[arg-type]
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
    from runtime.attention.flash_backend import decode_gemv_mode

    monkeypatch.delenv("SERVELM_DECODE_GEMV", raising=False)
    assert decode_gemv_mode() == "auto"
    for value, mode in (("ON", "on"), (" off ", "off"), ("", "auto")):
        monkeypatch.setenv("SERVELM_DECODE_GEMV", value)
        assert decode_gemv_mode() == mode
    monkeypatch.setenv("SERVELM_DECODE_GEMV", "fast")
    with pytest.raises(ValueError, match="SERVELM_DECODE_GEMV"):
        decode_gemv_mode()
