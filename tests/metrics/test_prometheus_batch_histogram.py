"""BatchHistogram: a step's values observed in one call expose exactly what one-by-one observes would."""

from __future__ import annotations

import math
import random
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from servelm.metrics.batch_histogram import BatchHistogram
from servelm.metrics.observer import StepStats
from servelm.metrics.prometheus import REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, PrometheusObserver

TTFT = "servelm_time_to_first_token_seconds"
ITL = "servelm_inter_token_latency_seconds"


def lines_of(registry: CollectorRegistry, name: str) -> list[str]:
    """The exposition lines of histogram ``name``, HELP/TYPE included, with the ``_created`` value
    masked (two histograms are created at different times; that the series exists is still compared)."""
    series = {name + suffix for suffix in ("", "_bucket", "_count", "_sum", "_created")}
    out = []
    for line in generate_latest(registry).decode().splitlines():
        comment = line.startswith("#")
        metric = line.split(" ")[2] if comment else line.split("{")[0].split(" ")[0]
        if metric in series:
            out.append(line.rsplit(" ", 1)[0] + " <t>" if metric == name + "_created" and not comment else line)
    return out


def reference(name: str, buckets: tuple[float, ...], steps: list[list[float]]) -> list[str]:
    """What prometheus_client's own Histogram exposes after observing every value one at a time."""
    reg = CollectorRegistry()
    doc = {TTFT: "Arrival to first output token.", ITL: "Gap between consecutive output tokens."}[name]
    h = Histogram(name, doc, ["model_name"], registry=reg, buckets=buckets).labels("tiny")
    for values in steps:
        for v in values:
            h.observe(v)
    return lines_of(reg, name)


def observed(steps_ttft: list[list[float]], steps_itl: list[list[float]]) -> CollectorRegistry:
    obs = PrometheusObserver("tiny", {}, 1e12, 1e11, registry=CollectorRegistry())
    for ttft, itl in zip(steps_ttft, steps_itl):
        obs.on_step(
            StepStats(0.01, len(itl), 0, 0.5, 0, len(itl), time_to_first_tokens=ttft, inter_token_latencies=itl)
        )
    return obs.registry


def edge_values(buckets: tuple[float, ...]) -> list[float]:
    """0, every bound exactly, just above and below each, and values past the last bound."""
    out = [0.0, 0, -0.0]
    for b in buckets:
        out += [b, math.nextafter(b, math.inf), math.nextafter(b, 0.0)]
    return out + [buckets[-1] * 1.5, 1e9]


def test_bulk_equals_one_by_one_on_bounds_zero_and_overflow() -> None:
    rng = random.Random(0)
    steps_ttft, steps_itl = [], []
    for _ in range(5):  # several steps: the sum must accumulate across calls in the same order
        ttft = edge_values(REQUEST_LATENCY_BUCKETS) + [rng.uniform(0, 700) for _ in range(50)]
        itl = edge_values(TOKEN_LATENCY_BUCKETS) + [rng.lognormvariate(-4, 1.5) for _ in range(256)]
        rng.shuffle(ttft)
        rng.shuffle(itl)
        steps_ttft.append(ttft)
        steps_itl.append(itl)
        # and short lists (small batches), which take the per-value path, between the long ones
        steps_ttft.append(rng.sample(ttft, 3))
        steps_itl.append(rng.sample(itl, BatchHistogram.VECTORIZE_FROM - 1))
    steps_ttft.append([])  # a step with no first tokens (and, below, no gaps) changes nothing
    steps_itl.append([])
    reg = observed(steps_ttft, steps_itl)
    for name, buckets, steps in ((TTFT, REQUEST_LATENCY_BUCKETS, steps_ttft), (ITL, TOKEN_LATENCY_BUCKETS, steps_itl)):
        got, want = lines_of(reg, name), reference(name, buckets, steps)
        assert got == want
        # The comparison covers every series: len(bounds) + 1 buckets, _count, _sum, _created.
        assert sum(f"{name}_bucket{{" in line for line in got) == len(buckets) + 1
        assert any(line.startswith(f"{name}_count{{") for line in got)
        assert any(line.startswith(f"{name}_sum{{") for line in got)
        assert any(line.startswith(f"{name}_created{{") for line in got)


@pytest.mark.parametrize("pad", [0, BatchHistogram.VECTORIZE_FROM])  # a short list (bisect) and a long one (numpy)
@pytest.mark.parametrize("special", [[math.inf], [-math.inf, 0.5], [math.nan, 0.02], [-0.25, 0.01]])
def test_non_finite_and_negative_values_match_histogram(special: list[float], pad: int) -> None:
    steps = [[0.004, 0.01], special + [0.0025] * pad, [0.3]]
    assert lines_of(observed([[]] * 3, steps), ITL) == reference(ITL, TOKEN_LATENCY_BUCKETS, steps)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.one_of(st.floats(0, 100), st.sampled_from(TOKEN_LATENCY_BUCKETS)), max_size=40), max_size=4)
)
def test_bulk_equals_one_by_one_property(steps: list[list[float]]) -> None:
    assert lines_of(observed([[]] * len(steps), steps), ITL) == reference(ITL, TOKEN_LATENCY_BUCKETS, steps)


def test_single_observe_and_scrape_in_between() -> None:
    reg, ref = CollectorRegistry(), CollectorRegistry()
    h = BatchHistogram("x_seconds", "X.", {"model_name": "tiny"}, (0.1, 1.0), reg)
    r = Histogram("x_seconds", "X.", ["model_name"], registry=ref, buckets=(0.1, 1.0)).labels("tiny")
    for v in (0.1, 0.5, 2.0):
        h.observe(v)
        r.observe(v)
        assert lines_of(reg, "x_seconds") == lines_of(ref, "x_seconds")


def test_registry_refuses_a_second_metric_of_the_same_name() -> None:
    reg = CollectorRegistry()
    BatchHistogram("x_seconds", "X.", {"model_name": "tiny"}, (0.1, 1.0), reg)
    with pytest.raises(ValueError, match="Duplicated"):
        Histogram("x_seconds", "X.", ["model_name"], registry=reg)


@pytest.mark.parametrize("buckets", [(1.0, 0.5), (-1.0, 1.0)])
def test_rejects_unsorted_or_negative_buckets(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="sorted and non-negative"):
        BatchHistogram("x_seconds", "X.", {}, buckets, CollectorRegistry())


def test_scrape_during_observes_sees_one_consistent_snapshot() -> None:
    # Scraping runs on the server's thread while the engine thread observes: every scrape must see
    # buckets, count and sum of the same set of steps (here all values are 1.0, so sum == count).
    reg = CollectorRegistry()
    h = BatchHistogram("x_seconds", "X.", {"model_name": "tiny"}, (0.5, 2.0), reg)
    stop = threading.Event()
    seen: list[tuple[float, float, float]] = []

    def scrape() -> None:
        while not stop.is_set():
            (family,) = h.collect()
            v = {(s.name, s.labels.get("le")): s.value for s in family.samples}
            seen.append((v[("x_seconds_bucket", "2.0")], v[("x_seconds_count", None)], v[("x_seconds_sum", None)]))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to land inside an observe
    try:
        t = threading.Thread(target=scrape)
        t.start()
        for i in range(3000):
            h.observe_many([1.0] * (7 if i % 2 else 40))  # both paths: per value and numpy
        stop.set()
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert seen and all(b == c == s for b, c, s in seen)
