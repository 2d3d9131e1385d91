"""PrometheusObserver: what the engine reports is exactly what the exposition says."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from servelm.metrics.observer import RequestStats, StepStats
from servelm.metrics.prometheus import PrometheusObserver, render_metrics

INFO = {"model": "/models/tiny", "dtype": "float32", "device": "cpu", "block_size": "16", "num_blocks": "512",
        "max_model_len": "2048"}  # fmt: skip


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def samples(obs: PrometheusObserver) -> dict[tuple[str, frozenset], float]:
    body, ctype = render_metrics(obs.registry)
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(obs_samples: dict, name: str, **labels: str) -> float:
    labels.setdefault("model_name", "tiny")
    return obs_samples[(name, frozenset(labels.items()))]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def obs(clock: FakeClock) -> PrometheusObserver:
    return PrometheusObserver(
        "tiny", INFO, peak_flops=1e12, peak_bandwidth=1e11, registry=CollectorRegistry(), window_s=10.0, clock=clock
    )


STEPS = [
    StepStats(0.5, num_running=2, num_waiting=1, kv_cache_usage=0.25, num_prompt_tokens=300, num_generation_tokens=2,
              prefix_cache_queries=300, prefix_cache_hits=64, flops=4e11, bytes_moved=2e10,
              time_to_first_tokens=[0.6, 0.7]),
    StepStats(0.1, num_running=3, num_waiting=0, kv_cache_usage=0.5, num_prompt_tokens=50, num_generation_tokens=3,
              num_preemptions=1, flops=1e11, bytes_moved=1e10, time_to_first_tokens=[1.25],
              inter_token_latencies=[0.012, 0.1]),
    StepStats(0.05, num_running=0, num_waiting=0, kv_cache_usage=0.0, num_prompt_tokens=0, num_generation_tokens=3,
              flops=5e10, bytes_moved=5e9, inter_token_latencies=[0.05, 0.05, 0.003]),
]  # fmt: skip
REQUESTS = [
    # stop after 4 tokens: e2e 2.0, ttft 0.5, queue 0.25, prefill 0.25, decode 1.2, tpot (2.0-0.5)/3 = 0.5
    RequestStats("stop", 10.0, 10.25, 10.5, 11.7, 12.0, num_prompt_tokens=100, num_generation_tokens=4),
    RequestStats("length", 10.0, 10.5, 11.0, 13.0, 13.0, num_prompt_tokens=200, num_generation_tokens=9),
    # a single-token request: no TPOT
    RequestStats("stop", 20.0, 20.0, 20.1, 20.1, 20.1, num_prompt_tokens=7, num_generation_tokens=1),
    RequestStats("abort", 30.0, 30.1, 30.2, 30.3, 31.0, num_prompt_tokens=5, num_generation_tokens=2),
    RequestStats("error", 40.0, None, None, None, 40.5, num_prompt_tokens=5, num_generation_tokens=0),
]


def drive(obs: PrometheusObserver, clock: FakeClock) -> None:
    for st in STEPS:
        clock.t += st.duration_s
        obs.on_step(st)
    obs.on_step(StepStats(0.001, 0, 0, 0.0, 0, 0))  # an idle step: no tokens, no iteration sample
    for rs in REQUESTS:
        obs.on_request_finished(rs)
    obs.on_request_rejected()
    obs.on_request_rejected()


def test_counters_equal_what_was_sent(obs: PrometheusObserver, clock: FakeClock) -> None:
    drive(obs, clock)
    s = samples(obs)
    assert value(s, "servelm_prompt_tokens_total") == 350
    assert value(s, "servelm_generation_tokens_total") == 8
    assert value(s, "servelm_num_preemptions_total") == 1
    assert value(s, "servelm_prefix_cache_queries_total") == 300
    assert value(s, "servelm_prefix_cache_hits_total") == 64
    assert value(s, "servelm_request_success_total", finished_reason="stop") == 2
    assert value(s, "servelm_request_success_total", finished_reason="length") == 1
    assert value(s, "servelm_request_failure_total", reason="aborted") == 1
    assert value(s, "servelm_request_failure_total", reason="error") == 1
    assert value(s, "servelm_request_failure_total", reason="rejected") == 2


def test_histograms_count_and_sum(obs: PrometheusObserver, clock: FakeClock) -> None:
    drive(obs, clock)
    s = samples(obs)

    def hist(name: str) -> tuple[float, float]:
        return value(s, f"{name}_count"), value(s, f"{name}_sum")

    # TTFT and ITL come from the steps, as they happen.
    assert hist("servelm_time_to_first_token_seconds") == (3, pytest.approx(0.6 + 0.7 + 1.25))
    assert hist("servelm_inter_token_latency_seconds") == (5, pytest.approx(0.012 + 0.1 + 0.05 + 0.05 + 0.003))
    assert hist("servelm_iteration_tokens") == (3, 302 + 53 + 3)
    # Request-level times: successful requests only (the abort and the error are not latencies).
    assert hist("servelm_e2e_request_latency_seconds") == (3, pytest.approx(2.0 + 3.0 + 0.1))
    assert hist("servelm_request_queue_time_seconds") == (3, pytest.approx(0.25 + 0.5 + 0.0))
    assert hist("servelm_request_prefill_time_seconds") == (3, pytest.approx(0.25 + 0.5 + 0.1))
    assert hist("servelm_request_decode_time_seconds") == (3, pytest.approx(1.2 + 2.0 + 0.0))
    # TPOT only for more than one token: (2.0 - 0.5) / 3 and (3.0 - 1.0) / 8.
    assert hist("servelm_time_per_output_token_seconds") == (2, pytest.approx(0.5 + 0.25))
    assert hist("servelm_request_prompt_tokens") == (3, 307)
    assert hist("servelm_request_generation_tokens") == (3, 14)


def test_bucket_placement(obs: PrometheusObserver, clock: FakeClock) -> None:
    drive(obs, clock)
    s = samples(obs)

    def bucket(name: str, le: str) -> float:
        return value(s, f"{name}_bucket", le=le)

    itl = "servelm_inter_token_latency_seconds"
    assert bucket(itl, "0.001") == 0
    assert bucket(itl, "0.005") == 1  # 0.003
    assert bucket(itl, "0.01") == 1
    assert bucket(itl, "0.015") == 2  # 0.012
    assert bucket(itl, "0.05") == 4  # 0.05 twice (le is inclusive)
    assert bucket(itl, "0.1") == 5
    assert bucket(itl, "+Inf") == 5
    toks = "servelm_request_generation_tokens"
    assert [bucket(toks, le) for le in ("1.0", "2.0", "4.0", "8.0", "16.0", "8192.0")] == [1, 1, 2, 2, 3, 3]


def test_gauges_follow_steps_and_return_to_zero_when_idle(obs: PrometheusObserver, clock: FakeClock) -> None:
    clock.t += STEPS[1].duration_s
    obs.on_step(STEPS[1])
    s = samples(obs)
    assert value(s, "servelm_num_requests_running") == 3
    assert value(s, "servelm_num_requests_waiting") == 0
    assert value(s, "servelm_kv_cache_usage_perc") == 0.5
    assert value(s, "servelm_model_flops_utilization") > 0
    clock.t += STEPS[2].duration_s
    obs.on_step(STEPS[2])  # the step that finished the last request
    clock.t += 30.0  # idle: no steps for longer than the utilisation window
    s = samples(obs)
    for name in ("servelm_num_requests_running", "servelm_num_requests_waiting", "servelm_kv_cache_usage_perc",
                 "servelm_model_flops_utilization", "servelm_model_bandwidth_utilization"):  # fmt: skip
        assert value(s, name) == 0, name


def test_utilization_over_the_window(clock: FakeClock) -> None:
    obs = PrometheusObserver(
        "tiny", INFO, peak_flops=1e12, peak_bandwidth=1e11, registry=CollectorRegistry(), window_s=10.0, clock=clock
    )
    clock.t += 20.0  # the observer has lived longer than the window
    for _ in range(4):  # 4 steps of 1 s: 2e11 FLOPs and 5e9 bytes each
        clock.t += 1.0
        obs.on_step(StepStats(1.0, 1, 0, 0.1, 10, 1, flops=2e11, bytes_moved=5e9))
    mfu, mbu = obs.utilization()
    assert mfu == pytest.approx(4 * 2e11 / (10.0 * 1e12))
    assert mbu == pytest.approx(4 * 5e9 / (10.0 * 1e11))
    s = samples(obs)
    assert value(s, "servelm_model_flops_utilization") == pytest.approx(mfu)
    assert value(s, "servelm_model_bandwidth_utilization") == pytest.approx(mbu)
    clock.t += 8.5  # the steps reported at +21 s and +22 s leave the window (now +32.5 s)
    assert obs.utilization()[0] == pytest.approx(2 * 2e11 / (10.0 * 1e12))
    clock.t += 10.0
    assert obs.utilization() == (0.0, 0.0)


def test_utilization_right_after_start_uses_the_time_lived(clock: FakeClock) -> None:
    obs = PrometheusObserver("tiny", INFO, 1e12, 1e11, registry=CollectorRegistry(), window_s=10.0, clock=clock)
    clock.t += 2.0
    obs.on_step(StepStats(2.0, 1, 0, 0.1, 10, 1, flops=1e12, bytes_moved=1e11))
    assert obs.utilization() == (pytest.approx(0.5), pytest.approx(0.5))


def test_unknown_peaks_read_zero(clock: FakeClock) -> None:
    # The server passes inf when it could not determine the peaks: the gauges must stay finite.
    obs = PrometheusObserver("tiny", INFO, math.inf, math.inf, registry=CollectorRegistry(), clock=clock)
    clock.t += 1.0
    obs.on_step(StepStats(1.0, 1, 0, 0.1, 10, 1, flops=1e12, bytes_moved=1e11))
    assert obs.utilization() == (0.0, 0.0)


def test_every_series_has_model_name_and_info(obs: PrometheusObserver, clock: FakeClock) -> None:
    drive(obs, clock)
    body, _ = render_metrics(obs.registry)
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    servelm = [s for f in families.values() for s in f.samples if s.name.startswith("servelm_")]
    assert servelm and all(s.labels.get("model_name") == "tiny" for s in servelm)
    info = [s for s in servelm if s.name == "servelm_model_info"]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels == {"model_name": "tiny", **INFO}
    # Failure and success series exist at 0 before anything happened (dashboards need them).
    fresh = PrometheusObserver("other", {}, 1, 1, registry=CollectorRegistry())
    s = samples(fresh)
    assert value(s, "servelm_request_failure_total", model_name="other", reason="rejected") == 0
    assert value(s, "servelm_request_success_total", model_name="other", finished_reason="length") == 0


def test_observers_are_independent() -> None:
    a = PrometheusObserver("a", {}, 1e12, 1e11)  # each makes its own registry
    b = PrometheusObserver("b", {}, 1e12, 1e11)
    a.on_request_rejected()
    assert value(samples(a), "servelm_request_failure_total", model_name="a", reason="rejected") == 1
    assert value(samples(b), "servelm_request_failure_total", model_name="b", reason="rejected") == 0
    # A private registry still carries the process metrics the global one would.
    assert any(name == "process_cpu_seconds_total" for name, _ in samples(a))


def lora_series(obs: PrometheusObserver) -> list[tuple[dict[str, str], float]]:
    return [(dict(labels), v) for (name, labels), v in samples(obs).items() if name == "servelm_lora_requests_info"]


def test_lora_info_is_one_series_that_follows_the_adapters(clock: FakeClock) -> None:
    """vLLM's lora_requests_info: one series (the current adapters), re-labelled when they change."""
    obs = PrometheusObserver("tiny", INFO, 1e12, 1e11, registry=CollectorRegistry(), clock=clock, max_loras=2)
    ((labels, first),) = lora_series(obs)
    assert labels == {"model_name": "tiny", "max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    obs.on_step(StepStats(0.1, 2, 1, 0.1, 0, 1, lora_adapters=(["a", "b"], ["c"])))
    ((labels, changed),) = lora_series(obs)
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("a,b", "c") and changed >= first
    obs.on_step(StepStats(0.1, 0, 0, 0.0, 0, 1, lora_adapters=([], [])))
    ((labels, _),) = lora_series(obs)
    assert labels["running_lora_adapters"] == "" and labels["waiting_lora_adapters"] == ""
    # Without LoRA serving there is no such series, and steps without the field change nothing.
    plain = PrometheusObserver("tiny", INFO, 1e12, 1e11, registry=CollectorRegistry(), clock=clock)
    plain.on_step(StepStats(0.1, 1, 0, 0.1, 0, 1))
    assert lora_series(plain) == []


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
@pytest.mark.parametrize("max_loras", [None, 2])
def test_exposition_passes_promtool(clock: FakeClock, max_loras: int | None) -> None:
    obs = PrometheusObserver(
        "tiny", INFO, 1e12, 1e11, registry=CollectorRegistry(), window_s=10.0, clock=clock, max_loras=max_loras
    )
    drive(obs, clock)
    obs.on_step(StepStats(0.1, 1, 1, 0.1, 0, 1, lora_adapters=(["sql"], ["poet"]) if max_loras else None))
    body, _ = render_metrics(obs.registry)
    r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_speculative_decoding_counters_carry_vllms_names(obs: PrometheusObserver) -> None:
    """vLLM's spec_decode counters under servelm's prefix: drafts (sequences verified), draft tokens,
    accepted tokens, and accepted tokens per position (label ``position``, 0 the first draft)."""
    obs.on_step(StepStats(0.1, 2, 0, 0.1, 0, 5, num_draft_tokens=6, num_accepted_draft_tokens=3, num_drafts=2,
                          accepted_per_pos=[2, 1]))  # fmt: skip
    obs.on_step(StepStats(0.1, 1, 0, 0.1, 0, 4, num_draft_tokens=3, num_accepted_draft_tokens=3, num_drafts=1,
                          accepted_per_pos=[1, 1, 1]))  # fmt: skip
    s = samples(obs)
    assert value(s, "servelm_spec_decode_num_drafts_total") == 3
    assert value(s, "servelm_spec_decode_num_draft_tokens_total") == 9
    assert value(s, "servelm_spec_decode_num_accepted_tokens_total") == 6
    per_pos = [value(s, "servelm_spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(3)]
    assert per_pos == [3, 2, 1]
