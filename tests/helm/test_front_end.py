"""helm/shoal's front end and Ray trust boundary, rendered by the real Helm engine: the Service,
ServiceMonitor and probes of the head, the API key and tenants' keys from Secrets (never on the
command line), Ray's token auth, the dashboard kept inside the pod, and the NetworkPolicy.
"""

from __future__ import annotations

import base64
from pathlib import Path

from shoal.deploy.cli import build_parser
from shoal.deploy.openai.server import front_end_config
from tests.helm.rendering import (
    NAMESPACE,
    RELEASE,
    render,
    render_error,
    render_values,
)

FULLNAME = f"{RELEASE}-shoal"


# --- the front end: Service, ServiceMonitor, API key, probes --------------------------------


def test_service_reaches_the_heads_openai_and_metrics_ports() -> None:
    rendered = render("api-key-secret")
    service = rendered.one("Service")
    assert service["spec"]["selector"] == {"ray.io/cluster": FULLNAME, "ray.io/node-type": "head"}
    assert rendered.raycluster["metadata"]["name"] == FULLNAME  # KubeRay labels pods with it
    ports = {p["name"]: p for p in rendered.head_container["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports
    assert ports["http"]["containerPort"] == 8000
    argv = rendered.serve_argv()
    assert argv[argv.index("--port") + 1] == "8000"
    probe = rendered.head_container["readinessProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": "http"}
    # Liveness asks only whether the front end answers: ranks that restart never trip it.
    for name in ("startupProbe", "livenessProbe"):
        assert rendered.head_container[name]["httpGet"] == {"path": "/version", "port": "http"}
    assert rendered.head_container["startupProbe"]["failureThreshold"] == 60
    assert "securityContext" not in rendered.head_container
    hardened = render_values({"head": {"securityContext": {"allowPrivilegeEscalation": False}}})
    assert hardened.head_container["securityContext"] == {"allowPrivilegeEscalation": False}

    monitor = rendered.one("ServiceMonitor")
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "metrics"}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert render("defaults").of_kind("ServiceMonitor") == []


def test_api_key_reaches_shoal_from_a_secret_never_on_the_command_line() -> None:
    rendered = render("api-key-secret")
    secret = rendered.one("Secret")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "sk-test-1234"
    env = {e["name"]: e for e in rendered.head_container["env"]}
    assert env["SHOAL_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "api-key",
    }
    assert "sk-test-1234" not in rendered.manifests["shoal/templates/raycluster.yaml"]
    assert "--api-key" not in rendered.serve_argv()
    # NOTES say how to read the key back from its Secret, never the key itself.
    notes = rendered.manifests["shoal/templates/NOTES.txt"]
    assert f"kubectl get secret {secret['metadata']['name']} -n {NAMESPACE}" in notes
    assert "{.data.api-key}" in notes and "sk-test-1234" not in notes

    existing = render("api-key-existing-secret")
    assert existing.of_kind("Secret") == []
    env = {e["name"]: e for e in existing.head_container["env"]}
    assert env["SHOAL_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "prod-keys",
        "key": "openai",
    }
    assert "env" not in render("defaults").head_container


def test_tenants_key_file_reaches_shoal_from_a_secret_readable_by_its_owner_only(
    tmp_path: Path,
) -> None:
    rendered = render("tenants-secret")
    head = rendered.raycluster["spec"]["headGroupSpec"]["template"]["spec"]
    volume = next(v for v in head["volumes"] if v["name"] == "tenants")
    assert volume["secret"] == {
        "secretName": "tenant-keys",
        "items": [{"key": "api-keys", "path": "api-keys"}],
        "defaultMode": 0o400,
    }
    mount = next(m for m in rendered.head_container["volumeMounts"] if m["name"] == "tenants")
    assert mount["readOnly"] is True
    argv = rendered.serve_argv()
    assert argv[argv.index("--api-key-file") + 1] == f"{mount['mountPath']}/api-keys"
    env = {e["name"]: e for e in rendered.head_container["env"]}
    assert "SHOAL_API_KEY" not in env
    assert env["SHOAL_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "tenant-keys",
        "key": "admin",
    }
    # shoal serve takes the rendered flags, and reads the tenants from the file where the
    # Secret's key lands.
    key_file = tmp_path / "api-keys"
    key_file.write_text("team-a sk-a weight=2\nteam-b sk-b max_queued=8\n")
    argv[argv.index("--api-key-file") + 1] = str(key_file)
    args = build_parser("serve").parse_args(argv[1:])
    tenants = front_end_config(args, args.port).tenants
    assert [(t.name, t.weight) for t in tenants.tenants] == [("team-a", 2.0), ("team-b", 1.0)]

    both = {"server": {"apiKey": {"value": "k"}, "tenants": {"existingSecret": "tenant-keys"}}}
    assert "give one" in render_error(both)


# --- the Ray trust boundary: token auth, the dashboard, the NetworkPolicy -------------------


def test_ray_token_auth_is_on_and_the_dashboard_stays_inside_the_pod() -> None:
    defaults = render("defaults")
    assert defaults.raycluster["spec"]["authOptions"] == {"mode": "token"}
    params = defaults.raycluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["dashboard-host"] == "127.0.0.1"
    service_ports = {p["port"] for p in defaults.one("Service")["spec"]["ports"]}
    assert 8265 not in service_ports and 6379 not in service_ports
    assert defaults.of_kind("NetworkPolicy") == []
    named = render("network-policy").raycluster["spec"]["authOptions"]
    assert named == {"mode": "token", "secretName": "ray-token"}
    disabled = render_values({"rayAuth": {"mode": "disabled"}})
    assert "authOptions" not in disabled.raycluster["spec"]


def test_the_network_policy_admits_only_the_openai_and_metrics_ports_from_outside() -> None:
    policy = render("network-policy").one("NetworkPolicy")["spec"]
    release_pods = {"matchLabels": {"ray.io/cluster": FULLNAME}}
    assert policy["podSelector"] == release_pods and policy["policyTypes"] == ["Ingress"]
    inside, http, metrics = policy["ingress"]
    assert inside == {"from": [{"podSelector": release_pods}]}  # every port, own pods only
    assert http["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert http["from"] == [{"namespaceSelector": {"matchLabels": {"name": "gateway"}}}]
    assert metrics == {"ports": [{"port": 8080, "protocol": "TCP"}]}
