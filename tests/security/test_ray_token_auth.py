"""shoal on a Ray cluster with Ray's token authentication on (`RAY_AUTH_MODE=token`), as the Helm
chart runs it: `shoal serve --port` launches, serves and stops with the token, `shoal status`
reads it with the token, and Ray refuses a caller without it (the Ray cluster is the trust
boundary)."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.openai_utils import http_status, request_json, start_shoal
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import (
    REPO_ROOT,
    TINY_ENGINE_FLAGS,
    ray_env,
    start_ray_head,
    stop_ray_head,
    unique_namespace,
)

pytestmark = pytest.mark.slow


def _status(gcs_address: str, namespace: str, auth_token: str) -> int:
    result = subprocess.run(
        [sys.executable, "-m", "shoal.deploy", "status", "--namespace", namespace, "--json",
         "--address", gcs_address],
        capture_output=True, env=ray_env(auth_token), cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip
    return result.returncode


def test_a_token_auth_cluster_serves_and_refuses_a_driver_without_the_token(
    tmp_path: Path,
) -> None:
    token = secrets.token_hex(16)
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-llama", "llama")
    namespace = unique_namespace("token-auth")
    head = start_ray_head(auth_token=token)
    try:
        args = [
            "serve", "--model", checkpoint, "--namespace", namespace,
            "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1", *TINY_ENGINE_FLAGS,
        ]  # fmt: skip
        front_end = start_shoal(head, args, tmp_path / "serve.log", auth_token=token)
        try:
            body = {"prompt": "hello", "max_tokens": 4, "temperature": 0.0}
            status, reply = request_json(f"{front_end.base_url}/v1/completions", body)
            assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
            assert _status(head.gcs_address, namespace, token) == 0
            # Without the token Ray refuses (its GCS as its dashboard: the job API is asked
            # here, the GCS would keep a driver retrying for half a minute first).
            assert http_status(f"{head.dashboard_url}/api/jobs/") == 401
        finally:
            assert front_end.stop() == 0, front_end.output()
    finally:
        stop_ray_head(head)
