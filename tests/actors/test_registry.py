"""RegistryActor in a real local Ray: membership, epochs, long-poll, clients, lock, liveness."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from shoal.actors.engine_actor import (
    ENGINE_ACTOR_CONCURRENCY_GROUPS,
    ENGINE_ACTOR_MAX_CONCURRENCY,
)
from shoal.actors.engine_liveness import ENGINE_WATCH_GROUP, ENGINE_WATCH_METHOD
from shoal.actors.membership import RankState, registration_digest, registration_token
from shoal.actors.registry import RegistryActor
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.protocol import EngineEndpoint
from tests.ray_utils import unique_namespace

CONFIG = EngineConfig.from_kwargs("/models/none", data_parallel_size=2)


@pytest.fixture
def namespace(ray_local: str) -> str:
    return unique_namespace("registry")


@pytest.fixture
def registry(namespace: str) -> Iterator[Any]:
    actor: Any = (
        ray.remote(RegistryActor)
        .options(name="shoal-registry", namespace=namespace, num_cpus=0)
        .remote(namespace, CONFIG, client_timeout_s=1.0, engine_probe_timeout_s=1.0)
    )
    yield actor
    ray.kill(actor)


def _endpoint(rank: int, identity: bytes) -> EngineEndpoint:
    return EngineEndpoint(rank, identity, f"tcp://127.0.0.1:{5000 + rank}")


def test_plan_register_dead_leave_remove_bump_epochs(registry: Any) -> None:
    e0 = ray.get(registry.plan_rank.remote(0, "engine-0", "pg-0", b""))
    e1 = ray.get(registry.plan_rank.remote(1, "engine-1", "pg-1", b""))
    assert e1 == e0 + 1
    m = ray.get(registry.membership.remote())
    assert [m.ranks[r].state for r in (0, 1)] == [RankState.STARTING, RankState.STARTING]
    assert m.routable_endpoints() == []

    assert ray.get(registry.register_engine.remote(_endpoint(1, b"1:a"), "10.0.0.1", b"", [])) == 1
    assert ray.get(registry.register_engine.remote(_endpoint(0, b"0:a"), "10.0.0.1", b"", [])) == 1
    m = ray.get(registry.membership.remote())
    assert m.epoch == e1 + 2
    assert m.ranks[0].state == RankState.READY and m.ranks[0].node_ip == "10.0.0.1"
    assert [e.identity for e in m.routable_endpoints()] == [b"0:a", b"1:a"]

    # A report about an identity the rank no longer has is ignored; the current one counts.
    epoch = ray.get(registry.membership.remote()).epoch
    assert not ray.get(registry.report_engine_lost.remote(0, b"0:old"))
    assert ray.get(registry.membership.remote()).epoch == epoch
    # (No actor answers for "0:a": it counts as gone.)
    assert not ray.get(registry.report_engine_lost.remote(0, b"0:a"))
    assert not ray.get(registry.report_engine_lost.remote(0, b"0:a"))  # already dead
    m = ray.get(registry.membership.remote())
    assert m.epoch == epoch + 1
    assert m.ranks[0].state == RankState.DEAD
    assert [e.identity for e in m.routable_endpoints()] == [b"1:a"]

    # The restarted actor registers again: new identity, next incarnation, READY.
    assert ray.get(registry.register_engine.remote(_endpoint(0, b"0:b"), "10.0.0.2", b"", [])) == 2
    m = ray.get(registry.membership.remote())
    assert m.ranks[0].state == RankState.READY and m.ranks[0].incarnation == 2
    assert m.ranks[0].endpoint == _endpoint(0, b"0:b")

    epoch = ray.get(registry.set_rank_leaving.remote(1))
    m = ray.get(registry.membership.remote())
    assert m.epoch == epoch and m.ranks[1].state == RankState.LEAVING
    assert [e.identity for e in m.routable_endpoints()] == [b"0:b"]
    assert ray.get(registry.remove_rank.remote(1)) == epoch + 1
    assert sorted(ray.get(registry.membership.remote()).ranks) == [0]


def test_register_unplanned_rank_is_refused(registry: Any) -> None:
    with pytest.raises(KeyError, match="rank 7 is not planned"):
        ray.get(registry.register_engine.remote(_endpoint(7, b"7:a"), "10.0.0.1", b"", []))


def test_a_registration_without_the_ranks_token_is_refused_and_the_real_one_still_counts(
    registry: Any,
) -> None:
    keys = CurveKeyPair.generate()
    token = registration_token(keys)
    ray.get(registry.plan_rank.remote(0, "engine-0", "pg-0", registration_digest(token)))
    assert ray.get(registry.register_engine.remote(_endpoint(0, b"0:real"), "10.0.0.1", token, []))
    impostor_token = registration_token(CurveKeyPair.generate())
    for forged in (b"", impostor_token, registration_digest(token)):
        with pytest.raises(PermissionError, match="rank 0"):
            ray.get(registry.register_engine.remote(_endpoint(0, b"0:fake"), "6.6.6.6", forged, []))
    m = ray.get(registry.membership.remote())
    assert [e.identity for e in m.routable_endpoints()] == [b"0:real"]
    # Clients read the membership: it holds the token's digest, never the token.
    assert m.ranks[0].registration_digest == registration_digest(token) != token
    # The real actor (restarted: same keys) registers again.
    assert ray.get(registry.register_engine.remote(_endpoint(0, b"0:again"), "10.0.0.1", token, []))
    m = ray.get(registry.membership.remote())
    assert [e.identity for e in m.routable_endpoints()] == [b"0:again"]


def test_wait_for_change_returns_on_change_and_on_timeout(registry: Any) -> None:
    epoch = ray.get(registry.membership.remote()).epoch

    start = time.monotonic()
    m = ray.get(registry.wait_for_change.remote(epoch, 0.5, None, None))
    assert m.epoch == epoch
    assert 0.45 <= time.monotonic() - start < 3.0

    # A caller behind the current epoch is answered at once.
    start = time.monotonic()
    assert ray.get(registry.wait_for_change.remote(epoch - 1, 30.0, None, None)).epoch == epoch
    assert time.monotonic() - start < 2.0

    start = time.monotonic()
    pending = registry.wait_for_change.remote(epoch, 30.0, None, None)
    time.sleep(0.5)
    ray.get(registry.plan_rank.remote(0, "engine-0", "pg-0", b""))
    m = ray.get(pending, timeout=10)
    assert m.epoch == epoch + 1 and 0 in m.ranks
    assert time.monotonic() - start < 5.0


def test_request_stop_wakes_long_pollers(registry: Any) -> None:
    epoch = ray.get(registry.membership.remote()).epoch
    pollers = [registry.wait_for_change.remote(epoch, 30.0, None, None) for _ in range(3)]
    time.sleep(0.3)
    ray.get(registry.request_stop.remote())
    for membership in ray.get(pollers, timeout=10):
        assert membership.stopping
    assert ray.get(registry.status.remote())["stopping"]


def test_client_indices_are_allocated_freed_pruned_and_never_reused(registry: Any) -> None:
    assert [ray.get(registry.attach_client.remote(f"c{i}", None)) for i in range(3)] == [0, 1, 2]
    ray.get(registry.detach_client.remote(1))
    assert [c.name for c in ray.get(registry.clients.remote())] == ["c0", "c2"]
    assert ray.get(registry.attach_client.remote("c3", None)) == 3  # 1 is free but not reused

    # Only client 2 keeps polling; the others fall silent past the 1 s timeout.
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:
        ray.get(registry.wait_for_change.remote(-1, 0.0, 2, None))
        time.sleep(0.2)
    assert [(c.client_index, c.name) for c in ray.get(registry.clients.remote())] == [(2, "c2")]
    assert ray.get(registry.attach_client.remote("c4", None)) == 4
    status = ray.get(registry.status.remote())
    assert [c["client_index"] for c in status["clients"]] == [2, 4]
    # A pruned client that polls again (it was paused, not gone) is listed again; an index
    # never handed out is not.
    ray.get(registry.wait_for_change.remote(-1, 0.0, 0, "c0 again"))
    ray.get(registry.wait_for_change.remote(-1, 0.0, 99, "stranger"))
    names = [(c.client_index, c.name) for c in ray.get(registry.clients.remote())]
    assert names == [(0, "c0 again"), (2, "c2"), (4, "c4")]


class _WatchedActor:
    """Offers the liveness methods the registry calls on every registered engine."""

    def __init__(self, rank: int) -> None:
        self._exited = threading.Event()
        self._answering = threading.Event()
        self._answering.set()
        self._num_watchers = 0  # watch calls started
        self.rank = rank

    def ready(self) -> EngineEndpoint:
        return _endpoint(self.rank, b"id")

    def health(self) -> dict[str, Any]:
        self._answering.wait()  # a hung engine never answers
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        return {"identity": "id", "restarted": restarted}

    def hang(self) -> None:
        self._answering.clear()

    def exit_cleanly(self) -> None:
        self._exited.set()

    def num_watchers(self) -> int:
        return self._num_watchers

    @ray.method(concurrency_group=ENGINE_WATCH_GROUP)
    def wait_for_exit(self, timeout_s: float) -> tuple[bytes, bool]:
        self._num_watchers += 1
        return b"id", self._exited.wait(timeout_s)


assert hasattr(_WatchedActor, ENGINE_WATCH_METHOD)


def _wait_for_state(registry: Any, rank: int, state: RankState) -> None:
    """Until `rank` is in `state`; a registry that is restarting meanwhile is asked again."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if ray.get(registry.membership.remote()).ranks[rank].state == state:
                return
        except ray.exceptions.RayActorError:  # ray.kill is asynchronous: the restart may follow
            pass
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never became {state}")


def _watched_ranks(registry: Any, namespace: str, max_restarts: int = 0) -> list[Any]:
    """Two ranks served by `_WatchedActor`s, registered as identity b"id"."""
    actors: list[Any] = [
        ray.remote(concurrency_groups=ENGINE_ACTOR_CONCURRENCY_GROUPS)(_WatchedActor)
        .options(
            name=f"watched-{r}",
            namespace=namespace,
            max_concurrency=ENGINE_ACTOR_MAX_CONCURRENCY,
            num_cpus=0,
            max_restarts=max_restarts,
        )
        .remote(r)
        for r in (0, 1)
    ]
    for rank in (0, 1):
        ray.get(registry.plan_rank.remote(rank, f"watched-{rank}", f"pg-{rank}", b""))
        ray.get(registry.register_engine.remote(_endpoint(rank, b"id"), "10.0.0.1", b"", []))
    return actors


def test_a_dead_engine_actor_turns_its_rank_dead(registry: Any, namespace: str) -> None:
    actors = _watched_ranks(registry, namespace)
    epoch = ray.get(registry.membership.remote()).epoch

    ray.kill(actors[0])
    _wait_for_state(registry, 0, RankState.DEAD)
    assert ray.get(registry.membership.remote()).epoch == epoch + 1

    # A clean exit (shutdown) is not a death.
    ray.get(actors[1].exit_cleanly.remote())
    time.sleep(1.0)
    assert ray.get(registry.membership.remote()).ranks[1].state == RankState.READY
    ray.kill(actors[1])


def test_a_reported_engine_is_probed_kept_if_it_answers_and_restarted_if_it_hangs(
    registry: Any, namespace: str
) -> None:
    actors = _watched_ranks(registry, namespace, max_restarts=1)
    epoch = ray.get(registry.membership.remote()).epoch

    # A client lost rank 0, but the engine answers: the client's connection was at fault.
    assert ray.get(registry.report_engine_lost.remote(0, b"id"))
    membership = ray.get(registry.membership.remote())
    assert membership.ranks[0].state == RankState.READY and membership.epoch == epoch

    # Rank 1 hangs. Two clients report it at once; one probe decides for both.
    ray.get(actors[1].hang.remote())
    started = time.monotonic()
    reports = [registry.report_engine_lost.remote(1, b"id") for _ in range(2)]
    assert ray.get(reports) == [False, False]
    assert 0.5 <= time.monotonic() - started < 10  # the probe's deadline, not forever
    membership = ray.get(registry.membership.remote())
    assert membership.ranks[1].state == RankState.DEAD and membership.epoch == epoch + 1
    # ... and its actor was killed for Ray to start again (it would then register anew).
    deadline = time.monotonic() + 30
    while True:
        try:
            assert ray.get(actors[1].health.remote(), timeout=30)["restarted"]
            break
        except ray.exceptions.ActorUnavailableError:  # still starting
            assert time.monotonic() < deadline
            time.sleep(0.2)
    for actor in actors:
        ray.kill(actor)


def test_a_restarted_registry_finds_an_engine_that_died_while_none_watched(
    namespace: str,
) -> None:
    """As when one node held both: the registry's restart reads rank 0 back as READY, but its
    actor died meanwhile; the restarted registry probes it and turns the rank DEAD."""
    registry: Any = (
        ray.remote(RegistryActor)
        .options(name="shoal-registry", namespace=namespace, num_cpus=0, max_restarts=1)
        .remote(namespace, CONFIG, engine_probe_timeout_s=1.0)
    )
    actors = _watched_ranks(registry, namespace)
    try:
        ray.kill(registry, no_restart=False)
        ray.kill(actors[0])
        deadline = time.monotonic() + 30
        while True:  # until the restarted registry answers
            try:
                ray.get(registry.ping.remote(), timeout=5)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() < deadline, "the registry did not restart"
                time.sleep(0.2)
        _wait_for_state(registry, 0, RankState.DEAD)
        assert ray.get(registry.membership.remote()).ranks[1].state == RankState.READY
    finally:
        for actor in (*actors, registry):
            ray.kill(actor)


def test_engines_answer_control_calls_after_many_registry_restarts(namespace: str) -> None:
    """Each registry incarnation watches every engine with a call that stays pending; the
    watch of an incarnation that died must not keep a thread of the engine's, or after a few
    restarts the engine answers no control call (a client's key would never be admitted)."""
    registry: Any = (
        ray.remote(RegistryActor)
        .options(name="shoal-registry", namespace=namespace, num_cpus=0, max_restarts=-1)
        .remote(namespace, CONFIG, engine_probe_timeout_s=5.0)
    )
    actors = _watched_ranks(registry, namespace)
    try:
        _wait_for_watches(actors, 1)
        for restart in range(1, ENGINE_ACTOR_MAX_CONCURRENCY + 2):
            ray.kill(registry, no_restart=False)
            _wait_for_watches(actors, restart + 1)
            assert all(ray.get([a.health.remote() for a in actors], timeout=10))
        assert ray.get(registry.membership.remote()).ranks[0].state == RankState.READY
        ray.kill(actors[0])  # the latest incarnation's watch still sees a death
        _wait_for_state(registry, 0, RankState.DEAD)
    finally:
        for actor in (*actors, registry):
            ray.kill(actor)


def _wait_for_watches(actors: list[Any], count: int) -> None:
    """Until every actor has seen `count` registry incarnations start watching it."""
    deadline = time.monotonic() + 30
    while min(ray.get([a.num_watchers.remote() for a in actors], timeout=10)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} watches started"
        time.sleep(0.1)
