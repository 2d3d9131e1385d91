"""The Helm chart (deploy/helm/servelm) lints, renders, validates against the Kubernetes schemas, and
agrees with the server it deploys: probe paths are real routes with the right meaning, the grace
period covers the drain, the autoscaler's metric is one the server exports, and the container's and
the router's arguments parse with their real command lines.

helm comes from ``deploy/helm/get_helm.py`` (cached under ``$SERVELM_CACHE/tools``); no cluster runs
here, so nothing is applied.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "servelm"
RELEASE, NAMESPACE = "rel", "llm"
# The oldest and the newest Kubernetes schemas kubernetes-validate ships that the chart supports.
K8S_VERSIONS = ("1.25.0", "1.37.0")
# Kinds from the Prometheus Operator's CRDs: kubernetes-validate has no schema for them.
CRD_KINDS = {"PodMonitor", "ServiceMonitor"}
SERVER_LABELS = {
    "app.kubernetes.io/name": "servelm",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/component": "server",
}
DEFAULT: dict[str, Any] = {}
EVERYTHING: dict[str, Any] = {
    "router": {"enabled": True},
    "autoscaling": {"enabled": True, "prometheusAdapterConfigMap": {"enabled": True}},
    "metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    "gpu": {"enabled": True, "count": 2},
    "models": {"type": "pvc"},
    "server": {
        "model": "/models/Llama-3.2-1B-Instruct",
        "apiKey": {"existingSecret": "servelm-key"},
        "extraArgs": ["--max-model-len", "4096"],
    },
    "drain": {"timeoutSeconds": 120},
}
CASES = {"default": DEFAULT, "everything": EVERYTHING}


def _load_get_helm() -> Any:
    spec = importlib.util.spec_from_file_location("get_helm", REPO / "deploy" / "helm" / "get_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def helm() -> str:
    get_helm = _load_get_helm()
    try:
        return str(get_helm.install())
    except (OSError, RuntimeError) as e:
        pytest.skip(f"helm {get_helm.HELM_VERSION} cannot be installed on this machine: {e}")


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _values_file(tmp: Path, values: dict[str, Any]) -> str:
    path = tmp / "values.json"  # JSON is YAML: helm reads it as a values file
    path.write_text(json.dumps(values))
    return str(path)


@pytest.fixture(scope="module")
def rendered(helm: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each case's manifests, as ``helm template`` renders them."""
    out = {}
    for name, values in CASES.items():
        tmp = tmp_path_factory.mktemp(name)
        text = _run(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", _values_file(tmp, values))
        out[name] = [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def _server(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment", f"{RELEASE}-servelm")


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# ------------------------------------------------------------------------------ helm and schemas


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict(helm: str, case: str, tmp_path: Path) -> None:
    out = _run(helm, "lint", "--strict", str(CHART), "-f", _values_file(tmp_path, CASES[case]))
    assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_validates_against_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], case: str
) -> None:
    import kubernetes_validate

    docs = rendered[case]
    checked = set()
    for version in K8S_VERSIONS:
        for doc in docs:
            if doc["kind"] in CRD_KINDS:
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(
                    f"{doc['kind']} {doc['metadata']['name']} against Kubernetes {version}: {e.message} at {list(e.path)}"
                )
            checked.add(doc["kind"])
    expected = {"Deployment", "Service"}
    if case == "everything":
        expected |= {
            "HorizontalPodAutoscaler",
            "ConfigMap",
            "PersistentVolumeClaim",
            "ServiceAccount",
            "Role",
            "RoleBinding",
        }
    assert checked == expected


def test_strict_validation_catches_a_misspelt_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The validator is not a no-op: one stray key in a probe fails it."""
    import kubernetes_validate

    broken = json.loads(json.dumps(_server(rendered["default"])))
    _container(broken)["livenessProbe"]["httpGet"]["paht"] = "/live"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_the_monitors_select_the_pods_and_ports_that_serve_metrics(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["everything"]
    assert not any(d["kind"] in CRD_KINDS for d in rendered["default"])  # off by default
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] == "Deployment"}
    for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        selector = monitor["spec"]["selector"]["matchLabels"]
        (template,) = [t for t in pods.values() if selector.items() <= t["metadata"]["labels"].items()]
        ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics", endpoint
    service_monitor = _one(docs, "ServiceMonitor")
    selector = service_monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service" and selector.items() <= d["metadata"]["labels"].items()]
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= ports
    # Port "http" is scraped as a server's /metrics: only the server's Service may name a port so.
    assert [s["metadata"]["name"] for s in services if "http" in {p["name"] for p in s["spec"]["ports"]}] == [
        f"{RELEASE}-servelm"
    ]


# ------------------------------------------------------------------------- agreement with servelm


def _entrypoint(target: str) -> list[str]:
    """The ENTRYPOINT of one Dockerfile target (``FROM ... AS target``)."""
    stage = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", (REPO / "Dockerfile").read_text(), flags=re.M | re.I)
    body = dict(zip(stage[1::2], stage[2::2]))[target]
    (line,) = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", body, flags=re.M)
    return json.loads(line)


@pytest.mark.parametrize("case", CASES)
def test_container_args_parse_with_the_servelm_cli(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    from servelm.server.cli import build_parser

    container = _container(_server(rendered[case]))
    target = "cuda" if CASES[case].get("gpu", {}).get("enabled") else "cpu"
    assert container["image"] == f"servelm:{target}"
    entrypoint = _entrypoint(target)
    assert entrypoint[0] == "servelm"
    args = build_parser().parse_args(entrypoint[1:] + container["args"])
    assert args.command == "serve"
    assert args.drain_timeout == CASES[case].get("drain", {}).get("timeoutSeconds", 30)
    assert args.model == CASES[case].get("server", {}).get("model")
    assert args.host == "0.0.0.0"
    assert [p["containerPort"] for p in container["ports"] if p["name"] == "http"] == [args.port]


@pytest.mark.parametrize("case", CASES)
def test_grace_period_is_prestop_plus_drain_plus_margin(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    from servelm.server.cli_serve import SHUTDOWN_FLUSH_S

    values = yaml.safe_load((CHART / "values.yaml").read_text())["drain"] | CASES[case].get("drain", {})
    spec = _server(rendered[case])["spec"]["template"]["spec"]
    container = _container(_server(rendered[case]))
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pause == values["preStopSleepSeconds"]
    grace = spec["terminationGracePeriodSeconds"]
    assert grace == values["preStopSleepSeconds"] + values["timeoutSeconds"] + values["marginSeconds"]
    # The server's own last resort (uvicorn's graceful timeout) ends before the kubelet's SIGKILL.
    assert pause + values["timeoutSeconds"] + SHUTDOWN_FLUSH_S < grace
    if case == "everything":
        assert (
            _one(rendered[case], "Deployment", f"{RELEASE}-servelm-router")["spec"]["template"]["spec"][
                "terminationGracePeriodSeconds"
            ]
            == grace
        )


def _probes(container: dict[str, Any]) -> dict[str, str]:
    return {kind: container[f"{kind}Probe"]["httpGet"]["path"] for kind in ("startup", "liveness", "readiness")}


@pytest.fixture(scope="module")
def fake_app(default_model_dir: Path) -> Iterator[tuple[str, Any]]:
    """servelm's real app over the server tests' scripted engine, on a loopback port."""
    sys.path.insert(0, str(REPO / "tests" / "server"))
    from srv_harness import FakeEngine, ServerThread

    from servelm.runtime.tokenizer import load_tokenizer
    from servelm.server.app import build_app
    from servelm.server.async_engine import AsyncEngine

    ae = AsyncEngine(FakeEngine(load_tokenizer(default_model_dir)))
    srv = ServerThread(build_app(ae, api_key="probes-need-none")).start()
    yield srv.url, ae
    srv.stop()


def test_probe_paths_are_real_routes_with_the_right_meaning(
    rendered: dict[str, list[dict[str, Any]]], fake_app: tuple[str, Any]
) -> None:
    import httpx

    url, ae = fake_app
    probes = _probes(_container(_server(rendered["everything"])))
    assert probes == _probes(_container(_server(rendered["default"])))
    assert all(httpx.get(f"{url}{path}").status_code == 200 for path in probes.values()), probes
    ae.stop_accepting()  # what SIGTERM does first: no longer ready, still alive
    assert httpx.get(f"{url}{probes['readiness']}").status_code == 503
    assert httpx.get(f"{url}{probes['liveness']}").status_code == 200
    assert httpx.get(f"{url}{probes['startup']}").status_code == 200


def test_the_autoscaler_reads_a_gauge_the_server_exports(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from prometheus_client import CollectorRegistry

    from servelm.metrics.prometheus import PrometheusObserver, render_metrics

    docs = rendered["everything"]
    assert not any(d["kind"] == "HorizontalPodAutoscaler" for d in rendered["default"])
    hpa = _one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{RELEASE}-servelm",
    }
    assert "replicas" not in _server(docs)["spec"]  # the autoscaler owns the count
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    registry = CollectorRegistry()
    PrometheusObserver("m", {}, 1e12, 1e11, registry=registry, process_metrics=False)
    exposition = render_metrics(registry)[0].decode()
    assert f"# TYPE {name} gauge" in exposition, name
    # The adapter rule exposes that same series under that same name.
    rules = yaml.safe_load(_one(docs, "ConfigMap")["data"]["config.yaml"])["rules"]
    assert [(r["name"]["as"], r["seriesQuery"].split("{")[0]) for r in rules] == [(name, name)]


def test_router_args_parse_with_vllm_router_and_find_this_releases_servers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    parse_router_args = pytest.importorskip("vllm_router.launch_router").parse_router_args
    docs = rendered["everything"]
    assert not any("router" in d["metadata"]["name"] for d in rendered["default"])
    router = _one(docs, "Deployment", f"{RELEASE}-servelm-router")
    (container,) = router["spec"]["template"]["spec"]["containers"]
    args = parse_router_args(container["args"])
    assert args.service_discovery and args.service_discovery_namespace == NAMESPACE
    assert args.selector == SERVER_LABELS
    assert args.selector.items() <= _server(docs)["spec"]["template"]["metadata"]["labels"].items()
    assert args.service_discovery_port == _container(_server(docs))["ports"][0]["containerPort"]
    assert args.policy == "cache_aware"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.port, args.prometheus_port) == (ports["http"], ports["metrics"])
    # It may watch pods in its own namespace, and nothing else.
    role = _one(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = _one(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == router["spec"]["template"]["spec"]["serviceAccountName"]


def test_gpu_models_and_api_key_reach_the_pod(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["everything"]
    server = _server(docs)
    container = _container(server)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "nvidia.com/gpu" not in _container(_server(rendered["default"]))["resources"].get("limits", {})
    claim = _one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    (volume,) = server["spec"]["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    assert container["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]
    (env,) = container["env"]
    assert env["name"] == "SERVELM_API_KEY" and env["valueFrom"]["secretKeyRef"]["name"] == "servelm-key"
    pod_security = server["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] == 10001  # the Dockerfile's servelm user
    assert "USER 10001:10001" in (REPO / "Dockerfile").read_text()
