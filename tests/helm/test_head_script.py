"""The head container's script, run by bash as the head pod runs it, on this machine: with
`KUBERAY_GEN_RAY_START_CMD` set the way KubeRay sets it (`ray start --head --block` and the
head's rayStartParams), it starts Ray's head, then `shoal serve`; the OpenAI port turns healthy;
a worker pod's rendered command joins it; SIGTERM (a pod's deletion) ends both and the script
exits 0; a `ray start` that fails ends the
script at once with an error, so that Kubernetes restarts the container.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from ray.util.state import list_nodes

from tests.factories import make_tiny_checkpoint
from tests.helm.rendering import render_values
from tests.ray_utils import free_port, ray_env, stop_process_group, unique_namespace

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 240.0  # two Ray nodes start here, on a machine that may be busy


def _head_values(namespace: str, gcs_port: int, http_port: int) -> dict[str, Any]:
    head_params = {
        "port": str(gcs_port),
        "dashboard-host": "127.0.0.1",
        "dashboard-agent-listen-port": str(free_port()),
    }
    return {
        "modelSpec": {
            "name": "tiny",
            "gpusPerRank": 0,
            "maxModelLen": 256,
            "dtype": "float32",
            "extraArgs": [
                "--num-gpu-blocks-override",
                "64",
                "--data-parallel-address",
                "127.0.0.1",
            ],
        },
        "worker": {"gpus": 0},
        "server": {"namespace": namespace, "port": http_port},
        "head": {"rayStartParams": head_params},
    }


def _kuberay_start_command(head: str, ray_start_params: dict[str, str], **local: str) -> str:
    """`ray start` as KubeRay generates it from a group's rayStartParams (`head`: "--head" or
    "--address=..."), plus what this machine needs: loopback, ports no other Ray here uses."""
    params = {
        **ray_start_params,
        "node-ip-address": "127.0.0.1",
        "metrics-export-port": str(free_port()),
        **local,
    }
    flags = " ".join(f"--{k}={shlex.quote(v)}" for k, v in params.items())
    return f"ray start {head} {flags} --block --disable-usage-stats"


def _script_env(start_command: str, gcs_port: int) -> dict[str, str]:
    """What KubeRay puts in the head container's env, and the image's PATH."""
    env = ray_env()
    env["KUBERAY_GEN_RAY_START_CMD"] = start_command
    env["RAY_ADDRESS"] = f"127.0.0.1:{gcs_port}"  # also what `ray.init("auto")` finds first
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the image's PATH
    return env


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except OSError:
        return None


def _wait_for_nodes(dashboard_url: str, count: int, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        assert worker.poll() is None, "the worker's ray start ended"
        alive = list_nodes(address=dashboard_url, filters=[("state", "=", "ALIVE")])
        if len(alive) == count:
            return
        assert time.monotonic() < deadline, f"{len(alive)} nodes alive, not {count}"
        time.sleep(1.0)


def test_the_head_script_serves_and_ends_cleanly_on_sigterm(tmp_path: Path) -> None:
    gcs_port, http_port = free_port(), free_port()
    rendered = render_values(_head_values(unique_namespace("head"), gcs_port, http_port))
    head = rendered.raycluster["spec"]["headGroupSpec"]
    script = rendered.head_container["args"][0]
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    # The paths and addresses of this machine instead of a pod's.
    script = script.replace("--model /models/model", f"--model {shlex.quote(checkpoint)}")
    script = script.replace("--host 0.0.0.0", "--host 127.0.0.1")
    dashboard_port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="shead-", dir="/tmp")  # short: socket paths are limited
    command = _kuberay_start_command(
        "--head", head["rayStartParams"], **{
            "num-cpus": "4", "dashboard-port": str(dashboard_port),
            "ray-client-server-port": str(free_port()), "temp-dir": temp_dir,
        },
    )  # fmt: skip
    log = open(tmp_path / "head.log", "w+")  # noqa: SIM115 - read after the script ends
    proc = subprocess.Popen(
        [*rendered.head_container["command"], script],
        stdout=log, stderr=subprocess.STDOUT, env=_script_env(command, gcs_port), start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _health(f"http://127.0.0.1:{http_port}/health") != 200:
            assert proc.poll() is None, Path(log.name).read_text()
            assert time.monotonic() < deadline, Path(log.name).read_text()
            time.sleep(1.0)
        # A worker pod's container joins the head with its own rendered command.
        group = rendered.worker_groups()["gpu"]
        (worker_container,) = group["template"]["spec"]["containers"]
        worker_command = _kuberay_start_command(
            f"--address=127.0.0.1:{gcs_port}", group["rayStartParams"], **{
                "num-cpus": "1", "dashboard-agent-listen-port": str(free_port()),
            },
        )  # fmt: skip
        worker = subprocess.Popen(
            [*worker_container["command"], *worker_container["args"]],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=_script_env(worker_command, gcs_port), start_new_session=True,
        )  # fmt: skip
        try:
            _wait_for_nodes(f"http://127.0.0.1:{dashboard_port}", 2, worker)
        finally:
            stop_process_group(worker.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, Path(log.name).read_text()
        assert _health(f"http://127.0.0.1:{http_port}/health") is None
        assert "stopped" in Path(log.name).read_text()
    finally:
        stop_process_group(proc.pid)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_the_head_script_ends_with_an_error_when_ray_does_not_start(tmp_path: Path) -> None:
    gcs_port = free_port()
    rendered = render_values(_head_values(unique_namespace("head"), gcs_port, free_port()))
    script = rendered.head_container["args"][0]
    proc = subprocess.run(
        [*rendered.head_container["command"], script],
        capture_output=True, text=True, timeout=60,
        env=_script_env("ray start --head --block --no-such-flag", gcs_port),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ray start exited" in proc.stderr
