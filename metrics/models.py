"""Metrics of a server of several models: loads, unloads and each model's state, and one exposition
of every model's own registry (each engine's ``PrometheusObserver`` keeps its own) with these."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

STATES = ("unloaded", "loading", "loaded", "failed")
# Loading a model takes from a fraction of a second (a small encoder) to minutes (a large GGUF file).
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ModelMetrics:
    """The registry's series, each labelled ``model_name`` as every engine series is."""

    def __init__(self) -> None:
        reg = self.registry = CollectorRegistry()
        # The process's series once, here, rather than in each model's registry.
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        labels = ["model_name"]
        self.loads = Counter("servelm_model_loads", "Models loaded (on demand or at start-up).", labels, registry=reg)
        self.load_failures = Counter("servelm_model_load_failures", "Model loads that failed.", labels, registry=reg)
        self.load_seconds = Histogram(
            "servelm_model_load_seconds", "Seconds a model took to load.", labels, registry=reg, buckets=LOAD_BUCKETS
        )
        self.unloads = Counter(
            "servelm_model_unloads",
            "Models unloaded, by reason (keep_alive, budget, request).",
            [*labels, "reason"],
            registry=reg,
        )
        self.waits = Counter(
            "servelm_model_load_waits", "Requests that waited for their model to load.", labels, registry=reg
        )
        self.wait_seconds = Histogram(
            "servelm_model_load_wait_seconds",
            "Seconds a request waited for its model to load.",
            labels,
            registry=reg,
            buckets=LOAD_BUCKETS,
        )
        self.states = Gauge(
            "servelm_model_state", "1 for the state each model is in.", [*labels, "state"], registry=reg
        )

    def state(self, model: str, state: str) -> None:
        for s in STATES:
            self.states.labels(model, s).set(1.0 if s == state else 0.0)

    def loaded(self, model: str, seconds: float) -> None:
        self.loads.labels(model).inc()
        self.load_seconds.labels(model).observe(seconds)

    def load_failed(self, model: str) -> None:
        self.load_failures.labels(model).inc()

    def unloaded(self, model: str, reason: str) -> None:
        self.unloads.labels(model, reason).inc()

    def waited(self, model: str, seconds: float) -> None:
        self.waits.labels(model).inc()
        self.wait_seconds.labels(model).observe(seconds)


class MergedRegistry:
    """The families of several registries as one (series of the same name from each model's registry
    become one family), for ``generate_latest``."""

    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries():
            add_families(families, registry.collect())
        yield from families.values()


def add_families(into: dict[str, Metric], families: Iterable[Metric]) -> None:
    """Each family once: the samples of one already in ``into`` join it."""
    for family in families:
        seen = into.get(family.name)
        if seen is None:
            into[family.name] = family
        else:
            seen.samples.extend(family.samples)


def render_merged(registries: Callable[[], Iterable[CollectorRegistry]]) -> tuple[bytes, str]:
    return generate_latest(MergedRegistry(registries)), CONTENT_TYPE_LATEST


__all__ = ["MergedRegistry", "ModelMetrics", "render_merged"]
