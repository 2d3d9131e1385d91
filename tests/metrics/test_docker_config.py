"""docker/: the Prometheus config is valid, and the dashboard only queries metrics servelm exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from servelm.metrics.observer import RequestStats, StepStats
from servelm.metrics.prometheus import PrometheusObserver, render_metrics

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "servelm.json"


def exported_names() -> set[str]:
    obs = PrometheusObserver("m", {"dtype": "float32"}, 1e12, 1e11, registry=CollectorRegistry())
    obs.on_step(StepStats(0.1, 1, 0, 0.1, 10, 1, time_to_first_tokens=[0.1], inter_token_latencies=[0.01]))
    obs.on_request_finished(RequestStats("stop", 0.0, 0.1, 0.2, 0.3, 0.3, 10, 2))
    body, _ = render_metrics(obs.registry)
    return {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = exported_names()
    exprs = dashboard_exprs()
    queried = {name for e in exprs for name in re.findall(r"\bservelm_[a-z0-9_]+", e)}
    assert len(queried) >= 15
    strip = re.compile(r"_(bucket|sum|count)$")
    missing = {q for q in queried if q not in exported and strip.sub("", q) not in exported}
    assert not missing, f"dashboard queries metrics servelm does not export: {sorted(missing)}"
    # What the brief asks the dashboard to show.
    text = "\n".join(exprs)
    for metric in ("servelm_time_to_first_token_seconds_bucket", "servelm_time_per_output_token_seconds_bucket",
                   "servelm_inter_token_latency_seconds_bucket", "servelm_generation_tokens_total",
                   "servelm_num_requests_running", "servelm_num_requests_waiting", "servelm_kv_cache_usage_perc",
                   "servelm_num_preemptions_total", "servelm_prefix_cache_hits_total",
                   "servelm_model_flops_utilization", "servelm_model_bandwidth_utilization"):  # fmt: skip
        assert metric in text, metric
    assert "histogram_quantile(0.99" in text and "histogram_quantile(0.5" in text


def test_dashboard_is_wired_to_the_provisioned_datasource() -> None:
    yaml = pytest.importorskip("yaml")
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == ds["uid"]
    providers = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/servelm.yml").read_text())["providers"]
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{providers[0]['options']['path']}:ro" in mounts


def test_compose_wires_servelm_prometheus_grafana() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) >= {"servelm", "prometheus", "grafana"}
    assert services["servelm"]["build"]["target"] == "cpu"
    assert (DOCKER / ".." / services["servelm"]["build"]["dockerfile"]).resolve().name == "Dockerfile"
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    port = services["servelm"]["command"][services["servelm"]["command"].index("--port") + 1]
    assert job["static_configs"][0]["targets"] == [f"servelm:{port}"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_prometheus_config_passes_promtool() -> None:
    r = subprocess.run(
        ["promtool", "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
