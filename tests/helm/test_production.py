"""helm/shoal's production options, rendered by the real Helm engine: the PodDisruptionBudget,
the Ingress, GCS fault tolerance (against KubeRay's CRD), the PrometheusRule (every expression
parsed, every series one that shoal's front end exports), and the model download (its init
container run here against a local Hugging Face mirror)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import promql_parser
import pytest
import yaml

from shoal.client.routing.router import RoutingStats
from shoal.deploy.metrics import ServerMetrics
from shoal.engine.loader import load_model_arch
from tests.factories import make_tiny_checkpoint
from tests.helm.hub_mirror import Revision, hub_mirror
from tests.helm.rendering import (
    CHART_DIR,
    CRD_DIR,
    NAMESPACE,
    crd_validator,
    render,
    render_error,
    render_values,
)

KUBERNETES_VERSION = "1.33"
FULLNAME = "llm-shoal"
ALERTS = {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}}
GCS_FT = {
    "gcsFaultTolerance": {
        "enabled": True,
        "redisAddress": "redis.infra.svc:6379",
        "redisPasswordSecret": {"name": "redis-auth", "key": "password"},
        "externalStorageNamespace": "llm-prod",
    }
}
DOWNLOAD = {
    "modelSpec": {
        "path": "qwen",
        "volume": {"existingClaim": "models"},
        "download": {
            "enabled": True,
            "repoId": "Qwen/Qwen2.5-0.5B-Instruct",
            "revision": "v1",
            "tokenSecret": {"name": "hf-token"},
        },
    }
}


def _lints(values: dict[str, Any]) -> None:
    report = helm.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


# --- PodDisruptionBudget --------------------------------------------------------------------


def test_the_budget_lets_evictions_take_worker_pods_one_at_a_time() -> None:
    (budget,) = render("defaults").of_kind("PodDisruptionBudget")
    kubernetes_validate.validate(budget, KUBERNETES_VERSION, strict=True)
    # KubeRay labels every pod of the cluster with these; the head's node-type is "head".
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"ray.io/cluster": FULLNAME, "ray.io/node-type": "worker"}},
    }
    share = render_values({"podDisruptionBudget": {"maxUnavailable": "25%"}})
    assert share.one("PodDisruptionBudget")["spec"]["maxUnavailable"] == "25%"
    assert (
        render_values({"podDisruptionBudget": {"enabled": False}}).of_kind("PodDisruptionBudget")
        == []
    )


# --- Ingress --------------------------------------------------------------------------------


def test_the_ingress_routes_v1_to_the_service_and_nothing_else_by_default() -> None:
    assert render("defaults").of_kind("Ingress") == []
    values = {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "600"},
            "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
        }
    }
    _lints(values)
    ingress = render_values(values).one("Ingress")
    kubernetes_validate.validate(ingress, KUBERNETES_VERSION, strict=True)
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx" and spec["tls"] == values["ingress"]["tls"]
    (rule,) = spec["rules"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"] == [
        {
            "path": "/v1",
            "pathType": "Prefix",
            "backend": {"service": {"name": FULLNAME, "port": {"name": "http"}}},
        }
    ]
    service_ports = {p["name"] for p in render_values(values).one("Service")["spec"]["ports"]}
    assert "http" in service_ports


def test_an_ingress_without_a_host_is_refused() -> None:
    assert "give ingress.hosts at least one host" in render_error(
        {"ingress": {"enabled": True, "hosts": []}}
    )


# --- GCS fault tolerance --------------------------------------------------------------------


def test_gcs_fault_tolerance_renders_kuberays_options_and_validates_against_the_crd() -> None:
    if not CRD_DIR.is_dir():
        pytest.skip(f"the KubeRay CRDs are not at {CRD_DIR}")
    _lints(GCS_FT)
    raycluster = render_values(GCS_FT).raycluster
    assert raycluster["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.infra.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}},
        "externalStorageNamespace": "llm-prod",
    }
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in crd_validator("rayclusters").iter_errors(raycluster)
    ]
    assert errors == []
    # The check is the CRD's: a field KubeRay does not have is caught.
    raycluster["spec"]["gcsFaultToleranceOptions"]["redisHost"] = "redis"
    assert not crd_validator("rayclusters").is_valid(raycluster)
    assert "gcsFaultToleranceOptions" not in render("defaults").raycluster["spec"]
    bare = render_values({"gcsFaultTolerance": {"enabled": True, "redisAddress": "r:6379"}})
    assert bare.raycluster["spec"]["gcsFaultToleranceOptions"] == {"redisAddress": "r:6379"}


def test_gcs_fault_tolerance_without_a_redis_is_refused() -> None:
    error = render_error({"gcsFaultTolerance": {"enabled": True}})
    assert "give gcsFaultTolerance.redisAddress" in error


# --- PrometheusRule -------------------------------------------------------------------------


def _exported_series() -> set[str]:
    """Every series name shoal's front end can serve at /metrics, by its metric families (a
    front end that routes over ranks: the routing and migration families too)."""
    metrics = ServerMetrics("m", rank_stats=dict, routing_stats=RoutingStats)
    metrics.cluster.data_parallel_size = 1
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_count", "_sum"),
        "gauge": ("",),
        "info": ("_info",),
    }
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes[family.type]
    }


def _selectors(node: Any) -> list[Any]:
    """The vector selectors of a parsed PromQL expression."""
    if type(node).__name__ == "VectorSelector":
        return [node]
    found = []
    for attribute in ("lhs", "rhs", "args", "expr", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        for item in child if isinstance(child, list) else [child]:
            if item is not None:
                found += _selectors(item)
    return found


def _check_rule(expression: str, exported: set[str]) -> list[str]:
    """What is wrong with an alert's expression: a series shoal does not export, or one not
    narrowed to this release's scrape target."""
    problems = []
    for selector in _selectors(promql_parser.parse(expression)):
        if selector.name not in exported:
            problems.append(f"{selector.name} is not a series shoal exports")
        labels = {m.name: m.value for m in selector.matchers.matchers}
        if labels.get("namespace") != NAMESPACE or labels.get("service") != FULLNAME:
            problems.append(f"{selector.name} is not narrowed to this release: {labels}")
    return problems


def test_the_alerts_parse_and_read_series_shoal_exports() -> None:
    _lints(ALERTS)
    rule = render_values(ALERTS).one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert sorted(alerts) == [
        "ShoalKVCacheNearlyFull",
        "ShoalRanksDown",
        "ShoalRequestsFailing",
        "ShoalTimeToFirstTokenAboveObjective",
    ]
    exported = _exported_series()
    for name, alert in alerts.items():
        assert _check_rule(alert["expr"], exported) == [], name
        assert alert["labels"]["severity"] and alert["for"]
        assert {"summary", "description"} <= alert["annotations"].keys()
    ttft = promql_parser.parse(alerts["ShoalTimeToFirstTokenAboveObjective"]["expr"])
    assert ttft.rhs.val == 2.0 and "histogram_quantile(0.95" in str(ttft.lhs)
    # The check reads names: a misspelt series is caught.
    typo = alerts["ShoalKVCacheNearlyFull"]["expr"].replace("usage_perc", "usage_percent")
    assert _check_rule(typo, exported) == [
        "vllm:kv_cache_usage_percent is not a series shoal exports"
    ]


def test_the_alerts_thresholds_come_from_values() -> None:
    values = {
        **ALERTS,
        "prometheusRule": {
            "enabled": True,
            "timeToFirstToken": {"quantile": 0.99, "seconds": 0.5, "for": "2m", "severity": "page"},
            "kvCacheUsage": {"threshold": 0.8, "for": "1h", "severity": "ticket"},
        },
    }
    alerts = {
        r["alert"]: r
        for r in render_values(values).one("PrometheusRule")["spec"]["groups"][0]["rules"]
    }
    ttft = alerts["ShoalTimeToFirstTokenAboveObjective"]
    assert (ttft["for"], ttft["labels"]["severity"]) == ("2m", "page")
    parsed = promql_parser.parse(ttft["expr"])
    assert parsed.rhs.val == 0.5 and "histogram_quantile(0.99" in str(parsed.lhs)
    assert promql_parser.parse(alerts["ShoalKVCacheNearlyFull"]["expr"]).rhs.val == 0.8


def test_alerts_need_the_service_monitor_whose_labels_they_read() -> None:
    assert render("defaults").of_kind("PrometheusRule") == []
    error = render_error({"prometheusRule": {"enabled": True}})
    assert "prometheusRule.enabled needs serviceMonitor.enabled" in error
    assert "at '/prometheusRule/errors/ratio'" in render_error(
        {**ALERTS, "prometheusRule": {"enabled": True, "errors": {"ratio": 2}}}
    )


# --- the model download ---------------------------------------------------------------------


def _download_container(rendered: Any, group: str = "gpu") -> dict[str, Any]:
    spec = rendered.worker_groups()[group]["template"]["spec"]
    (container,) = spec["initContainers"]
    return dict(container)


def test_every_worker_pod_downloads_the_model_before_its_engines_start() -> None:
    _lints(DOWNLOAD)
    rendered = render_values(DOWNLOAD)
    spec = rendered.worker_groups()["gpu"]["template"]["spec"]
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"},
         "template": rendered.worker_groups()["gpu"]["template"]},
        KUBERNETES_VERSION,
        strict=True,
    )  # fmt: skip
    init = _download_container(rendered)
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in init["env"]}
    assert env["SHOAL_MODEL_REPO"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert env["SHOAL_MODEL_REVISION"] == "v1"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    # It writes where `shoal serve --model` reads, into the volume the engines mount read-only.
    argv = rendered.serve_argv()
    assert env["SHOAL_MODEL_DIR"] == argv[argv.index("--model") + 1] == "/models/qwen"
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": False}
    (engine,) = spec["containers"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert init["image"] == engine["image"]
    assert "initContainers" not in render("defaults").worker_groups()["gpu"]["template"]["spec"]
    assert "give modelSpec.download.repoId" in render_error(
        {"modelSpec": {"download": {"enabled": True}}}
    )


def _run_init_container(container: dict[str, Any], env: dict[str, str]) -> str:
    """Runs the init container's command here, with its literal environment and `env` over it."""
    literal = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    command = [sys.executable if word == "python" else word for word in container["command"]]
    done = subprocess.run(
        [*command, *container["args"]],
        env={"PATH": os.environ["PATH"], **literal, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_init_container_downloads_the_revision_and_shoal_reads_it(tmp_path: Path) -> None:
    """The init container's own command, run here against a local mirror of the Hub: the
    pinned revision lands in the model's directory, shoal reads it, and a second run (a
    restarted pod) fetches no file again."""
    v1 = Path(make_tiny_checkpoint(tmp_path / "v1", "llama"))
    main = Path(make_tiny_checkpoint(tmp_path / "main", "llama", num_layers=3))
    repo = "Qwen/Qwen2.5-0.5B-Instruct"
    revisions = {
        "v1": Revision("1" * 40, {f.name: f for f in v1.iterdir() if f.is_file()}),
        "main": Revision("2" * 40, {f.name: f for f in main.iterdir() if f.is_file()}),
    }
    container = _download_container(render_values(DOWNLOAD))
    volume = tmp_path / "volume"
    target = volume / "qwen"
    env = {"SHOAL_MODEL_DIR": str(target), "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": "t"}
    with hub_mirror(repo, revisions) as (endpoint, requested):
        out = _run_init_container(container, {**env, "HF_ENDPOINT": endpoint})
        assert f"model ready in {target}" in out
        assert (
            load_model_arch(str(target)).num_hidden_layers
            == load_model_arch(str(v1)).num_hidden_layers
        )
        assert (target / "config.json").read_bytes() == (v1 / "config.json").read_bytes()
        fetched = [r for r in requested if r.startswith("GET /" + repo)]
        assert fetched and all(f"/resolve/{'1' * 40}/" in r for r in fetched)
        requested.clear()
        _run_init_container(container, {**env, "HF_ENDPOINT": endpoint})
        assert not [r for r in requested if r.startswith("GET /" + repo)], requested


def test_the_values_readme_documents_the_new_options() -> None:
    readme = (CHART_DIR / "README.md").read_text()
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    for key in ("podDisruptionBudget", "ingress", "gcsFaultTolerance", "prometheusRule"):
        assert key in values and f"`{key}." in readme, key
    assert "`modelSpec.download.repoId`" in readme


def test_notes_say_how_a_rollout_behaves_and_how_to_watch_the_start() -> None:
    notes = render("defaults").manifests["shoal/templates/NOTES.txt"]
    assert "Rollouts: a `helm upgrade` that changes a pod template" in notes
    assert "answers 503 from the old head's stop until a rank of the new cluster" in notes
    assert "evict at most 1 worker pod(s) at a time" in notes
    assert "shoal status --namespace shoal" in notes and "download-model" not in notes
    kept = render_values({"upgradeStrategy": "None"}).manifests["shoal/templates/NOTES.txt"]
    assert "a `helm upgrade` leaves running pods alone" in kept
    downloading = render_values(DOWNLOAD).manifests["shoal/templates/NOTES.txt"]
    assert "downloads Qwen/Qwen2.5-0.5B-Instruct at revision v1 into\n/models/qwen" in downloading
    assert "-c download-model" in downloading
