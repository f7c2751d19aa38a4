"""The deployment files in deploy/ stay loadable and agree with the relay they deploy.

Kubernetes objects are validated against the Kubernetes JSON schemas that the
`kubernetes-validate` package ships (offline, strict: unknown fields are errors); the
ServiceMonitor (a CRD, not in those schemas) and the Grafana dashboard against schemas in
tests/support/schemas. Then the cross-checks a schema cannot make: every metric a dashboard
panel queries is one the relay exports, every relay option a manifest passes exists, the
probes hit endpoints the relay serves, and the grace period covers --shutdown-timeout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
SCHEMAS = ROOT / "tests" / "support" / "schemas"
DASHBOARD = DEPLOY / "grafana" / "relay-dashboard.json"
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests promise to work on (docs/deploy.md)."""


def _documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _documents() if doc["kind"] == kind]


def test_the_manifests_hold_the_objects_the_docs_promise() -> None:
    kinds = sorted(doc["kind"] for _, doc in _documents())
    for kind in ("Deployment", "PodDisruptionBudget", "ServiceMonitor", "Service", "Job"):
        assert kind in kinds


@pytest.mark.parametrize(
    "name,doc",
    [pytest.param(n, d, id=f"{n}:{d['kind']}") for n, d in _documents()],
)
def test_each_object_validates_against_its_schema(name: str, doc: dict[str, Any]) -> None:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        schema = json.loads((SCHEMAS / "servicemonitor.schema.json").read_text())
        jsonschema.validate(doc, schema)
        return
    for version in (KUBERNETES_VERSION, kubernetes_validate.latest_version()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_a_misspelt_field() -> None:
    """The check above can fail: a typo in a probe is an error, not a warning."""
    deployment = json.loads(json.dumps(_by_kind("Deployment")[0]))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _relay_container() -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = _by_kind("Deployment")[0]
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _flags(args: list[str]) -> dict[str, str]:
    flags = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            flags[name] = value
    return flags


def test_the_relay_arguments_parse_with_the_real_cli() -> None:
    import typer

    from outbox_migrate.cli.app import app

    _, container = _relay_container()
    assert container["args"][0] == "relay"
    command = typer.main.get_command(app).commands["relay"]  # type: ignore[attr-defined]
    args = [a.replace("$(BROKER_URL)", "kafka:9092") for a in container["args"][1:]]
    context = command.make_context("relay", args)
    assert context.params["metrics_host"] == "0.0.0.0"


def test_grace_period_covers_the_shutdown_timeout() -> None:
    pod, container = _relay_container()
    shutdown = float(_flags(container["args"])["--shutdown-timeout"])
    assert pod["terminationGracePeriodSeconds"] >= shutdown + 5


def test_probes_hit_endpoints_the_relay_serves_on_its_metrics_port() -> None:
    import inspect

    from outbox_migrate.relay import metrics

    _, container = _relay_container()
    port = int(_flags(container["args"])["--metrics-port"])
    (declared,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert declared["containerPort"] == port
    served = inspect.getsource(metrics.serve)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert f'"{path}"' in served
        assert container[probe]["httpGet"]["port"] == "metrics"
    (monitor,) = _by_kind("ServiceMonitor")
    (service,) = _by_kind("Service")
    assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]


def test_the_disruption_budget_and_monitor_select_the_relay_pods() -> None:
    _, _ = _relay_container()
    labels = _by_kind("Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    for kind in ("PodDisruptionBudget", "ServiceMonitor"):
        (doc,) = _by_kind(kind)
        wanted = doc["spec"]["selector"]["matchLabels"]
        assert wanted.items() <= labels.items(), kind


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_the_dashboard_validates_against_its_schema() -> None:
    schema = json.loads((SCHEMAS / "grafana-dashboard.schema.json").read_text())
    jsonschema.validate(_dashboard(), schema)
    broken = _dashboard()
    broken["panels"][0]["gridPos"]["w"] = 30
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def _exported_names() -> set[str]:
    """Every sample name the relay's registry exposes, with the suffixes Prometheus adds."""
    from outbox_migrate.relay.metrics import PrometheusObserver

    observer = PrometheusObserver()
    names = set()
    for family in observer.registry.collect():
        names.add(family.name)
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",),
        }[family.type]
        names.update(family.name + s for s in suffixes)
    return names


METRIC = re.compile(r"\b(outbox_[a-z_]+)\b")


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = _exported_names()
    used = {
        name
        for panel in _dashboard()["panels"]
        for target in panel["targets"]
        for name in METRIC.findall(target["expr"])
    }
    used.update(METRIC.findall(json.dumps(_dashboard()["templating"])))
    assert used, "the dashboard queries no relay metric"
    assert used <= exported, f"not exported by the relay: {sorted(used - exported)}"
    # The five things the dashboard exists to show.
    for wanted in (
        "outbox_relay_backlog_rows",
        "outbox_relay_oldest_unpublished_age_seconds",
        "outbox_relay_published_total",
        "outbox_relay_failed_total",
        "outbox_relay_shards_owned",
    ):
        assert wanted in used


def test_the_metric_check_can_fail() -> None:
    assert "outbox_relay_published_total" in _exported_names()
    assert "outbox_relay_publish_total" not in _exported_names()
