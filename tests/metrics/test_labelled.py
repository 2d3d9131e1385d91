"""Several engine cores' expositions as one (``metrics.labelled``): every sample labelled with its core,
every family's HELP and TYPE once, the merging process's own series beside them unlabelled."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servelm.metrics.labelled import render_labelled


def _core(running: float, finished: int) -> bytes:
    reg = CollectorRegistry()
    Gauge("servelm_num_requests_running", "Requests running.", ["model_name"], registry=reg).labels("m").set(running)
    Counter("servelm_request_success", "Requests finished.", ["model_name"], registry=reg).labels("m").inc(finished)
    h = Histogram("servelm_ttft_seconds", "TTFT.", ["model_name"], buckets=[0.1, 1.0], registry=reg)
    h.labels("m").observe(0.5)
    return generate_latest(reg)


def test_every_core_labelled_every_family_once() -> None:
    own = CollectorRegistry()
    Gauge("api_process_gauge", "The merging process's own.", registry=own).set(7)
    body, content_type = render_labelled([_core(3, 5), _core(1, 2)], own=own)
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in ("servelm_num_requests_running", "servelm_request_success_total", "servelm_ttft_seconds"):
        assert text.count(f"# TYPE {name} ") == 1, text
        assert text.count(f"# HELP {name} ") == 1, text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["engine"]: s.value for s in families["servelm_num_requests_running"].samples}
    assert running == {"0": 3.0, "1": 1.0}
    success = {s.labels["engine"]: s.value for s in families["servelm_request_success"].samples}
    assert success == {"0": 5.0, "1": 2.0}
    buckets = [s for s in families["servelm_ttft_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["engine"], s.labels["le"]) for s in buckets} == {
        (e, le) for e in "01" for le in ("0.1", "1.0", "+Inf")
    }
    assert [(s.labels, s.value) for s in families["api_process_gauge"].samples] == [({}, 7.0)]
