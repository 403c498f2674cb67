"""A real two-rank cluster of a tiny model on CPU bundles: launch, attach, restart, shut down."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group_table

from shoal.actors.membership import Membership, RankState
from shoal.client import SyncMPClient
from shoal.cluster.launch import (
    READY_TIMEOUT_S,
    ClusterExistsError,
    ClusterHandle,
    ClusterNotFoundError,
    EngineStartError,
    LaunchOptions,
    attach,
    launch,
)
from shoal.cluster.placement import RankResources, live_placement_group_names
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.protocol import EngineCoreRequest, EngineEndpoint, SamplingParams
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace

pytestmark = pytest.mark.slow

ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 64,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
}
CPU_RANK = RankResources(num_cpus=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def cluster(ray_local: str, checkpoint: str) -> Iterator[ClusterHandle]:
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    options = LaunchOptions(CPU_RANK, host="127.0.0.1", ready_timeout_s=120)
    handle = launch(config, options, namespace=unique_namespace("cluster"))
    yield handle
    handle.shutdown()


def _live_shoal_actors() -> list[str]:
    return sorted(
        a["Name"]
        for a in ray._private.state.actors().values()
        if a["Name"].startswith("shoal-") and a["State"] != "DEAD"
    )


def _generate(
    cluster: ClusterHandle, endpoint: EngineEndpoint, name: str, num_tokens: int = 4
) -> list[int]:
    """A request through a client attached as the cluster's clients are: its key handed to
    the engines by the registry."""
    keys = CurveKeyPair.generate()
    client_index = ray.get(cluster.registry.attach_client.remote(name, keys.public))
    client = SyncMPClient([endpoint], client_index=client_index, curve_keys=keys)
    try:
        assert client.call_utility("echo", "ping") == "ping"
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        client.add_request(EngineCoreRequest("r0", [5, 6, 7, 8], params))
        tokens: list[int] = []
        while True:
            for output in client.get_output(timeout=30).outputs:
                tokens += output.new_token_ids
                if output.finished:
                    return tokens
    finally:
        client.shutdown()
        ray.get(cluster.registry.detach_client.remote(client_index))


def test_every_rank_is_ready_with_an_endpoint_in_its_own_placement_group(
    cluster: ClusterHandle,
) -> None:
    membership = cluster.membership()
    assert sorted(membership.ranks) == [0, 1]
    for rank, info in membership.ranks.items():
        assert info.state == RankState.READY and info.incarnation == 1
        assert info.endpoint is not None and info.endpoint.engine_index == rank
        assert info.endpoint.input_address.startswith("tcp://127.0.0.1:")
    assert membership.stats_publish_address is not None

    table = {e["name"]: e for e in placement_group_table().values() if e["state"] == "CREATED"}
    for rank in (0, 1):
        entry = table[f"shoal-{cluster.namespace}-rank-{rank}"]
        assert entry["bundles"] == {0: {"CPU": 1.0}} and entry["strategy"] == "STRICT_PACK"

    for endpoint in membership.routable_endpoints():
        assert len(_generate(cluster, endpoint, "test")) == 4


def test_status_shows_each_rank_load_from_the_coordinator(cluster: ClusterHandle) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = cluster.status()
        if all(r["load"] is not None for r in status["ranks"]):
            break
        time.sleep(0.2)
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    for rank in status["ranks"]:
        assert rank["state"] == "ready"
        assert rank["load"]["num_total_blocks"] == 64


def test_the_registry_keeps_how_ranks_were_started_but_not_the_launchs_timeout(
    cluster: ClusterHandle,
) -> None:
    """What a resize, from any driver, reads back to start ranks as the launch did; its own
    start-up timeout it brings itself."""
    kept = LaunchOptions.of(attach(cluster.namespace))
    assert kept == LaunchOptions(CPU_RANK, host="127.0.0.1")
    assert kept.ready_timeout_s == READY_TIMEOUT_S != 120


def test_attach_by_namespace_and_refuse_a_second_launch(cluster: ClusterHandle) -> None:
    attached = attach(cluster.namespace)
    assert attached.membership().epoch == cluster.membership().epoch
    assert ray.get(attached.registry.ping.remote())
    with pytest.raises(ClusterNotFoundError):
        attach(unique_namespace("absent"))
    config = cluster.membership().config
    with pytest.raises(ClusterExistsError):
        launch(config, LaunchOptions(CPU_RANK), namespace=cluster.namespace)


def _wait_for_rank(
    cluster: ClusterHandle, rank: int, predicate: Any, timeout_s: float
) -> tuple[Membership, list[RankState]]:
    """Long-polls the registry until `predicate(rank_info)`; returns the states seen."""
    seen: list[RankState] = []
    membership = cluster.membership()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = membership.ranks[rank]
        if not seen or seen[-1] != info.state:
            seen.append(info.state)
        if predicate(info):
            return membership, seen
        membership = ray.get(
            cluster.registry.wait_for_change.remote(membership.epoch, 2.0, None, None)
        )
    raise AssertionError(f"rank {rank} never got there; states seen: {seen}")


def _health_once_alive(cluster: ClusterHandle, rank: int) -> dict[str, Any]:
    # The rank registers from inside its constructor, so Ray may still call the actor
    # "restarting" for a moment after the registry shows it READY.
    deadline = time.monotonic() + 30
    while True:
        try:
            health: dict[str, Any] = ray.get(cluster.engine(rank).health.remote())
            return health
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_killed_engine_is_restarted_by_ray_and_serves_again(cluster: ClusterHandle) -> None:
    before = cluster.membership()
    old = before.ranks[0]
    assert old.endpoint is not None
    old_pid = ray.get(cluster.engine(0).health.remote())["pid"]

    ray.kill(cluster.engine(0), no_restart=False)
    after, seen = _wait_for_rank(
        cluster,
        0,
        lambda info: info.state == RankState.READY and info.incarnation == old.incarnation + 1,
        timeout_s=60,
    )
    # DEAD shows in between unless Ray restarts the actor before its death reaches the
    # registry; either way the rank comes back READY under a new identity.
    assert set(seen) <= {RankState.READY, RankState.DEAD}, seen
    new = after.ranks[0]
    assert new.endpoint is not None
    assert new.endpoint.identity != old.endpoint.identity
    assert after.epoch > before.epoch
    assert after.ranks[1] == before.ranks[1]  # the other rank was not disturbed

    health = _health_once_alive(cluster, 0)
    assert health["incarnation"] == new.incarnation and health["pid"] != old_pid
    # The registry watches the new incarnation too, without mistaking its start for a death.
    time.sleep(1.0)
    assert cluster.membership().ranks[0] == new
    assert len(_generate(cluster, new.endpoint, "after-restart")) == 4


def test_shutdown_leaves_no_actor_and_no_placement_group(cluster: ClusterHandle) -> None:
    assert len(_live_shoal_actors()) == 5  # registry, coordinator, owner, two ranks
    cluster.shutdown()
    assert _live_shoal_actors() == []
    assert live_placement_group_names(cluster.namespace) == []
    with pytest.raises(ClusterNotFoundError):
        attach(cluster.namespace)
    cluster.shutdown()  # a second shutdown is harmless


def test_a_failed_launch_leaves_nothing_behind(ray_local: str, tmp_path: Path) -> None:
    config = EngineConfig.from_kwargs(str(tmp_path / "missing"), data_parallel_size=2)
    namespace = unique_namespace("broken")
    # Both ranks fail the same way; the launch reports whichever failed first.
    message = r"^rank [01] failed to start: ModelLoadError: .*missing: no such file or directory$"
    with pytest.raises(EngineStartError, match=message) as raised:
        options = LaunchOptions(CPU_RANK, host="127.0.0.1", ready_timeout_s=60)
        launch(config, options, namespace=namespace)
    assert isinstance(raised.value.__cause__, ray.exceptions.RayActorError)  # the traceback
    assert _live_shoal_actors() == []
    assert live_placement_group_names(namespace) == []


def test_ranks_that_find_no_room_time_out_by_name_and_leave_nothing_behind(
    ray_local: str, checkpoint: str
) -> None:
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=1, **ENGINE_KWARGS)
    namespace = unique_namespace("no-room")
    message = r"ranks \[0\] found no node with room for \{'CPU': 1000\} each within 3 s"
    with pytest.raises(ray.exceptions.GetTimeoutError, match=message):
        options = LaunchOptions(RankResources(num_cpus=1000), host="127.0.0.1", ready_timeout_s=3)
        launch(config, options, namespace=namespace)
    assert _live_shoal_actors() == []
    assert live_placement_group_names(namespace) == []
