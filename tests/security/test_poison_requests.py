"""Requests that could take a cluster down, against a real `shoal serve --port` of two ranks
with its default limits, while a canary client asks for completions throughout.

Each poison request gets a 4xx for itself, and no rank dies: the registry's incarnations and
failures are what they were (`grammar_sandbox`, `limits`). A burst of large `/tokenize` calls
leaves the front end's resident memory near where it was (`tokenizer_pool`). The canary must be
served; how fast is `bench/attack.py`'s figure, not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from shoal.deploy.openai.limits import DEFAULT_MAX_SEQUENCES_PER_REQUEST
from tests.deploy.openai_utils import FrontEnd, request_json, scrape, start_shoal, total
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import (
    REPO_ROOT,
    TINY_ENGINE_FLAGS,
    RayHead,
    ray_env,
    ray_head,
    unique_namespace,
)
from tests.security.http_client import Canary
from tests.security.poison_inputs import (
    CRASHING_LARK_LENGTH,
    CRASHING_SCHEMA_LENGTH,
    lark_chain,
    ref_chain_schema,
)

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

API_KEY = "poison-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The canary is judged on being served, not on its wait (this machine may be busy).
CANARY_BUDGET_S = 120.0


@pytest.fixture(scope="module")
def namespace() -> str:
    return unique_namespace("poison")


@pytest.fixture(scope="module")
def served(
    ray_head: RayHead, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontEnd]:
    root = tmp_path_factory.mktemp("served")
    checkpoint = make_tiny_checkpoint(root / "tiny-llama", "llama")
    (root / "api.key").write_text(API_KEY + "\n")
    args = [
        "serve", "--model", checkpoint, "--namespace", namespace, "--data-parallel-size", "2",
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1",
        "--api-key-file", str(root / "api.key"), *TINY_ENGINE_FLAGS,
    ]  # fmt: skip
    front_end = start_shoal(ray_head, args, root / "serve.log")
    try:
        yield front_end
    finally:
        assert front_end.stop() == 0, front_end.output()


def _post(served: FrontEnd, path: str, body: Any) -> tuple[int, Any]:
    return request_json(f"{served.base_url}{path}", body, AUTH, timeout_s=300)


def _ranks(ray_head: RayHead, namespace: str) -> tuple[dict[int, int], list[Any]]:
    """Each rank's incarnation, and the rank failures the registry recorded."""
    status = subprocess.run(
        [sys.executable, "-m", "shoal.deploy", "status", "--namespace", namespace, "--json",
         "--address", ray_head.gcs_address],
        capture_output=True, text=True, env=ray_env(), cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    facts = json.loads(status.stdout)
    ranks = {int(r["rank"]): int(r["incarnation"]) for r in facts["ranks"]}
    return ranks, list(facts["rank_failures"])


def _chat(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "a city"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def test_constraints_that_crash_the_compiler_are_400s_and_no_rank_dies(
    served: FrontEnd, ray_head: RayHead, namespace: str
) -> None:
    before, failures = _ranks(ray_head, namespace)
    assert failures == [] and len(before) == 2
    chain = _chat(ref_chain_schema(CRASHING_SCHEMA_LENGTH))
    grammar = {"prompt": "a", "max_tokens": 8, "guided_grammar": lark_chain(CRASHING_LARK_LENGTH)}
    with Canary(served.base_url, API_KEY, budget_s=CANARY_BUDGET_S):
        for path, body in [("/v1/chat/completions", chain), ("/v1/completions", grammar)] * 2:
            status, reply = _post(served, path, body)
            assert status == 400, reply
            assert "crashed the grammar compiler" in reply["error"]["message"], reply
        status, reply = _post(served, "/v1/chat/completions", _chat({"type": "string"}))
        assert status == 200, reply
    assert _ranks(ray_head, namespace) == (before, [])
    samples = scrape(served.base_url)
    assert total(samples, "shoal:poison_requests_total", reason="compile_crash") == 4


def test_the_131072_sequence_request_is_refused_before_anything_is_queued(
    served: FrontEnd,
) -> None:
    with Canary(served.base_url, API_KEY, budget_s=CANARY_BUDGET_S):
        fan_out = {"prompt": ["a"] * 1024, "n": 128, "max_tokens": 4}
        status, reply = _post(served, "/v1/completions", fan_out)
        assert status == 400 and reply["error"]["param"] == "n", reply
        message = reply["error"]["message"]
        assert "131072 sequences" in message and "--max-sequences-per-request" in message
        just_over = {"prompt": ["a"] * 9, "n": 114, "max_tokens": 1}
        assert _post(served, "/v1/completions", just_over)[0] == 400
        at_the_cap = {"prompt": ["a"] * 8, "n": 128, "max_tokens": 1}
        status, reply = _post(served, "/v1/completions", at_the_cap)
        assert status == 200 and len(reply["choices"]) == DEFAULT_MAX_SEQUENCES_PER_REQUEST


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_memory_returns_after_a_burst_of_large_tokenize_calls(served: FrontEnd) -> None:
    pid = served.proc.pid
    text = "the quick brown fox, " * (2_000_000 // 21)
    assert _post(served, "/tokenize", {"prompt": text[:300_000]})[0] == 200  # warm
    baseline = _rss_mb(pid)
    peak = baseline
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, served, "/tokenize", {"prompt": text}) for _ in range(3)]
        while not all(f.done() for f in futures):
            peak = max(peak, _rss_mb(pid))
            time.sleep(0.05)
        assert [f.result()[0] for f in futures] == [200] * 3
    grown = peak - baseline
    assert grown > 100, (baseline, peak)  # the burst did hold memory while it ran
    deadline = time.monotonic() + 30
    while (after := _rss_mb(pid)) > baseline + grown / 4:
        assert time.monotonic() < deadline, (baseline, peak, after)
        time.sleep(0.2)
