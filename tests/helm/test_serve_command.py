"""The `shoal serve` command line helm/shoal renders for the head, run for real: `ray job submit`
of exactly that entrypoint against a local `ray start --head`, with the model path swapped for a
tiny local checkpoint and the addresses for this machine's; the API key comes from the chart's
Secret through the env var the chart sets. A plain HTTP client then gets answers.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.factories import make_tiny_checkpoint
from tests.helm.rendering import Rendered, render_values
from tests.ray_utils import (
    RAY_BIN,
    REPO_ROOT,
    RayHead,
    free_port,
    ray_env,
    ray_head,
    unique_namespace,
)

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 120.0
API_KEY = "sk-chart-test"


def _values(namespace: str) -> dict[str, Any]:
    """Two CPU ranks of a tiny model: GPU counts 0, everything else as a user would set it."""
    return {
        "modelSpec": {
            "name": "tiny-llama",
            "dataParallelSize": 2,
            "gpusPerRank": 0,
            "maxModelLen": 256,
            "dtype": "float32",
            "extraArgs": ["--num-gpu-blocks-override", "64"],
        },
        "worker": {"gpus": 0, "replicas": 2, "maxReplicas": 2},
        "server": {"namespace": namespace, "apiKey": {"value": API_KEY}},
    }


def _swap(argv: list[str], flag: str, value: str) -> None:
    index = argv.index(flag) + 1
    argv[index] = value


def _entrypoint(rendered: Rendered, checkpoint: str, port: int) -> list[str]:
    argv = rendered.serve_argv()
    argv[0] = str(Path(sys.executable).with_name("shoal"))  # the image's `shoal` on PATH
    _swap(argv, "--model", checkpoint)
    _swap(argv, "--host", "127.0.0.1")
    _swap(argv, "--port", str(port))
    # In a pod the engines bind the pod's IP (the default); here, loopback only.
    return [*argv, "--data-parallel-address", "127.0.0.1"]


def _head_env(rendered: Rendered) -> dict[str, str]:
    """The head container's env, Secret references resolved from the rendered Secrets."""
    secrets = {s["metadata"]["name"]: s["data"] for s in rendered.of_kind("Secret")}
    env = {}
    for var in rendered.head_container.get("env", []):
        ref = var["valueFrom"]["secretKeyRef"]
        env[var["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    return env


def _http(
    url: str, body: dict[str, Any] | None = None, key: str | None = API_KEY
) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    text = raw.decode()
    return status, json.loads(text) if text.startswith(("{", "[")) else text


def _wait_until_healthy(base: str, jobs: JobSubmissionClient, submission_id: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if JobStatus(jobs.get_job_status(submission_id)).is_terminal():
            break
        try:
            if _http(f"{base}/health", key=None)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(1.0)
    raise AssertionError(f"never healthy; job logs:\n{jobs.get_job_logs(submission_id)}")


def test_the_rendered_serve_command_serves_openai_requests(
    ray_head: RayHead, tmp_path: Path
) -> None:
    namespace = unique_namespace("chart")
    rendered = render_values(_values(namespace))
    port = free_port()
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-llama", "llama")
    env = _head_env(rendered)
    assert env == {"SHOAL_API_KEY": API_KEY}
    runtime_env = {"env_vars": {**env, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}}
    submission_id = f"chart-{namespace}"
    submit = subprocess.run(
        [RAY_BIN, "job", "submit", "--address", ray_head.dashboard_url,
         "--submission-id", submission_id, "--no-wait",
         "--runtime-env-json", json.dumps(runtime_env), "--",
         *_entrypoint(rendered, checkpoint, port)],
        capture_output=True, text=True, env=ray_env(), timeout=60,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr
    jobs = JobSubmissionClient(ray_head.dashboard_url)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(base, jobs, submission_id)
        status, models = _http(f"{base}/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny-llama"]
        assert _http(f"{base}/v1/models", key=None)[0] == 401
        for i in range(4):
            status, answer = _http(
                f"{base}/v1/completions",
                {"model": "tiny-llama", "prompt": f"chart prompt {i}", "max_tokens": 5,
                 "temperature": 0},
            )  # fmt: skip
            assert status == 200, answer
            assert answer["choices"][0]["finish_reason"] in ("length", "stop")
            assert answer["usage"]["completion_tokens"] > 0
        status, metrics = _http(f"{base}/metrics", key=None)
        assert status == 200 and isinstance(metrics, str) and "# TYPE" in metrics
    finally:
        jobs.stop_job(submission_id)
        deadline = time.monotonic() + 60
        while not JobStatus(jobs.get_job_status(submission_id)).is_terminal():
            assert time.monotonic() < deadline, jobs.get_job_logs(submission_id)
            time.sleep(0.5)
