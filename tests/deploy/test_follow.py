"""A `shoal api-server` follows its cluster (`deploy/openai/follow.py`): it says what it waits
for, serves once a rank does, answers 503 with the reason after `shoal stop`, and serves the
next cluster of its namespace by itself; with `--exit-with-cluster` it exits instead. Real Ray
(a `ray start --head` node), real `shoal` processes, the official `openai` client."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import ray
from fastapi.testclient import TestClient

from shoal.deploy import cli
from shoal.deploy.openai.app import build_app
from shoal.deploy.openai.state import ServerState
from tests.deploy.openai_utils import (
    API_KEY,
    MODEL_NAME,
    FrontEnd,
    request_json,
    scrape,
    spawn_shoal,
)
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import TINY_ENGINE_FLAGS, RayHead, ray_head, unique_namespace

__all__ = ["ray_head"]

_TIMEOUT_S = 240.0


@pytest.fixture
def shoal_here(ray_head: RayHead) -> Iterator[Callable[..., int]]:
    """Runs `shoal` commands in this process (no interpreter to start) against `ray_head`."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield lambda *args: cli.main([*args, "--address", ray_head.gcs_address])
    ray.shutdown()
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def _wait_for(what: str, condition: Callable[[], bool], *logs_of: FrontEnd) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not condition():
        logs = "\n".join(f.output() for f in logs_of)
        assert time.monotonic() < deadline, f"no {what} within {_TIMEOUT_S} s:\n{logs}"
        time.sleep(0.3)


def _health(front_end: FrontEnd) -> tuple[int, object]:
    try:
        return request_json(f"{front_end.base_url}/health", timeout_s=5)
    except OSError:
        return 0, None


def test_a_detached_front_end_answers_503_with_the_reason_before_reading_a_body() -> None:
    state = ServerState(None, MODEL_NAME, API_KEY)
    state.detach_cluster("the cluster in namespace 'prod' is gone")
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    with TestClient(build_app(state)) as http:
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"] == "the cluster in namespace 'prod' is gone"
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/tokenize"), ("POST", "/scale_elastic_ep")):  # fmt: skip
            answer = http.request(method, path, headers=keyed, content=b"not even JSON")
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["error"]["code"] == "cluster_not_serving"
        assert http.post("/v1/completions", content=b"{}").status_code == 401  # keys first
        assert http.get("/version").status_code == 200
        metrics = http.get("/metrics").text
        assert (
            "vllm:num_requests_running{" not in metrics and "vllm:cache_config_info{" not in metrics
        )


@pytest.mark.slow
def test_api_server_waits_for_its_cluster_and_follows_it_through_stop_and_serve(
    ray_head: RayHead, shoal_here: Callable[..., int], tmp_path: Path
) -> None:
    namespace = unique_namespace("follow")
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    serve = [
        "serve", checkpoint, "--data-parallel-size", "1", "--namespace", namespace,
        "--data-parallel-address", "127.0.0.1", "--detached", *TINY_ENGINE_FLAGS,
    ]  # fmt: skip
    front_end_args = [
        "api-server", "--namespace", namespace, "--host", "127.0.0.1", "--api-key", API_KEY,
        "--served-model-name", MODEL_NAME, "--data-parallel-address", "127.0.0.1",
    ]  # fmt: skip
    follower = spawn_shoal(ray_head, front_end_args, tmp_path / "follower.log")
    leaver = spawn_shoal(
        ray_head, [*front_end_args, "--exit-with-cluster"], tmp_path / "leaver.log"
    )
    try:
        # Started before any cluster: both say what they wait for.
        waiting = f"no shoal cluster runs in namespace '{namespace}'"
        _wait_for(
            "waiting lines",
            lambda: all(waiting in f.output() for f in (follower, leaver)),
            follower,
            leaver,
        )
        assert shoal_here(*serve) == 0
        # A mistyped namespace: progress, the namespaces that do hold clusters, exit 1.
        typo = spawn_shoal(
            ray_head, ["api-server", "--namespace", "typo", "--ready-timeout", "2"],
            tmp_path / "typo.log",
        )  # fmt: skip
        _wait_for(
            "health",
            lambda: all(_health(f)[0] == 200 for f in (follower, leaver)),
            follower,
            leaver,
        )
        client = openai.OpenAI(
            base_url=f"{follower.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )
        first = client.completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0.0
        )
        assert first.usage is not None and first.usage.completion_tokens == 4
        info = [k for k in scrape(follower.base_url) if k.startswith("vllm:cache_config_info{")]
        assert len(info) == 1 and "engine=0" in info[0] and "num_gpu_blocks=64" in info[0], info
        # The engine's steps: the prompt's, then one token each (the stats stream lags a bit).
        steps = "vllm:iteration_tokens_total_count{engine=0,model_name=tiny-llama}"
        _wait_for("step counts", lambda: scrape(follower.base_url).get(steps) == 4, follower)
        tokens = scrape(follower.base_url)[steps.replace("_count", "_sum")]
        assert tokens == first.usage.prompt_tokens + 3
        assert typo.proc.wait(60) == 1
        said = typo.output()
        assert "waiting for a cluster to serve" in said and "--ready-timeout" in said, said
        assert f"no shoal cluster runs in namespace 'typo'; clusters run in: '{namespace}'" in said

        assert shoal_here("stop", "--namespace", namespace) == 0
        _wait_for("detached /health", lambda: "is gone" in str(_health(follower)[1]), follower)
        assert _health(follower)[0] == 503
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0)
        assert refused.value.status_code == 503
        assert f"the cluster in namespace '{namespace}' is gone" in refused.value.message
        assert leaver.proc.wait(60) == 0, leaver.output()
        assert "exiting (--exit-with-cluster)" in leaver.output()

        assert shoal_here(*serve) == 0
        _wait_for("health again", lambda: _health(follower)[0] == 200, follower)
        again = client.completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0
        )
        assert again.choices[0].text == first.choices[0].text  # greedy, same weights
        assert "attached again to the cluster" in follower.output()
    finally:
        shoal_here("stop", "--namespace", namespace)
        assert follower.stop() == 0, follower.output()
        leaver.stop()
