"""Where ``--data-parallel-size`` puts its engine cores (``server.dp_placement``): CPU shares, GPUs, the
refusals, and the KV-event sockets each core binds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from servelm.scheduler.config import EngineConfig
from servelm.server.dp_placement import PlacementError, kv_events_for_core, plan_placements


@pytest.fixture
def eight_cpus(monkeypatch: Any) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4, 5, 6, 7})


def test_cpu_cores_get_disjoint_shares_and_that_many_threads(eight_cpus: None) -> None:
    plan = plan_placements(EngineConfig(), 2, None)
    assert [pl.cpus for pl, _ in plan] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [c.num_threads for _, c in plan] == [4, 4]
    assert [pl.cuda_devices for pl, _ in plan] == [None, None]
    uneven = plan_placements(EngineConfig(), 3, None)
    assert [len(pl.cpus or ()) for pl, _ in uneven] == [2, 3, 3]


def test_threads_given_or_split_between_tensor_parallel_ranks(eight_cpus: None) -> None:
    assert [c.num_threads for _, c in plan_placements(EngineConfig(num_threads=2), 2, None)] == [2, 2]
    assert [c.num_threads for _, c in plan_placements(EngineConfig(tensor_parallel_size=2), 2, None)] == [2, 2]


def test_more_cores_than_cpus_is_refused(eight_cpus: None) -> None:
    with pytest.raises(PlacementError, match="needs at least 9 CPUs"):
        plan_placements(EngineConfig(), 9, None)
    with pytest.raises(PlacementError, match="needs at least 10 CPUs"):
        plan_placements(EngineConfig(tensor_parallel_size=2), 5, None)


def test_each_cuda_core_sees_its_own_gpus(monkeypatch: Any) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = plan_placements(EngineConfig(device="cuda"), 2, 4)
    assert [pl.cuda_devices for pl, _ in plan] == ["0", "1"]
    assert [pl.cpus for pl, _ in plan] == [None, None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert [pl.cuda_devices for pl, _ in plan_placements(EngineConfig(device="auto"), 3, 3)] == ["3", "5", "7"]
    tp = plan_placements(EngineConfig(device="cuda", tensor_parallel_size=1), 1, 3)
    assert tp[0][0].cuda_devices == "3"


def test_too_few_gpus_or_a_named_gpu_is_refused(monkeypatch: Any) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(PlacementError, match="needs 4 GPUs; this process sees 3"):
        plan_placements(EngineConfig(device="cuda", tensor_parallel_size=2), 2, 3)
    with pytest.raises(PlacementError, match="names one GPU"):
        plan_placements(EngineConfig(device="cuda:1"), 2, 4)


def test_each_core_binds_its_own_kv_event_sockets() -> None:
    on = json.dumps({"enable_kv_cache_events": True})
    assert kv_events_for_core(on, "127.0.0.1", 0) == on
    second = json.loads(kv_events_for_core(on, "127.0.0.1", 1))
    assert second["endpoint"] == "tcp://127.0.0.1:5558"
    given = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6100"})
    third = json.loads(kv_events_for_core(given, "127.0.0.1", 2))
    assert (third["endpoint"], third["replay_endpoint"]) == ("tcp://*:6002", "tcp://*:6102")
    ipc = json.loads(
        kv_events_for_core(json.dumps({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/kv"}), "h", 1)
    )
    assert ipc["endpoint"] == "ipc:///tmp/kv-1"
    # A broker's address (connected to, not bound) is every core's.
    broker = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.5:7000", "bind": False})
    assert json.loads(kv_events_for_core(broker, "127.0.0.1", 1))["endpoint"] == "tcp://10.0.0.5:7000"
    off = json.dumps({"enable_kv_cache_events": False})
    assert kv_events_for_core(off, "127.0.0.1", 1) == off
