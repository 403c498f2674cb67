"""helm/shoal rendered by the real Helm engine: lint, the KubeRay CRD schemas, Kubernetes' own
schemas, where the GPU values land, what values.schema.json refuses, and the `shoal serve`
command line the head runs (every flag one that `shoal serve` parses).
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

import shoal
from shoal.deploy.cli import build_parser
from tests.helm.rendering import (
    CHART_DIR,
    CRD_DIR,
    NAMESPACE,
    OVERRIDES,
    RELEASE,
    Rendered,
    chart_metadata,
    crd_validator,
    render,
    render_error,
    render_values,
)
from tests.ray_utils import REPO_ROOT

KUBERNETES_VERSION = "1.33"
FULLNAME = f"{RELEASE}-shoal"


def _pod_templates(rendered: Rendered) -> dict[str, dict[str, Any]]:
    spec = rendered.raycluster["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    return templates


# --- the chart itself -------------------------------------------------------------------------


def test_chart_is_v2_and_its_app_version_is_shoals_version() -> None:
    meta = chart_metadata()
    assert meta["apiVersion"] == "v2"
    assert str(meta["appVersion"]) == shoal.__version__
    # The default image is the one deploy/docker/Dockerfile builds, tagged with the appVersion.
    assert render("defaults").head_container["image"] == f"shoal:{shoal.__version__}"


@pytest.mark.parametrize("override", sorted(OVERRIDES))
def test_helm_lint_passes_strictly(override: str) -> None:
    report = helm.lint(CHART_DIR, OVERRIDES[override] or None, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [] and problems == [], report


def test_readme_documents_every_value() -> None:
    readme = (CHART_DIR / "README.md").read_text()
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())

    free_form = {
        "resources",
        "rayStartParams",
        "readinessProbe",
        "startupProbe",
        "livenessProbe",
        "autoscalerOptions",
    }

    def leaves(node: Any, prefix: str) -> list[str]:
        if isinstance(node, dict) and node and prefix.rstrip(".").rsplit(".")[-1] not in free_form:
            return [p for k, v in node.items() for p in leaves(v, f"{prefix}{k}.")]
        return [prefix.rstrip(".")]

    missing = [key for key in leaves(values, "") if f"`{key}`" not in readme]
    assert missing == []


def _readme_helm_installs(path: Path) -> list[list[str]]:
    """The `--set` values of every `helm install` in a README's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    installs = []
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command)
            if words[:2] == ["helm", "install"]:
                installs.append([words[i + 1] for i, w in enumerate(words) if w == "--set"])
    return installs


@pytest.mark.parametrize("readme", [REPO_ROOT / "README.md", CHART_DIR / "README.md"])
def test_the_readmes_helm_install_renders_what_it_says(readme: Path) -> None:
    (sets,) = _readme_helm_installs(readme)
    rendered = render_values(helm.parse_set_string(",".join(sets)))
    argv = rendered.serve_argv()
    parsed = build_parser().parse_args(argv[1:])
    assert parsed.data_parallel_size > 1 and parsed.model.startswith("/models/")
    assert rendered.head_container["image"].startswith("REGISTRY/shoal:")


# --- schemas: KubeRay's CRDs and Kubernetes' own --------------------------------------------


@pytest.fixture(scope="module")
def raycluster_validator() -> jsonschema.protocols.Validator:
    if not CRD_DIR.is_dir():
        pytest.skip(f"the KubeRay CRDs are not at {CRD_DIR}")
    return crd_validator("rayclusters")


@pytest.mark.parametrize("override", sorted(OVERRIDES))
def test_raycluster_validates_against_the_kuberay_crd(
    override: str, raycluster_validator: jsonschema.protocols.Validator
) -> None:
    rendered = render(override)
    assert rendered.of_kind("RayJob") == []  # the head's own command runs shoal serve
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in raycluster_validator.iter_errors(rendered.raycluster)
    ]
    assert errors == []


def test_the_crd_check_catches_a_misplaced_field(
    raycluster_validator: jsonschema.protocols.Validator,
) -> None:
    raycluster = copy.deepcopy(render("defaults").raycluster)
    raycluster["spec"]["workerGroupSpecs"][0]["numGpus"] = 1
    assert not raycluster_validator.is_valid(raycluster)


def _core_objects(rendered: Rendered) -> list[dict[str, Any]]:
    """Every core object, and every pod template of the RayCluster as a core PodTemplate."""
    core = [o for o in rendered.objects if o["apiVersion"] == "v1"]
    for name, template in _pod_templates(rendered).items():
        core.append(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{FULLNAME}-{name}"},
                "template": template,
            }
        )
    return core


@pytest.mark.parametrize("override", sorted(OVERRIDES))
def test_core_objects_and_pod_templates_validate_with_kubernetes_schemas(override: str) -> None:
    for obj in _core_objects(render(override)):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_kubernetes_validate_catches_a_bad_pod_template() -> None:
    template = copy.deepcopy(render("defaults").raycluster["spec"]["workerGroupSpecs"][0])
    template["template"]["spec"]["containers"][0]["resource"] = {}  # typo of resources
    bad = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, **template}
    bad = {k: bad[k] for k in ("apiVersion", "kind", "metadata", "template")}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


# --- GPUs, placement, volumes ---------------------------------------------------------------


@pytest.mark.parametrize("override", sorted(OVERRIDES))
def test_gpu_values_land_where_kuberay_and_the_device_plugin_expect(override: str) -> None:
    rendered = render(override)
    values = rendered_values(override)
    head = rendered.raycluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_resources = rendered.head_container["resources"]
    assert all("nvidia.com/gpu" not in r for r in head_resources.values())

    expected = (
        {values["worker"]["groupName"]: values["worker"]}
        if not values["worker"].get("disabled")
        else {}
    )
    expected |= {n: g for n, g in values["additionalWorkerGroups"].items() if not g.get("disabled")}
    groups = rendered.worker_groups()
    assert sorted(groups) == sorted(expected)
    for name, group in groups.items():
        gpus = expected[name]["gpus"]
        assert group["rayStartParams"]["num-gpus"] == str(gpus)
        (container,) = group["template"]["spec"]["containers"]
        resources = container["resources"]
        # The device plugin's extended resource: whole GPUs, requests equal to limits.
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert resources["requests"]["nvidia.com/gpu"] == gpus
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert group[key] == expected[name][key]
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert volumes["dshm"]["emptyDir"] == {
            "medium": "Memory",
            "sizeLimit": expected[name].get("shmSize", "16Gi"),
        }
        assert mounts["dshm"] == "/dev/shm"


def rendered_values(override: str) -> dict[str, Any]:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.merge_values(OVERRIDES[override])


@pytest.mark.parametrize("override", sorted(OVERRIDES))
def test_every_ray_container_starts_ray_under_overwrite_container_cmd(override: str) -> None:
    """The annotation covers every pod of the cluster: KubeRay then generates no command for
    any of them, so each Ray container must run KubeRay's generated `ray start` itself."""
    rendered = render(override)
    annotations = rendered.raycluster["metadata"]["annotations"]
    assert annotations["ray.io/overwrite-container-cmd"] == "true"
    for template in _pod_templates(rendered).values():
        container = template["spec"]["containers"][0]  # KubeRay's Ray container is the first
        assert container["command"] == ["/bin/bash", "-c", "--"]
        (script,) = container["args"]
        assert 'bash -c "$KUBERAY_GEN_RAY_START_CMD"' in script
        assert script.startswith("ulimit -n 65536")


def test_two_worker_groups_render_as_two_groups_and_a_disabled_one_not_at_all() -> None:
    groups = render("two-worker-groups").worker_groups()
    assert sorted(groups) == ["a100", "h100"]
    assert groups["h100"]["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "8Gi"


def test_tolerations_node_selector_and_placement_reach_the_worker_pods() -> None:
    rendered = render("tolerations-node-selector")
    worker = OVERRIDES["tolerations-node-selector"]["worker"]
    spec = rendered.worker_groups()["gpu"]["template"]["spec"]
    assert spec["nodeSelector"] == worker["nodeSelector"]
    assert spec["tolerations"] == worker["tolerations"]
    assert spec["affinity"] == worker["affinity"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["priorityClassName"] == "inference"
    head_spec = rendered.raycluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert head_spec["nodeSelector"] == {"pool": "cpu"}
    assert "tolerations" not in head_spec and "runtimeClassName" not in head_spec


@pytest.mark.parametrize(
    ("override", "source", "model"),
    [
        ("defaults", {"persistentVolumeClaim": {"claimName": "shoal-models", "readOnly": True}}, "/models/model"),
        ("pvc-model", {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}, "/mnt/weights/Qwen2.5-7B-Instruct"),
        ("host-path-model", {"hostPath": {"path": "/data/models", "type": "Directory"}}, "/models/llama"),
        ("volume-spec-model", {"nfs": {"server": "nfs.local", "path": "/m"}}, "/models/mixtral"),
    ],
)  # fmt: skip
def test_the_model_volume_is_mounted_on_every_worker_and_named_by_model(
    override: str, source: dict[str, Any], model: str
) -> None:
    rendered = render(override)
    mount_path = model.rsplit("/", 1)[0]
    for group in rendered.worker_groups().values():
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"] == {"name": "model", **source}
        (container,) = spec["containers"]
        assert {"name": "model", "mountPath": mount_path, "readOnly": True} in container[
            "volumeMounts"
        ]
    argv = rendered.serve_argv()
    assert argv[argv.index("--model") + 1] == model


def test_with_the_autoscaler_resizes_may_reach_the_groups_at_max_replicas() -> None:
    argv = render("autoscaling").serve_argv()  # up to 8 pods of one GPU, a rank each
    assert argv[argv.index("--max-data-parallel-size") + 1] == "8"
    two_groups = {**OVERRIDES["two-worker-groups"], "head": {"enableInTreeAutoscaling": True}}
    argv = render_values(two_groups).serve_argv()  # (1 x 4 + 2 x 4 GPUs) / 2 per rank
    assert argv[argv.index("--max-data-parallel-size") + 1] == "6"
    assert "--max-data-parallel-size" not in render("defaults").serve_argv()


def test_autoscaling_turns_on_kuberays_in_tree_autoscaler() -> None:
    spec = render("autoscaling").raycluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"] == {"upscalingMode": "Default", "idleTimeoutSeconds": 300}
    assert spec["workerGroupSpecs"][0]["minReplicas"] == 0
    assert "enableInTreeAutoscaling" not in render("defaults").raycluster["spec"]


# --- the `shoal serve` command line ---------------------------------------------------------


def test_model_spec_values_map_onto_shoal_serve_flags() -> None:
    argv = render("pvc-model").serve_argv()
    assert argv == [
        "shoal", "serve",
        "--model", "/mnt/weights/Qwen2.5-7B-Instruct",
        "--served-model-name", "qwen-7b",
        "--namespace", "shoal",
        "--host", "0.0.0.0", "--port", "8000",
        "--data-parallel-size", "1",
        "--num-gpus-per-rank", "1",
        "--max-model-len", "8192",
        "--dtype", "bfloat16",
        "--max-num-seqs", "64", "--no-enable-prefix-caching",
    ]  # fmt: skip
    assert "--enable-expert-parallel" in render("volume-spec-model").serve_argv()
    two = render("two-worker-groups").serve_argv()
    assert two[two.index("--data-parallel-size") + 1] == "6"
    assert two[two.index("--num-gpus-per-rank") + 1] == "2"


@pytest.mark.parametrize("override", sorted(OVERRIDES))
def test_every_rendered_flag_is_one_shoal_serve_parses(override: str) -> None:
    argv = render(override).serve_argv()
    assert argv[:2] == ["shoal", "serve"]
    args = build_parser().parse_args(argv[1:])  # argparse exits on an unknown flag
    values = rendered_values(override)["modelSpec"]
    assert args.data_parallel_size == values["dataParallelSize"]
    assert args.num_gpus_per_rank == values.get("gpusPerRank", values["tensorParallelSize"])
    assert args.max_model_len == values.get("maxModelLen")  # Helm drops null values
    assert args.dtype == values["dtype"]
    assert args.model.endswith(values["path"])


def test_shell_quoting_keeps_extra_args_whole() -> None:
    tricky = ["--tokenizer", "/models/it's here/tokenizer.json"]
    rendered = render_values({"modelSpec": {"extraArgs": tricky}})
    assert rendered.serve_argv()[-2:] == tricky


# --- values the chart refuses ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"worker": {"replicas": -1}}, "at '/worker/replicas': minimum: got -1, want 0"),
        (
            {"additionalWorkerGroups": {"b": {"replicas": 1, "minReplicas": -2, "maxReplicas": 1, "gpus": 1}}},
            "at '/additionalWorkerGroups/b/minReplicas': minimum: got -2, want 0",
        ),
        ({"modelSpec": {"path": None}}, "at '/modelSpec': missing property 'path'"),
        ({"modelSpec": {"path": ""}}, "at '/modelSpec/path': minLength: got 0, want 1"),
        ({"worker": {"gpus": 1.5}}, "at '/worker/gpus': got number, want integer"),
        ({"worker": {"gpus": "2"}}, "at '/worker/gpus': got string, want integer"),
        ({"modelSpec": {"enableElasticEp": True}}, "additional properties 'enableElasticEp' not allowed"),
    ],
)  # fmt: skip
def test_values_schema_makes_helm_refuse_bad_values(values: dict[str, Any], message: str) -> None:
    error = render_error(values)
    assert "values don't meet the specifications of the schema" in error
    assert message in error


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"worker": {"replicas": 3, "maxReplicas": 2}}, "replicas (3) must lie between minReplicas (1) and maxReplicas (2)"),
        ({"modelSpec": {"dataParallelSize": 2}}, "the worker groups hold at most 1 such ranks"),
        ({"modelSpec": {"volume": {"hostPath": "/data"}}}, "set only one of existingClaim, hostPath and spec"),
        ({"worker": {"rayStartParams": {"num-gpus": "2"}}}, "set its gpus, not rayStartParams.num-gpus"),
        ({"head": {"rayStartParams": {"num-gpus": "1"}}}, "the head runs no engine"),
        ({"worker": {"disabled": True}}, "no worker group"),
        ({"modelSpec": {"tensorParallelSize": 2, "gpusPerRank": 1}}, "gpusPerRank 1 conflicts with tensorParallelSize 2"),
        ({"modelSpec": {"tensorParallelSize": 2, "dataParallelSize": 3}, "worker": {"gpus": 4}}, "3 ranks of 2 GPUs, but the worker groups hold at most 2"),
    ],
)  # fmt: skip
def test_the_chart_refuses_values_that_cannot_serve(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


def test_a_tensor_parallel_rank_reserves_one_gpu_per_worker() -> None:
    argv = render_values(
        {"modelSpec": {"tensorParallelSize": 2}, "worker": {"gpus": 4}}
    ).serve_argv()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--num-gpus-per-rank") + 1] == "2"
    args = build_parser().parse_args(argv[1:])
    assert (args.tensor_parallel_size, args.num_gpus_per_rank) == (2, 2)


def test_engine_vllm_runs_vllms_engine_from_the_image_variant_with_vllm() -> None:
    assert "--engine" not in render("defaults").serve_argv()
    rendered = render_values({"modelSpec": {"engine": "vllm"}})
    argv = rendered.serve_argv()
    assert argv[argv.index("--engine") + 1] == "vllm"
    # The shoal-vllm target of deploy/docker/Dockerfile, unless a tag is given.
    assert rendered.head_container["image"] == f"shoal:{shoal.__version__}-vllm"
    pinned = render_values({"modelSpec": {"engine": "vllm"}, "image": {"tag": "mine"}})
    assert pinned.head_container["image"] == "shoal:mine"
    assert "/modelSpec/engine" in render_error({"modelSpec": {"engine": "sglang"}})
