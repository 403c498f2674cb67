"""The doors to a resize: `shoal scale` and `shoal status`, `POST /scale_elastic_ep` and
`GET /is_scaling_elastic_ep`, and the resize series of `/metrics`.

The slow tests share one real `shoal serve --port` (two ranks of a tiny Llama on a `ray start
--head` node) and run in order: the CLI takes it from 2 to 3 ranks, HTTP back to 2 while
streams run, then two resizes to 3 at once. The others check the pieces without a cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pydantic
import pytest
import ray.exceptions

from shoal.cluster.elastic import ScaleError, ScaleInProgressError
from shoal.deploy.openai.app import needs_admin_key, needs_api_key
from shoal.deploy.openai.elastic import scale_failure
from shoal.deploy.openai.protocol import ScaleElasticEPRequest
from shoal.deploy.scale import format_report, scale_status_lines
from tests.deploy.openai_utils import (
    API_KEY,
    MODEL_NAME,
    FrontEnd,
    request_json,
    scrape,
    serving_two_ranks,
    total,
)
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import REPO_ROOT, RayHead, ray_env, ray_head, unique_namespace

__all__ = ["ray_head"]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The quick brown fox"
SCALE_TIMEOUT_S = 240.0

# --- the pieces, without a cluster ------------------------------------------------------------


def test_the_scale_body_is_one_strict_integer() -> None:
    assert (
        ScaleElasticEPRequest.model_validate({"new_data_parallel_size": 3}).switch_timeout_s is None
    )
    for body in (
        {},
        {"new_data_parallel_size": "3"},
        {"new_data_parallel_size": True},
        {"new_data_parallel_size": 2.5},
        {"new_data_parallel_size": 3, "drain_timeout": 60},  # vLLM's: shoal does not drain
        {"new_data_parallel_size": 3, "switch_timeout_s": 0},
    ):
        with pytest.raises(pydantic.ValidationError):
            ScaleElasticEPRequest.model_validate(body)


def test_the_resize_endpoints_need_the_admin_key_and_the_work_endpoints_the_api_key() -> None:
    for path in ("/scale_elastic_ep", "/is_scaling_elastic_ep", "/is_scaling_elastic_ep/"):
        assert needs_admin_key(path) and not needs_api_key(path), path
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/openapi.json"):
        assert needs_api_key(path) and not needs_admin_key(path), path
    for path in ("/health", "/metrics", "/version", "/load"):
        assert not needs_api_key(path) and not needs_admin_key(path), path


def _remote(error: Exception) -> Exception:
    """`error` as `ray.get` raises it from an actor: a RayTaskError that is also its type."""
    traceback = f"Traceback (most recent call last):\n  File ...\n{type(error).__name__}: {error}"
    wrapped: Exception = ray.exceptions.RayTaskError(
        "RegistryActor.begin_scale", traceback, error
    ).as_instanceof_cause()
    return wrapped


def test_refused_and_failed_resizes_answer_409_400_503_in_one_line() -> None:
    busy = scale_failure(_remote(ScaleInProgressError("a scale from 2 to 3 ranks is in progress")))
    assert (busy.status, busy.type, busy.code) == (409, "ConflictError", "scale_in_progress")
    assert busy.message == "a scale from 2 to 3 ranks is in progress"
    rolled_back = scale_failure(ScaleError("the new set did not form within 60 s"))
    assert rolled_back.status == 503 and rolled_back.code == "scale_rolled_back"
    assert "rolled back" in rolled_back.message and "old size" in rolled_back.message
    assert "\n" not in rolled_back.message
    bad = scale_failure(ValueError("a cluster needs at least one rank, not 0"))
    assert (bad.status, bad.param) == (400, "new_data_parallel_size")
    assert scale_failure(TimeoutError("routes over [0, 1]")).status == 504
    assert scale_failure(RuntimeError("boom")).status == 500


def test_status_shows_the_resize_running_and_the_last_ones() -> None:
    history = [
        {"epoch": e, "from_size": 2, "to_size": 3, "outcome": "committed", "duration_s": 1.25,
         "detail": "", "finished_at": 900.0}
        for e in range(1, 7)
    ]  # fmt: skip
    history[-1].update(outcome="rolled_back", detail="EngineStartError: rank 2 failed")
    status = {
        "scaling": {"epoch": 7, "from_size": 3, "target_size": 1, "phase": "switching",
                    "owner": "host:42", "running_s": 3.4},
        "scale_history": history,
    }  # fmt: skip
    lines = scale_status_lines(status, now=1000.0)
    assert lines[0] == "scaling: 3 → 1 ranks, phase switching, for 3 s (epoch 7, by host:42)"
    assert lines[1] == "scales (the last 5):"
    assert lines[2] == "  epoch 2: 2 → 3 ranks committed in 1.2 s, 100 s ago"
    assert lines[6].startswith("  epoch 6: 2 → 3 ranks rolled_back in 1.2 s, 100 s ago")
    assert lines[6].endswith("(EngineStartError: rank 2 failed)")
    assert scale_status_lines({"scaling": None, "scale_history": []}) == []

    report = {"epoch": 3, "from_size": 2, "to_size": 3, "outcome": "committed",
              "phases": {"starting": 9.5, "finishing": 0.25}, "total_s": 9.75}  # fmt: skip
    assert format_report("prod", report) == (
        "scaled namespace prod from 2 to 3 ranks in 9.75 s (epoch 3): starting 9.50 s, "
        "finishing 0.25 s"
    )
    unchanged = {**report, "from_size": 3, "outcome": "unchanged", "phases": {}}
    assert "has 3 ranks already" in format_report("prod", unchanged)


# --- a real cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def namespace() -> str:
    return unique_namespace("doors")


@pytest.fixture(scope="module")
def served(
    ray_head: RayHead, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontEnd]:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    with serving_two_ranks(
        ray_head, checkpoint, namespace, tmp_path_factory.mktemp("logs")
    ) as front_end:
        yield front_end


@pytest.fixture(scope="module")
def client(served: FrontEnd) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0)


def _shoal(head: RayHead, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.deploy", *args, "--address", head.gcs_address],
        capture_output=True, text=True, env=ray_env(), cwd=REPO_ROOT, timeout=SCALE_TIMEOUT_S,
    )  # fmt: skip


def _scale(served: FrontEnd, body: dict[str, Any]) -> tuple[int, Any]:
    url = f"{served.base_url}/scale_elastic_ep"
    return request_json(url, body, AUTH, timeout_s=SCALE_TIMEOUT_S)


def _is_scaling(served: FrontEnd) -> bool:
    status, body = request_json(f"{served.base_url}/is_scaling_elastic_ep", headers=AUTH)
    assert status == 200, body
    return bool(body["is_scaling_elastic_ep"])


@pytest.mark.slow
def test_bad_bodies_get_400_and_no_key_gets_401(served: FrontEnd) -> None:
    for body, param in (
        ({"new_data_parallel_size": "3"}, "new_data_parallel_size"),
        ({"new_data_parallel_size": 3, "drain_timeout": 60}, "drain_timeout"),
        ({"new_data_parallel_size": 0}, "new_data_parallel_size"),  # the cluster refuses it
    ):
        status, response = _scale(served, body)
        assert status == 400, response
        assert set(response["error"]) == {"message", "type", "param", "code"}
        assert param in (response["error"]["param"] or ""), response
    for path, body in (("/scale_elastic_ep", {"new_data_parallel_size": 3}),
                       ("/is_scaling_elastic_ep", None)):  # fmt: skip
        status, response = request_json(f"{served.base_url}{path}", body)
        assert status == 401 and response["error"]["type"] == "authentication_error"
        status, response = request_json(
            f"{served.base_url}{path}", body, {"Authorization": "Bearer wrong"}
        )
        assert status == 401, response
    assert not _is_scaling(served)


@pytest.mark.slow
def test_shoal_scale_grows_the_cluster_and_status_shows_it(
    ray_head: RayHead, served: FrontEnd, namespace: str
) -> None:
    result = _shoal(ray_head, "scale", "--namespace", namespace, "--data-parallel-size", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"scaled namespace {namespace} from 2 to 3 ranks in " in result.stdout

    result = _shoal(ray_head, "status", "--namespace", namespace, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert [(r["rank"], r["state"]) for r in status["ranks"]] == [
        (0, "ready"), (1, "ready"), (2, "ready"),
    ]  # fmt: skip
    assert status["data_parallel_size"] == 3 and status["scaling"] is None
    event = status["scale_history"][-1]
    assert (event["from_size"], event["to_size"], event["outcome"]) == (2, 3, "committed")

    text = _shoal(ray_head, "status", "--namespace", namespace).stdout
    assert f"epoch {event['epoch']}: 2 → 3 ranks committed in " in text, text
    assert "scaling:" not in text
    # The front end routes to the new rank (it is a ready rank in its /metrics).
    deadline = time.monotonic() + 30
    while total(scrape(served.base_url), "shoal:ranks", state="ready") != 3:
        assert time.monotonic() < deadline, "the front end never saw three ready ranks"
        time.sleep(0.2)

    # Asking again for the size it has is not an error.
    again = _shoal(ray_head, "scale", "--namespace", namespace, "--data-parallel-size", "3")
    assert again.returncode == 0 and "ranks already" in again.stdout, again.stderr
    missing = _shoal(ray_head, "scale", "--namespace", "nobody-here", "--data-parallel-size", "2")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == (
        "shoal scale: no shoal cluster runs in namespace 'nobody-here'"
    )


def _stream(api: openai.OpenAI, max_tokens: int, into: dict[str, Any]) -> None:
    """A greedy streamed completion; records its text, usage and when its first and last
    chunks came."""
    chunks = api.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = []
    for chunk in chunks:
        into.setdefault("first_at", time.monotonic())
        if chunk.choices:
            text.append(chunk.choices[0].text)
            into["finish_reason"] = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            into["completion_tokens"] = chunk.usage.completion_tokens
    into["last_at"] = time.monotonic()
    into["text"] = "".join(text)


@pytest.mark.slow
def test_post_scale_shrinks_the_cluster_while_streams_run_across_it(
    served: FrontEnd, client: openai.OpenAI
) -> None:
    max_tokens = 240
    expected = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    streams: list[dict[str, Any]] = [{} for _ in range(3)]  # likely one on each rank
    threads = [threading.Thread(target=_stream, args=(client, max_tokens, s)) for s in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not all("first_at" in s for s in streams):
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.02)

    posted_at = time.monotonic()
    status, report = _scale(served, {"new_data_parallel_size": 2})
    assert status == 200, report
    assert (report["from_size"], report["to_size"], report["outcome"]) == (3, 2, "committed")
    assert report["message"] == "scaled from 3 to 2 data parallel ranks"
    assert report["total_s"] > 0 and "finishing" in report["phases"]
    assert not _is_scaling(served)
    for t in threads:
        t.join(120)
    for s in streams:
        assert s["first_at"] < posted_at < s["last_at"], "the stream did not run across the POST"
        assert s["finish_reason"] == "length" and s["completion_tokens"] == max_tokens
        assert s["text"] == expected  # greedy: a request that moved rank goes on where it was
    samples = scrape(served.base_url)
    assert total(samples, "shoal:data_parallel_size") == 2
    assert total(samples, "shoal:ranks", state="ready") == 2


@pytest.mark.slow
def test_two_resizes_at_once_one_200_one_409_and_v1_serves_meanwhile(
    served: FrontEnd, client: openai.OpenAI
) -> None:
    answers: list[tuple[int, Any]] = []

    def post() -> None:
        answers.append(_scale(served, {"new_data_parallel_size": 3}))

    threads = [threading.Thread(target=post) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not _is_scaling(served):
        assert answers == [] or answers[0][0] == 409, answers
        assert time.monotonic() < deadline, "no resize showed as running"
        time.sleep(0.05)
    # The event loop is not held by the resize: a completion is answered while it runs.
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0
    )
    assert response.choices[0].text and any(t.is_alive() for t in threads)
    assert total(scrape(served.base_url), "shoal:scale_in_progress") == 1
    for t in threads:
        t.join(SCALE_TIMEOUT_S)
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200, 409], answers
    done, refused = sorted(answers, key=lambda a: a[0])
    assert (done[1]["from_size"], done[1]["to_size"], done[1]["outcome"]) == (2, 3, "committed")
    error = refused[1]["error"]
    assert error["type"] == "ConflictError" and error["code"] == "scale_in_progress"
    assert "in progress" in error["message"] and "\n" not in error["message"]
    assert not _is_scaling(served)


@pytest.mark.slow
def test_metrics_count_each_resize_once(served: FrontEnd) -> None:
    # Three committed so far: CLI 2 → 3, HTTP 3 → 2, HTTP 2 → 3; and one unchanged (3 → 3).
    for _ in range(2):  # however often it is scraped
        samples = scrape(served.base_url)
        assert total(samples, "shoal:scale_events_total", outcome="committed") == 3
        assert total(samples, "shoal:scale_events_total", outcome="unchanged") == 1
        assert total(samples, "shoal:scale_events_total", outcome="rolled_back") == 0
        assert total(samples, "shoal:scale_duration_seconds_count", outcome="committed") == 3
        assert total(samples, "shoal:scale_duration_seconds_sum", outcome="committed") > 0
        assert total(samples, "shoal:data_parallel_size", model_name=MODEL_NAME) == 3
        assert total(samples, "shoal:scale_in_progress") == 0
