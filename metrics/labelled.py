"""One exposition of several engine cores' (``--data-parallel-size``): each core renders its own registry in
its own process; here each of their samples gets the core's label and every family is written once,
followed by the series of the process that merges them (its own ``process_*`` and ``python_*``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from servelm.metrics.models import add_families


class LabelledExpositions:
    """Text expositions parsed back into families, every sample of the ``i``-th labelled
    ``label="i"``; a registry-like object for ``generate_latest``."""

    def __init__(self, expositions: Sequence[bytes], label: str, own: CollectorRegistry | None) -> None:
        self.expositions = expositions
        self.label = label
        self.own = own

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for i, body in enumerate(self.expositions):
            for family in text_string_to_metric_families(body.decode()):
                seen = families.get(family.name)
                if seen is None:
                    seen = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                seen.samples.extend(
                    Sample(s.name, {**s.labels, self.label: str(i)}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                )
        if self.own is not None:
            add_families(families, self.own.collect())
        yield from families.values()


def render_labelled(
    expositions: Sequence[bytes], label: str = "engine", own: CollectorRegistry | None = REGISTRY
) -> tuple[bytes, str]:
    """The merged exposition and its content type (``own``: this process's registry, or None)."""
    return generate_latest(LabelledExpositions(expositions, label, own)), CONTENT_TYPE_LATEST


__all__ = ["LabelledExpositions", "render_labelled"]
