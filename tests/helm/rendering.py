"""Renders helm/shoal with the real Helm engine (helm-python-sdk, Helm v4, offline) and parses
what it renders; holds the override sets the chart tests share, each rendered once.
"""

from __future__ import annotations

import functools
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import yaml

from tests.ray_utils import REPO_ROOT

CHART_DIR = REPO_ROOT / "helm" / "shoal"
# KubeRay's CRDs, in the `shared/` folder beside the checkout (a worktree's is one level up).
CRD_DIR = next(
    (
        found
        for root in (REPO_ROOT, REPO_ROOT.parent, REPO_ROOT.parent.parent)
        if (found := root / "shared" / "kuberay-crds").is_dir()
    ),
    REPO_ROOT.parent / "shared" / "kuberay-crds",
)
RELEASE = "llm"
NAMESPACE = "serving"

# The override sets the acceptance names; "defaults" is the chart as shipped.
OVERRIDES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "two-worker-groups": {
        "modelSpec": {"dataParallelSize": 6, "gpusPerRank": 2},
        "worker": {
            "groupName": "a100",
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 1,
            "gpus": 4,
        },
        "additionalWorkerGroups": {
            "h100": {
                "replicas": 2,
                "minReplicas": 0,
                "maxReplicas": 2,
                "gpus": 4,
                "shmSize": "8Gi",
            },
            "off": {"disabled": True, "replicas": 0, "minReplicas": 0, "maxReplicas": 0, "gpus": 1},
        },
    },
    "tolerations-node-selector": {
        "worker": {
            "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            "tolerations": [
                {
                    "key": "nvidia.com/gpu",
                    "operator": "Equal",
                    "value": "present",
                    "effect": "NoSchedule",
                },
                {"key": "spot", "operator": "Exists", "effect": "NoExecute"},
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "pool", "operator": "In", "values": ["gpu"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "runtimeClassName": "nvidia",
            "priorityClassName": "inference",
        },
        "head": {"nodeSelector": {"pool": "cpu"}},
    },
    "pvc-model": {
        "modelSpec": {
            "path": "Qwen2.5-7B-Instruct",
            "name": "qwen-7b",
            "volume": {"existingClaim": "weights", "mountPath": "/mnt/weights"},
            "maxModelLen": 8192,
            "dtype": "bfloat16",
            "extraArgs": ["--max-num-seqs", "64", "--no-enable-prefix-caching"],
        },
    },
    "host-path-model": {
        "modelSpec": {"path": "llama", "volume": {"existingClaim": "", "hostPath": "/data/models"}},
    },
    "volume-spec-model": {
        "modelSpec": {
            "path": "mixtral",
            "enableExpertParallel": True,
            "volume": {"existingClaim": "", "spec": {"nfs": {"server": "nfs.local", "path": "/m"}}},
        },
    },
    "autoscaling": {
        "head": {"enableInTreeAutoscaling": True, "autoscalerOptions": {"idleTimeoutSeconds": 300}},
        "modelSpec": {"dataParallelSize": 8},
        "worker": {"replicas": 0, "minReplicas": 0, "maxReplicas": 8},
    },
    "api-key-secret": {
        "server": {"apiKey": {"value": "sk-test-1234"}},
        "serviceMonitor": {"enabled": True},
    },
    "api-key-existing-secret": {
        "server": {"apiKey": {"existingSecret": "prod-keys", "secretKey": "openai"}},
    },
    "tenants-secret": {
        "server": {"tenants": {"existingSecret": "tenant-keys", "adminSecretKey": "admin"}},
    },
    "network-policy": {
        "rayAuth": {"secretName": "ray-token"},
        "networkPolicy": {
            "enabled": True,
            "httpFrom": [{"namespaceSelector": {"matchLabels": {"name": "gateway"}}}],
        },
    },
}


@dataclass(frozen=True)
class Rendered:
    """One render: the manifests Helm returned and the objects in them."""

    manifests: dict[str, str]
    objects: tuple[dict[str, Any], ...]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]

    @property
    def raycluster(self) -> dict[str, Any]:
        return self.one("RayCluster")

    @property
    def head_container(self) -> dict[str, Any]:
        return self.raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]

    def worker_groups(self) -> dict[str, dict[str, Any]]:
        return {g["groupName"]: g for g in self.raycluster["spec"]["workerGroupSpecs"]}

    def serve_argv(self) -> list[str]:
        """The `shoal serve ...` words of the head's script, as bash would split them."""
        script = self.head_container["args"][0]
        lines = [line for line in script.splitlines() if line.startswith("shoal serve ")]
        assert len(lines) == 1, script
        words = shlex.split(lines[0])
        assert words[-1] == "&", lines[0]  # runs beside Ray's head, which the script also waits on
        return words[:-1]


def render_values(values: dict[str, Any]) -> Rendered:
    """Renders the chart with `values` over its defaults (raises Helm's error if it refuses)."""
    return _render(json.dumps(values, sort_keys=True))


def render(override: str) -> Rendered:
    return render_values(OVERRIDES[override])


@functools.cache
def _render(values_json: str) -> Rendered:
    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    objects = tuple(
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    )
    return Rendered(manifests, objects)


def render_error(values: dict[str, Any]) -> str:
    """Helm's error message for `values` the chart must refuse."""
    try:
        with helm.Chart.load(CHART_DIR) as chart:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    except helm.HelmError as e:
        return str(e)
    raise AssertionError(f"helm rendered values it should refuse: {values}")


def chart_metadata() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART_DIR / "Chart.yaml").read_text()))


def crd_schema(kind_plural: str) -> dict[str, Any]:
    """The openAPIV3Schema of the KubeRay v1.7 CRD `ray.io_<plural>.yaml`, version v1."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are large
    crd = yaml.load((CRD_DIR / f"ray.io_{kind_plural}.yaml").read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return dict(version["schema"]["openAPIV3Schema"])


def chart_path(*parts: str) -> Path:
    return CHART_DIR.joinpath(*parts)


def _no_unknown_fields(schema: Any) -> Any:
    """The CRD schema with every object closed: the API server prunes fields a structural
    schema does not name, so a field it does not know would be dropped without a word."""
    if isinstance(schema, list):
        return [_no_unknown_fields(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _no_unknown_fields(v) for k, v in schema.items()}
    if (
        "properties" in closed
        and "additionalProperties" not in closed
        and not closed.get("x-kubernetes-preserve-unknown-fields")
    ):
        closed["additionalProperties"] = False
    return closed


@functools.cache
def crd_validator(kind_plural: str) -> jsonschema.protocols.Validator:
    """A validator of KubeRay's CRD `kind_plural`, every object in it closed."""
    schema = _no_unknown_fields(crd_schema(kind_plural))
    schema["properties"]["metadata"] = {"type": "object"}  # all the CRD says of it
    return jsonschema.Draft7Validator(schema)
