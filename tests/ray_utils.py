"""Real Ray for tests: an in-process local instance, and a `ray start --head` node on 127.0.0.1.

The head node runs in its own process group with its own temp dir and free ports, and is torn
down by killing exactly the processes it started (its group and their children), never with a
machine-wide `ray stop`, which would also end every other Ray instance on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

RAY_BIN = str(Path(sys.executable).with_name("ray"))
REPO_ROOT = Path(__file__).resolve().parents[1]
# The engine flags every CLI-started tiny test cluster uses: a small KV pool and context.
TINY_ENGINE_FLAGS = ["--num-gpu-blocks-override", "64", "--max-model-len", "256"]
# `start_ray_head(system_env=...)` for simulated node loss: the GCS declares a silent node dead
# after ~3 s instead of ~15 s (Ray's defaults).
FAST_NODE_DEATH = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}


def unique_namespace(prefix: str = "test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def local_ray(num_cpus: int = 4, namespace: str | None = None) -> Iterator[str]:
    """An in-process local Ray (no dashboard); yields its namespace and shuts it down after."""
    if ray.is_initialized():
        ray.shutdown()
    namespace = namespace or unique_namespace()
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=namespace,
        log_to_driver=False,
    )
    try:
        yield namespace
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[str]:
    """Module-scoped local Ray; yields the namespace the driver was started in."""
    with local_ray() as namespace:
        yield namespace


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_env(auth_token: str | None = None) -> dict[str, str]:
    """Environment for Ray CLI subprocesses: no auth (or Ray's token auth with `auth_token`),
    no usage stats, the repo importable."""
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    if auth_token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=auth_token)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class RayHead:
    """A running `ray start --head` node."""

    gcs_address: str  # "127.0.0.1:PORT", for ray.init(address=...) and `--address`
    dashboard_url: str  # "http://127.0.0.1:PORT", for `ray job` and the state API
    temp_dir: str
    process_group: int


def start_ray_head(
    num_cpus: int = 4,
    timeout_s: float = 60.0,
    auth_token: str | None = None,
    system_env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    port: int | None = None,
    temp_dir: str | None = None,
) -> RayHead:
    """Runs `ray start --head` on 127.0.0.1 with free ports; returns when the head is up.

    Args:
        system_env: extra environment for the head's processes (Ray reads its system config
            from `RAY_<name>` variables: how fast the GCS declares a node dead, say).
        extra_args: more `ray start` flags.
        port: the GCS port (default: a free one).
        temp_dir: the head's temp dir, removed with it (default: a new one).

    Raises:
        RuntimeError: if the head does not start.
    """
    # Short: socket paths are limited.
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="sray-", dir="/tmp")
    port, dashboard_port = port or free_port(), free_port()
    cmd = [
        RAY_BIN, "start", "--head", "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *(extra_args or []),
    ]  # fmt: skip
    log = open(Path(temp_dir) / "ray-start.log", "wb")  # noqa: SIM115 - lives as long as the head
    # `--block` keeps `ray start` as the parent of the group; a new session makes the group ours.
    env = ray_env(auth_token) | (system_env or {})
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    head = RayHead(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}", temp_dir, proc.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _is_job_api_up(head.dashboard_url, auth_token):
            return head
        time.sleep(0.5)
    stop_ray_head(head)
    output = (Path(temp_dir) / "ray-start.log").read_text(errors="replace")
    raise RuntimeError(f"ray start --head did not come up:\n{output[-4000:]}")


def start_ray_worker(
    head: RayHead, num_cpus: int, resources: dict[str, float] | None = None
) -> int:
    """Adds a node to `head`'s cluster on this machine; returns its process group id.

    Args:
        resources: custom node resources (`--resources`), to tell simulated nodes apart.

    Stop it with `stop_process_group`, or lose it at once with `kill_process_group`.
    """
    cmd = [
        RAY_BIN, "start", "--block", f"--address={head.gcs_address}",
        "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--num-gpus=0",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--resources={json.dumps(resources or {})}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ray_env(),
        start_new_session=True,
    )
    return proc.pid


def stop_ray_head(head: RayHead) -> None:
    """Kills every process the head started (its group and their descendants); removes its
    temp dir."""
    stop_process_group(head.process_group)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def stop_process_group(pgid: int, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, to a process group and every descendant of its members.

    Descendants matter: Ray workers and job drivers run in sessions of their own.
    """
    procs = _group_with_descendants(pgid)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # Processes started meanwhile (a worker being spawned) are caught on this second pass.
    alive = list({p.pid: p for p in alive + _group_with_descendants(pgid)}.values())
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def kill_process_group(pgid: int) -> None:
    """SIGKILLs a process group and every descendant of its members at once: a node lost as a
    preempted machine is, with no chance to drain or say goodbye."""
    procs = _group_with_descendants(pgid)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=5)


def wait_for_node(resource: str, timeout_s: float = 60.0) -> str:
    """The id of the alive node that offers the custom `resource`, once the GCS lists it
    (needs `ray.init` to this cluster).

    Raises:
        TimeoutError: no such node within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in ray.nodes():
            if node["Alive"] and node["Resources"].get(resource):
                return str(node["NodeID"])
        time.sleep(0.2)
    raise TimeoutError(f"no node with resource {resource!r} joined within {timeout_s:.0f} s")


def _group_with_descendants(pgid: int) -> list[psutil.Process]:
    members: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        # A process may exit between the listing and the lookup of its group.
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                members[p.pid] = p
    for p in list(members.values()):
        with contextlib.suppress(psutil.Error):
            for child in p.children(recursive=True):
                members[child.pid] = child
    return [p for pid, p in members.items() if pid != os.getpid()]


def _is_job_api_up(dashboard_url: str, auth_token: str | None = None) -> bool:
    import urllib.request

    headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
    request = urllib.request.Request(f"{dashboard_url}/api/version", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """A module-scoped `ray start --head` node on 127.0.0.1 with 4 CPUs."""
    if ray.is_initialized():
        ray.shutdown()
    head = start_ray_head()
    try:
        yield head
    finally:
        stop_ray_head(head)


# Ray's node provider that runs every node it launches as processes on this machine.
FAKE_NODE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
# The head node id the fake provider knows its head by.
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"


def autoscaling_config(
    gcs_address: str,
    head_cpus: int,
    worker_types: dict[str, dict[str, Any]],
    idle_timeout_minutes: float,
) -> dict[str, Any]:
    """A Ray autoscaler's cluster config for simulated nodes: Ray's own fake multi-node
    provider (as `ray.cluster_utils.AutoscalingCluster` uses it), whose nodes are raylets on
    this machine with the resources their type names (CPU standing in for GPU pods).

    Args:
        gcs_address: the head's GCS, which the launched nodes join.
        head_cpus: the head's CPUs.
        worker_types: node type → {"resources": {...}, "min_workers": n, "max_workers": m}.
        idle_timeout_minutes: how long a node may be idle before Ray terminates it.
    """
    node_types = {
        name: {"node_config": {}, "min_workers": 0, **spec} for name, spec in worker_types.items()
    }
    node_types["ray.head.default"] = {
        "resources": {"CPU": head_cpus},
        "node_config": {},
        "max_workers": 0,
    }
    return {
        "cluster_name": "fake_multinode",
        "max_workers": sum(spec.get("max_workers", 0) for spec in worker_types.values()),
        "provider": {
            "type": "external",
            "module": FAKE_NODE_PROVIDER,
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": node_types,
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def start_autoscaling_head(
    worker_types: dict[str, dict[str, Any]],
    head_cpus: int = 1,
    idle_timeout_minutes: float = 0.1,
    timeout_s: float = 60.0,
) -> RayHead:
    """A `ray start --head` node whose Ray autoscaler launches and terminates simulated nodes
    (`autoscaling_config`) on this machine, checking every second; stop it with
    `stop_ray_head`, which ends the nodes it launched too (they are its descendants).

    Unlike `ray.cluster_utils.AutoscalingCluster.start`, it never runs `ray stop` (which would
    end every Ray instance on the machine) and uses free ports and a temp dir of its own.
    """
    port = free_port()
    config = autoscaling_config(f"127.0.0.1:{port}", head_cpus, worker_types, idle_timeout_minutes)
    temp_dir = tempfile.mkdtemp(prefix="sray-", dir="/tmp")
    config_file = Path(temp_dir) / "autoscaler.json"
    config_file.write_text(json.dumps(config))
    system_env = {
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
        "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
    }
    return start_ray_head(
        num_cpus=head_cpus,
        timeout_s=timeout_s,
        system_env=system_env,
        extra_args=[f"--autoscaling-config={config_file}"],
        port=port,
        temp_dir=temp_dir,
    )
