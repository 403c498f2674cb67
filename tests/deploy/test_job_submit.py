"""End to end on a real `ray start --head`: `ray job submit -- python -m shoal.deploy.serve ...`
(two ranks of two tensor-parallel workers), a separate driver process (`shoal generate`) attaches by namespace and completes requests,
`shoal status` lists both ranks, `shoal stop` leaves no actor and no placement group. The job
serves HTTP with its keys read from files, as the README tells `ray job submit` users to pass
them: neither key shows in `ps`, the job's log or `shoal status --json`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state import list_actors, list_placement_groups

from tests.factories import make_tiny_checkpoint
from tests.ray_utils import (
    RAY_BIN,
    REPO_ROOT,
    TINY_ENGINE_FLAGS,
    RayHead,
    free_port,
    ray_env,
    ray_head,
    unique_namespace,
)

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 120.0
API_KEY = "job-inference-key-8c1e77"
ADMIN_KEY = "job-admin-key-d93a04"


@dataclass
class ServedCluster:
    """A cluster served by a `ray job submit` job."""

    namespace: str
    head: RayHead
    submission_id: str
    jobs: JobSubmissionClient
    port: int

    def job_logs(self) -> str:
        return str(self.jobs.get_job_logs(self.submission_id))

    def job_status(self) -> JobStatus:
        return JobStatus(self.jobs.get_job_status(self.submission_id))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def _shoal(head: RayHead, *args: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess[str]:
    """Runs the `shoal` command (as `python -m shoal.deploy`) against the head node."""
    return subprocess.run(
        [sys.executable, "-m", "shoal.deploy", *args, "--address", head.gcs_address],
        capture_output=True,
        text=True,
        env=ray_env(),
        cwd=REPO_ROOT,
        timeout=timeout_s,
    )


def _serve_args(checkpoint: str, namespace: str) -> list[str]:
    return [
        "--model", checkpoint, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
        "--namespace", namespace, "--data-parallel-address", "127.0.0.1", *TINY_ENGINE_FLAGS,
    ]  # fmt: skip


def _status_json(head: RayHead, namespace: str) -> dict[str, Any] | None:
    result = _shoal(head, "status", "--namespace", namespace, "--json")
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.fixture
def served_cluster(ray_head: RayHead, checkpoint: str, tmp_path: Path) -> Iterator[ServedCluster]:
    """Submits `python -m shoal.deploy.serve` as a Ray job, serving HTTP with keys from files,
    and waits until every rank serves."""
    namespace = unique_namespace("served")
    submission_id = f"shoal-{namespace}"
    port = free_port()
    keys = tmp_path
    (keys / "api.key").write_text(API_KEY + "\n")
    (keys / "admin.key").write_text(ADMIN_KEY + "\n")
    entrypoint = [
        sys.executable, "-m", "shoal.deploy.serve", *_serve_args(checkpoint, namespace),
        "--port", str(port), "--host", "127.0.0.1", "--api-key-file", str(keys / "api.key"),
        "--admin-api-key-file", str(keys / "admin.key"),
    ]  # fmt: skip
    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}}
    submit = subprocess.run(
        [
            RAY_BIN, "job", "submit", "--address", ray_head.dashboard_url,
            "--submission-id", submission_id, "--no-wait",
            "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint,
        ],
        capture_output=True, text=True, env=ray_env(), timeout=60,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr
    served = ServedCluster(
        namespace, ray_head, submission_id, JobSubmissionClient(ray_head.dashboard_url), port
    )
    try:
        _wait_until_served(served)
        yield served
    finally:
        if not served.job_status().is_terminal():
            served.jobs.stop_job(submission_id)
            _wait_for_job(served, timeout_s=30)


def _wait_until_served(served: ServedCluster) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if served.job_status().is_terminal():
            break
        if "shoal cluster ready" in served.job_logs():
            return
        time.sleep(1.0)
    raise AssertionError(
        f"serve job is {served.job_status()} and never became ready; logs:\n{served.job_logs()}"
    )


def _wait_for_job(served: ServedCluster, timeout_s: float) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while not (status := served.job_status()).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    return status


def _models_status(port: int, key: str) -> int:
    """GET /v1/models with `key`; the front end starts right after the ranks are ready."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as e:
            return e.code
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _leftovers(head: RayHead, namespace: str) -> list[str]:
    """Live actors of the namespace and live placement groups of the cluster, via the state API."""
    actors = list_actors(address=head.dashboard_url, filters=[("state", "=", "ALIVE")])
    groups = list_placement_groups(address=head.dashboard_url, filters=[("state", "=", "CREATED")])
    return [f"actor {a.name}" for a in actors if a.ray_namespace == namespace] + [
        f"placement group {g.name}" for g in groups if g.name.startswith(f"shoal-{namespace}-")
    ]


def _assert_nothing_left(head: RayHead, namespace: str) -> None:
    # The state API aggregates with a short delay; what is gone stays gone.
    deadline = time.monotonic() + 10
    while (left := _leftovers(head, namespace)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []


def test_job_submit_serve_status_stop(served_cluster: ServedCluster) -> None:
    head, namespace = served_cluster.head, served_cluster.namespace
    logs = served_cluster.job_logs
    status = _status_json(head, namespace)
    assert status is not None, logs()
    assert [(r["rank"], r["state"]) for r in status["ranks"]] == [(0, "ready"), (1, "ready")]
    assert status["served_by"] and not status["detached"] and not status["stopping"]
    # Two ranks of two tensor-parallel workers: four workers in two placement groups, each
    # with a bundle per worker packed on one node.
    assert status["tensor_parallel_size"] == 2
    workers = [w for rank in status["ranks"] for w in rank["workers"]]
    assert len(workers) == 4 and len({w["pid"] for w in workers}) == 4
    groups = list_placement_groups(
        address=head.dashboard_url, filters=[("state", "=", "CREATED")], detail=True
    )
    ours = [g for g in groups if g.name.startswith(f"shoal-{namespace}-rank-")]
    assert sorted(g.name for g in ours) == [f"shoal-{namespace}-rank-{r}" for r in (0, 1)]
    for group in ours:
        assert len(group.bundles) == 2, group
        assert len({bundle["node_id"] for bundle in group.bundles}) == 1
    live = {
        a.name for a in list_actors(address=head.dashboard_url, filters=[("state", "=", "ALIVE")])
    }
    assert {"shoal-registry", "shoal-coordinator", "shoal-engine-0", "shoal-engine-1"} <= live

    # A separate driver process attaches by namespace and completes requests on both ranks.
    prompts = [f"driver prompt {i}" for i in range(8)]
    driver = _shoal(
        head, "generate", "--namespace", namespace, "--host", "127.0.0.1",
        "--max-tokens", "6", "--json", *prompts,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stdout + driver.stderr
    answers = json.loads(driver.stdout)
    assert [a["prompt"] for a in answers] == prompts
    assert all(len(a["token_ids"]) > 0 and a["finish_reason"] for a in answers)
    assert {a["rank"] for a in answers} == {0, 1}

    # HTTP takes the key read from its file, and neither key is anywhere a user could see it.
    assert _models_status(served_cluster.port, API_KEY) == 200
    assert _models_status(served_cluster.port, "wrong-key") == 401
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    status_json = _shoal(head, "status", "--namespace", namespace, "--json")
    for key in (API_KEY, ADMIN_KEY):
        assert key not in processes
        assert key not in logs()
        assert key not in status_json.stdout + status_json.stderr

    table = _shoal(head, "status", "--namespace", namespace)
    assert table.returncode == 0, table.stderr
    # Rank rows start the line; the attached clients (here the HTTP front end) are indented.
    rows = [line.split() for line in table.stdout.splitlines() if not line.startswith(" ")]
    assert [row[:2] for row in rows if row and row[0] in ("0", "1")] == [
        ["0", "ready"],
        ["1", "ready"],
    ]

    stop = _shoal(head, "stop", "--namespace", namespace)
    assert stop.returncode == 0, stop.stdout + stop.stderr + logs()
    assert _wait_for_job(served_cluster, timeout_s=30) == JobStatus.SUCCEEDED, logs()
    assert "cluster in namespace" in logs() and "stopped" in logs()
    _assert_nothing_left(head, namespace)

    again = _shoal(head, "status", "--namespace", namespace)
    assert again.returncode == 1 and "no shoal cluster runs in namespace" in again.stderr


def test_serve_tears_down_and_exits_0_on_sigterm(ray_head: RayHead, checkpoint: str) -> None:
    namespace = unique_namespace("sigterm")
    serve = subprocess.Popen(
        [sys.executable, "-m", "shoal.deploy.serve", *_serve_args(checkpoint, namespace),
         "--address", ray_head.gcs_address],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_env(), cwd=REPO_ROOT,
    )  # fmt: skip
    output: list[str] = []
    try:
        assert serve.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        for line in serve.stdout:
            output.append(line)
            if "shoal cluster ready" in line or time.monotonic() > deadline:
                break
        assert "shoal cluster ready" in output[-1], "".join(output)
        serve.send_signal(signal.SIGTERM)
        remaining, _ = serve.communicate(timeout=60)
        output.append(remaining)
        assert serve.returncode == 0, "".join(output)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert "stopped" in output[-1]
    _assert_nothing_left(ray_head, namespace)
