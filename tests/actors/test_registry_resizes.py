"""The registry's side of resizes, in a real local Ray: the scale lock and its lease, what a
rank started by a resize is told, the commit, and the scale history."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from shoal.actors.membership import RankState
from shoal.actors.membership_table import MembershipTable, TableState
from shoal.actors.registry import RegistryActor
from shoal.actors.registry_resizes import Resizes
from shoal.actors.scale_state import SCALE_LEASE_S, ResizeState, ScaleInProgressError
from shoal.engine.config import EngineConfig
from shoal.engine.parallel.elastic import ScalePlan
from shoal.engine.protocol import EngineEndpoint
from tests.ray_utils import unique_namespace

CONFIG = EngineConfig.from_kwargs("/models/none", data_parallel_size=2, enable_expert_parallel=True)


@pytest.fixture
def registry(ray_local: str) -> Iterator[Any]:
    namespace = unique_namespace("resizes")
    actor: Any = (
        ray.remote(RegistryActor)
        .options(name="shoal-registry", namespace=namespace, num_cpus=0)
        .remote(namespace, CONFIG)
    )
    for rank in (0, 1):
        ray.get(actor.plan_rank.remote(rank, f"engine-{rank}", f"pg-{rank}", b""))
        ray.get(actor.register_engine.remote(_endpoint(rank), "127.0.0.1", b"", []))
    yield actor
    ray.kill(actor)


def _endpoint(rank: int) -> EngineEndpoint:
    return EngineEndpoint(rank, f"{rank}:x".encode(), f"tcp://127.0.0.1:{6000 + rank}")


def test_one_scale_holds_the_lock_and_a_second_is_refused(registry: Any) -> None:
    epoch, from_size = ray.get(registry.begin_scale.remote("driver a", 3))
    assert from_size == 2
    with pytest.raises(ScaleInProgressError, match="by driver a"):
        ray.get(registry.begin_scale.remote("driver b", 4))
    status = ray.get(registry.status.remote())
    assert status["scaling"]["target_size"] == 3 and status["scaling"]["phase"] == "starting"
    assert ray.get(registry.renew_scale.remote(epoch))
    ray.get(registry.end_scale.remote(epoch, "rolled_back", "a test"))
    assert not ray.get(registry.renew_scale.remote(epoch)), "the lock is gone"
    status = ray.get(registry.status.remote())
    assert status["scaling"] is None
    assert status["scale_history"][-1]["outcome"] == "rolled_back"
    next_epoch, _ = ray.get(registry.begin_scale.remote("driver b", 4))
    assert next_epoch == epoch + 1


def test_a_rank_started_by_a_resize_joins_the_new_set_and_serves_once_it_commits(
    registry: Any,
) -> None:
    epoch, _ = ray.get(registry.begin_scale.remote("driver", 3))
    plan = ScalePlan(epoch, 3, "ns/resize-1", expert_to_rank=(0, 0, 0, 1, 1, 1, 2, 2))
    ray.get(registry.set_scale_phase.remote(epoch, "starting", plan, [2]))
    ray.get(registry.plan_rank.remote(2, "engine-2", "pg-2", b""))
    start = ray.get(registry.engine_start.remote(2))
    assert start.joining == plan and start.group_name == "ns/resize-1"
    assert start.config.parallel.data_parallel_size == 3
    old = ray.get(registry.engine_start.remote(0))  # a restarted old rank: the old set
    assert old.joining is None and old.config.parallel.data_parallel_size == 2
    ray.get(registry.register_engine.remote(_endpoint(2), "127.0.0.1", b"", []))
    membership = ray.get(registry.membership.remote())
    assert membership.ranks[2].state == RankState.JOINING
    assert [e.engine_index for e in membership.routable_endpoints()] == [0, 1]
    ray.get(registry.commit_scale.remote(epoch))
    membership = ray.get(registry.membership.remote())
    assert membership.ranks[2].state == RankState.READY
    assert membership.config.parallel.data_parallel_size == 3
    restarted = ray.get(registry.engine_start.remote(2))  # after the commit: no longer joining
    assert restarted.joining is None and restarted.group_name == "ns/resize-1"
    status = ray.get(registry.status.remote())
    assert status["expert_parallel"]["experts_per_rank"] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_a_lock_whose_lease_ran_out_is_taken_over_and_its_holder_can_no_longer_act() -> None:
    """The lease on its own (no Ray): a driver that died stops renewing, and the next takes
    the lock once the lease has run out, not before."""
    table = MembershipTable(TableState(config=CONFIG), lambda: None)
    state = ResizeState()
    resizes = Resizes(state, table, "ns")
    dead_epoch, _ = resizes.begin("dead driver", 3)
    with pytest.raises(ScaleInProgressError, match="by dead driver"):
        resizes.begin("next driver", 4)
    assert state.scale is not None
    state.scale.renewed_at -= SCALE_LEASE_S + 1  # nobody renewed it for a whole lease
    epoch, from_size = resizes.begin("next driver", 4)
    assert (epoch, from_size) == (dead_epoch + 1, 2)
    assert not resizes.renew(dead_epoch)
    with pytest.raises(ScaleInProgressError, match=f"resize {dead_epoch} does not hold"):
        resizes.set_phase(dead_epoch, "switching", None, None)
    assert resizes.end(dead_epoch, "committed", "") == table.epoch  # changes nothing
    assert resizes.history() == []
