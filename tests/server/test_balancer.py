"""The data-parallel balancer (``server.balancer``) on its own: vLLM's load rule with the KV term, requests
sent but not yet acknowledged counted as waiting, and prefix affinity kept until a core is overloaded."""

from __future__ import annotations

from servelm.server.balancer import AFFINITY_BLOCKS, AFFINITY_MARGIN, KV_WEIGHT, CoreLoad, choose_core, prefix_key


def test_score_is_four_waiting_plus_running_plus_kv_use() -> None:
    assert CoreLoad(num_running=3, num_waiting=2).score == 11
    assert CoreLoad(num_waiting=1, num_pending=2).score == 12  # sent, not yet acknowledged: waiting
    assert CoreLoad(num_used_blocks=50, num_blocks=100).score == KV_WEIGHT / 2
    assert CoreLoad(num_used_blocks=50).score == 0  # the pool's size unknown: no KV term


def test_no_prefix_goes_to_the_least_loaded_core() -> None:
    loads = [CoreLoad(num_running=4), CoreLoad(num_waiting=1), CoreLoad(num_running=1)]
    assert choose_core(loads, None) == 2
    assert choose_core([CoreLoad(num_running=2), CoreLoad(num_used_blocks=90, num_blocks=100)], None) == 0


def test_equal_cores_are_taken_in_turn() -> None:
    idle = [CoreLoad(), CoreLoad(), CoreLoad()]
    assert [choose_core(idle, None, start=t) for t in range(4)] == [0, 1, 2, 0]


def test_a_burst_spreads_evenly_before_any_core_reports() -> None:
    pending = [0, 0]
    for t in range(8):
        i = choose_core([CoreLoad(num_pending=p) for p in pending], None, start=t)
        pending[i] += 1
    assert pending == [4, 4]


def test_affinity_keeps_the_preferred_core_within_the_margin() -> None:
    key = 1  # prefers core 1 of 2
    assert choose_core([CoreLoad(), CoreLoad()], key) == 1
    assert choose_core([CoreLoad(), CoreLoad(num_running=int(AFFINITY_MARGIN))], key) == 1
    assert choose_core([CoreLoad(), CoreLoad(num_running=int(AFFINITY_MARGIN) + 1)], key) == 0
    assert choose_core([CoreLoad(num_running=5), CoreLoad(num_running=int(AFFINITY_MARGIN) + 5)], key) == 1


def test_prefix_key_hashes_the_first_full_blocks_only() -> None:
    bs = 4
    assert prefix_key([1, 2, 3], bs) is None  # not one full block: nothing of it would be cached
    assert prefix_key([1, 2, 3, 4], bs) == prefix_key([1, 2, 3, 4, 5, 6], bs)
    assert prefix_key([1, 2, 3, 4, 5, 6, 7, 8], bs) != prefix_key([1, 2, 3, 4, 5, 6, 7, 9], bs)
    head = list(range(AFFINITY_BLOCKS * bs))
    assert prefix_key([*head, 1, 2, 3, 4], bs) == prefix_key([*head, 5, 6, 7, 8], bs)  # past the affinity blocks
    assert prefix_key(head, bs, "salt") != prefix_key(head, bs)
    assert prefix_key(head, bs, "a") != prefix_key(head, bs, "b")
    assert prefix_key(head, 0) is None
