"""Tenants against a real `shoal serve --port`: a flood gets 429s with `Retry-After` once its
queue is full while another tenant is admitted at once, a `priority` request overtakes the
queued ones of its tenant, and `/metrics` counts each tenant.

One rank of a tiny Llama serves the module, with `--scheduling-policy priority` and room for
about five of the flood's long streams (8,192 KV tokens; a stream is ~1,510). Its key file:

    flood    k-flood    max_queued=2
    quiet    k-quiet
    ordered  k-ordered  max_concurrency=1

Every step waits on what `/metrics` or a response says, never on a clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.deploy.openai_utils import FrontEnd, request_json, scrape, start_shoal, total
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import RayHead, ray_head, unique_namespace

__all__ = ["ray_head"]

pytestmark = pytest.mark.slow

KEYS = {"flood": "k-flood", "quiet": "k-quiet", "ordered": "k-ordered"}
KEY_FILE = "flood k-flood max_queued=2\nquiet k-quiet\nordered k-ordered max_concurrency=1\n"
ADMIN_KEY = "k-admin"
LONG = {
    "prompt": "once upon a time",
    "max_tokens": 1500,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}
SHORT = {"prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def served(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontEnd]:
    root = tmp_path_factory.mktemp("tenants")
    checkpoint = make_tiny_checkpoint(root / "tiny-llama", "llama", max_position_embeddings=2048)
    (root / "api.keys").write_text(KEY_FILE)
    (root / "admin.key").write_text(ADMIN_KEY)
    args = [
        "serve", "--model", checkpoint, "--namespace", unique_namespace("tenants"),
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1",
        "--api-key-file", str(root / "api.keys"), "--admin-api-key-file", str(root / "admin.key"),
        "--max-model-len", "2048", "--num-gpu-blocks-override", "512",
        "--scheduling-policy", "priority", "--served-model-name", "tiny",
    ]  # fmt: skip
    front_end = start_shoal(ray_head, args, root / "serve.log")
    try:
        yield front_end
    finally:
        assert front_end.stop() == 0, front_end.output()


def _client(served: FrontEnd, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{served.base_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=300
    )


def _count(served: FrontEnd, series: str, tenant: str, **labels: str) -> float:
    return total(scrape(served.base_url), f"shoal:tenant_{series}", tenant=tenant, **labels)


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Polls `condition` (a response or `/metrics`) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(condition):
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


class _Streams:
    """Open streams of one tenant, read in the background and closed (aborted) at the end.
    `started` holds each named stream once its response began: it was admitted."""

    def __init__(self, client: openai.AsyncOpenAI) -> None:
        self.client = client
        self.tasks: list[asyncio.Task[Any]] = []
        self.started: dict[str, Any] = {}

    def open(self, body: dict[str, Any], name: str = "") -> asyncio.Task[Any]:
        async def run() -> None:
            stream = await self.client.completions.create(model="tiny", stream=True, **body)
            self.started[name or str(len(self.started))] = stream
            async for _ in stream:
                pass

        task = asyncio.create_task(run())
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for stream in list(self.started.values()):  # a stream may start while others close
            await stream.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _decided(served: FrontEnd, tenant: str) -> float:
    """Requests of `tenant` the front end has admitted, queued or refused."""
    samples = scrape(served.base_url)
    return sum(
        total(samples, f"shoal:tenant_{series}", tenant=tenant)
        for series in ("requests_admitted_total", "requests_waiting", "requests_rejected_total")
    )


async def test_a_flood_gets_429s_once_its_queue_is_full_and_another_tenant_goes_ahead(
    served: FrontEnd,
) -> None:
    flood = _Streams(_client(served, "flood"))
    try:
        refused: openai.RateLimitError | None = None
        for sent in range(1, 30):
            task = flood.open(LONG)
            await _until(
                lambda t=task, n=sent: t.done() or _decided(served, "flood") >= n, "decided"
            )
            if task.done():
                refused = task.exception()  # type: ignore[assignment]
                assert isinstance(refused, openai.RateLimitError), refused
                break
        assert refused is not None, "the flood was never refused"
        assert refused.status_code == 429 and refused.code == "tenant_queue_full"
        assert int(refused.response.headers["retry-after"]) >= 1
        # Its queue was full at the refusal; a change of capacity (the ranks' stats) may admit
        # one of it since, but never lets it grow past its bound.
        assert _count(served, "requests_waiting", "flood") <= 2
        # Another tenant is not queued behind the flood: admitted at once, within its share.
        reply = await _client(served, "quiet").completions.create(model="tiny", **SHORT)
        assert reply.choices[0].finish_reason == "length"
        assert _count(served, "requests_queued_total", "quiet") == 0
        assert _count(served, "requests_admitted_total", "quiet") == 1
        assert _count(served, "requests_rejected_total", "flood", reason="tenant_queue_full") >= 1
    finally:
        await flood.close()
    await _until(lambda: _count(served, "requests_in_flight", "flood") == 0, "flood released")


async def test_a_priority_request_overtakes_the_queued_requests_of_its_tenant(
    served: FrontEnd,
) -> None:
    # max_concurrency=1: one stream of the tenant runs at a time, and the next is admitted
    # only once the test closes the running one, so the order they start in is the order
    # the front end admitted them.
    ordered = _Streams(_client(served, "ordered"))
    try:
        ordered.open(LONG, "first")
        await _until(lambda: "first" in ordered.started, "first running")
        for queued, (name, priority) in enumerate((("b", 0), ("c", 0), ("urgent", -1)), 1):
            ordered.open({**LONG, "extra_body": {"ignore_eos": True, "priority": priority}}, name)
            await _until(
                lambda n=queued: _count(served, "requests_waiting", "ordered") == n,
                f"{name} queued",
            )
        for num_started in (2, 3, 4):
            await list(ordered.started.values())[-1].close()  # its release admits the next
            await _until(lambda n=num_started: len(ordered.started) == n, "the next admitted")
    finally:
        await ordered.close()
    assert list(ordered.started) == ["first", "urgent", "b", "c"]
    assert _count(served, "queue_time_seconds_count", "ordered") == 3


def test_each_tenant_is_counted_and_a_wrong_key_is_refused(served: FrontEnd) -> None:
    status, _ = request_json(
        f"{served.base_url}/v1/completions",
        {**SHORT, "model": "tiny"},
        {"Authorization": f"Bearer {KEYS['quiet']}"},
    )
    assert status == 200
    samples = scrape(served.base_url)
    assert total(samples, "shoal:tenant_requests_admitted_total", tenant="quiet") >= 1
    assert total(samples, "shoal:tenant_prompt_tokens_total", tenant="quiet") > 0
    assert total(samples, "shoal:tenant_generation_tokens_total", tenant="quiet") >= 2
    assert total(samples, "shoal:tenant_admitted_tokens_total", tenant="quiet") > 0
    assert total(samples, "shoal:admission_capacity_tokens") == 512 * 16
    for key, expected in (("wrong", 401), (KEYS["flood"], 200)):
        auth = {"Authorization": f"Bearer {key}"}
        assert request_json(f"{served.base_url}/v1/models", None, auth)[0] == expected
        # A tenant's key is not the admin key.
        assert request_json(f"{served.base_url}/is_scaling_elastic_ep", None, auth)[0] == 401
    bad = {**SHORT, "model": "tiny", "priority": 2**64}
    auth = {"Authorization": f"Bearer {KEYS['quiet']}"}
    status, body = request_json(f"{served.base_url}/v1/completions", bad, auth)
    assert status == 400 and body["error"]["param"] == "priority"
