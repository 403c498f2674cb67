"""What a launch shows while it waits: each rank's start steps, its weights in percent, in the
order they happened and before the rank serves; a rank that waits for room shown pending in
`shoal status` with what it waits for; a stop asked for mid-launch ending it cleanly."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import pytest
import ray

from shoal.cluster.launch import LaunchOptions, LaunchStopped, attach, is_stopped, launch
from shoal.cluster.placement import RankResources, live_placement_group_names
from shoal.deploy.status import format_status
from shoal.engine.config import EngineConfig
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace

pytestmark = pytest.mark.slow

ENGINE_KWARGS: dict[str, Any] = {"num_gpu_blocks_override": 64, "max_model_len": 256}
_WAIT_S = 120.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def test_a_launch_logs_each_ranks_start_in_order_before_it_serves(
    ray_local: str, checkpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shoal.cluster.ranks")
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=1, **ENGINE_KWARGS)
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1", ready_timeout_s=_WAIT_S)
    handle = launch(config, options, namespace=unique_namespace("progress"))
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "shoal.cluster.ranks"]
        rank0 = [line for line in lines if line.startswith("rank 0")]
        assert rank0[:2] == [_FINDING, _BUILDING], lines
        loading = [line for line in rank0 if "loading weights" in line]
        percents = [int(m[1]) for line in loading if (m := re.search(r"weights (\d+)%", line))]
        assert percents[0] == 0 and percents == sorted(percents) and len(percents) >= 5, loading
        assert re.fullmatch(r"rank 0: loaded weights: \d+ tensors in [\d.]+ s", rank0[-3])
        assert rank0[-2:] == ["rank 0: registering its endpoint", "rank 0 serves"], rank0
        assert lines.index("rank 0 serves") < lines.index(next(x for x in lines if "ready in" in x))
        (rank,) = handle.status()["ranks"]
        assert rank["state"] == "ready" and "pending" not in rank
    finally:
        handle.shutdown()


_FINDING = "rank 0: finding the model and its tokenizer (a Hub id is downloaded here)"
_BUILDING = "rank 0: building the engine: weights, KV cache, sockets"


def _until(what: str, condition: Any) -> Any:
    deadline = time.monotonic() + _WAIT_S
    while not (found := condition()):
        assert time.monotonic() < deadline, f"no {what} within {_WAIT_S} s"
        time.sleep(0.2)
    return found


def test_a_rank_waiting_for_room_shows_pending_and_a_stop_ends_the_launch(
    ray_local: str, checkpoint: str
) -> None:
    """ray_local has 4 CPUs: one rank of 3 fits, the second waits for a node."""
    namespace = unique_namespace("pending")
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    options = LaunchOptions(RankResources(num_cpus=3), host="127.0.0.1", ready_timeout_s=600)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            launch(config, options, namespace=namespace, served_by="here:1")
        except BaseException as e:
            outcome.append(e)

    launching = threading.Thread(target=run, daemon=True)
    launching.start()

    def pending_for_room() -> dict[str, Any] | None:
        try:
            status = attach(namespace).status()
        except Exception:
            return None  # not launched that far yet
        waiting = [
            r for r in status["ranks"] if "waiting for resources" in (r.get("pending") or "")
        ]
        return status if waiting else None

    status = _until("rank waiting for room", pending_for_room)
    by_rank = {r["rank"]: r for r in status["ranks"]}
    assert by_rank[1]["state"] == "starting"
    assert by_rank[1]["pending"] == "waiting for resources: a node with 3 CPUs free"
    table = format_status(status)
    assert re.search(
        r"^1    pending .* waiting for resources: a node with 3 CPUs free$", table, re.M
    )

    ray.get(attach(namespace).registry.request_stop.remote())
    launching.join(_WAIT_S)
    assert not launching.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], LaunchStopped), outcome
    assert is_stopped(namespace) and live_placement_group_names(namespace) == []
