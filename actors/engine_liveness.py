"""How the registry knows an engine actor is alive: a watch for deaths, a probe for hangs.

Two questions, two answers:
- *Has this incarnation died?* `watch_engine` keeps one call to the actor pending
  (`ENGINE_WATCH_METHOD`); Ray fails it the moment the actor dies. Each call ends by itself
  after `WATCH_ROUND_S` and the watch makes the next, and the calls run in a concurrency
  group of their own (`ENGINE_WATCH_GROUP`): a registry that dies cannot cancel its pending
  call, which would otherwise hold one of the engine's control threads for good, and after a
  few registry restarts the engine would answer no control call at all.
- *Is it still answering?* A process can be alive and useless: stopped, swapped out, stuck in
  a kernel. Clients notice first (their connection's heartbeats stop) and say so to the
  registry, which does not take one client's word for it, since the fault may be that client's
  own connection. `probe_engine` asks the actor itself through Ray, with a deadline.

Both speak only to the actor's control methods, which answer while the engine computes (the
actor is threaded), so a busy engine is never mistaken for a hung one. `RankLiveness` is the
registry's part that asks them and marks a rank DEAD in its `MembershipTable`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import ray

from shoal.actors.membership_table import MembershipTable

if TYPE_CHECKING:
    from shoal.actors.engine_actor import EngineActorHandle

# Method every engine actor offers for liveness: `wait_for_exit(timeout_s)` blocks until the
# engine stops on purpose or `timeout_s` passes, and returns (the incarnation's identity, whether
# it stopped); it fails (RayActorError) if the actor dies. It runs in the actor's concurrency
# group `ENGINE_WATCH_GROUP`. Engines also offer `ready() -> EngineEndpoint` and
# `health() -> dict` with at least the "identity" it registered.
ENGINE_WATCH_METHOD = "wait_for_exit"
ENGINE_WATCH_GROUP = "liveness-watch"
# Watch calls that may run at once: the current registry's, and those of incarnations that died
# in the last round (they end within `WATCH_ROUND_S`); more wait in the group's queue.
ENGINE_WATCH_GROUP_THREADS = 2
# How long one watch call stays pending before the watch makes the next.
WATCH_ROUND_S = 10.0
# An engine actor that does not answer `health` within this long counts as hung.
ENGINE_PROBE_TIMEOUT_S = 5.0
# A restarted registry's look at each rank it read back: long, as a restart comes with a loaded
# or failing cluster, and a healthy rank that answers late must not be taken for a lost one.
RECHECK_PROBE_TIMEOUT_S = 30.0
_UNAVAILABLE_RETRY_S = 0.2

logger = logging.getLogger(__name__)


class Liveness(enum.Enum):
    ALIVE = "alive"  # answered as the incarnation asked about
    REPLACED = "replaced"  # answered, as a newer incarnation
    HUNG = "hung"  # did not answer in time
    GONE = "gone"  # the actor is dead or was never there


def find_actor(actor_name: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(actor_name, namespace=namespace)
    except ValueError:
        return None


def find_engine(actor_name: str, namespace: str) -> EngineActorHandle | None:
    """An engine actor by name, typed (None if there is none)."""
    engine: EngineActorHandle | None = find_actor(actor_name, namespace)
    return engine


async def watch_engine(
    actor: EngineActorHandle, identity: bytes, is_current: Callable[[], bool]
) -> bool:
    """Waits until the incarnation registered as `identity` dies.

    The engine registers from inside its constructor, so Ray may still call the actor
    restarting (calls fail with ActorUnavailableError) until the constructor returns: first
    wait for `ready()` to answer with this identity, then keep one watch call pending, round
    after round. A round answered by another identity means the watched one died between two
    rounds and Ray restarted the actor.

    Args:
        actor: the rank's actor handle.
        identity: the incarnation to watch.
        is_current: whether `identity` is still the rank's registered incarnation.

    Returns:
        True when that incarnation died; False when there is nothing to watch (a newer one
        took its place, or it stopped on purpose).
    """
    try:
        while True:
            try:
                endpoint = await actor.ready.remote()
                break
            except ray.exceptions.ActorUnavailableError:
                if not is_current():
                    return False  # a newer incarnation has registered and is watched
                await asyncio.sleep(_UNAVAILABLE_RETRY_S)
        if endpoint.identity != identity:
            return False
        while True:
            answered, stopped = await getattr(actor, ENGINE_WATCH_METHOD).remote(WATCH_ROUND_S)
            if answered != identity:
                return True
            if stopped:
                return False
    except asyncio.CancelledError:
        raise
    except Exception:  # RayActorError and kin: this incarnation is gone
        return True


async def probe_engine(
    actor: EngineActorHandle | None, identity: bytes, timeout_s: float = ENGINE_PROBE_TIMEOUT_S
) -> Liveness:
    """Asks an engine actor for its health, waiting at most `timeout_s`."""
    if actor is None:
        return Liveness.GONE
    try:
        health = await asyncio.wait_for(actor.health.remote(), timeout_s)
    except TimeoutError:
        return Liveness.HUNG
    except ray.exceptions.ActorUnavailableError:
        return Liveness.REPLACED  # restarting: whatever comes up is a new incarnation
    except ray.exceptions.RayActorError:
        return Liveness.GONE
    return Liveness.ALIVE if health["identity"].encode() == identity else Liveness.REPLACED


def restart_engine(actor: EngineActorHandle) -> None:
    """Kills a hung engine actor so that Ray starts it again (it then registers anew)."""
    ray.kill(cast("ray.actor.ActorHandle[Any]", actor), no_restart=False)


class RankLiveness:
    """One watch per registered incarnation, and one shared probe per incarnation a client
    reports lost; what they learn is marked in the table.

    Args:
        namespace: where the engine actors are looked up by name.
        table: the membership, whose ranks turn DEAD here.
        probe_timeout_s: an engine reported lost that does not answer a health probe within
            this long is restarted.
    """

    def __init__(
        self,
        namespace: str,
        table: MembershipTable,
        probe_timeout_s: float = ENGINE_PROBE_TIMEOUT_S,
    ) -> None:
        self._namespace = namespace
        self._table = table
        self._probe_timeout_s = probe_timeout_s
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._probes: dict[bytes, asyncio.Task[bool]] = {}
        self._rechecks: set[asyncio.Task[bool]] = set()

    def watch(self, rank: int, actor_name: str, identity: bytes) -> None:
        """Watches the incarnation `identity` of `rank` (instead of any earlier one)."""
        self.unwatch(rank)
        self._watchers[rank] = asyncio.get_running_loop().create_task(
            self._watch(rank, actor_name, identity)
        )

    def unwatch(self, rank: int) -> None:
        watcher = self._watchers.pop(rank, None)
        if watcher is not None:
            watcher.cancel()

    def recheck(self, rank: int, identity: bytes) -> None:
        """Probes `identity` once, in the background, as if a client had reported it lost.

        For a registry that Ray restarted: an engine that died while no registry watched (a
        lost node takes both) would otherwise stay serving in the table it read back, and its
        watch would wait for an actor that may never be placed again.
        """
        recheck = asyncio.get_running_loop().create_task(
            self.report_lost(rank, identity, RECHECK_PROBE_TIMEOUT_S)
        )
        self._rechecks.add(recheck)
        recheck.add_done_callback(self._rechecks.discard)

    async def report_lost(self, rank: int, identity: bytes, timeout_s: float | None = None) -> bool:
        """A client lost `identity` (see `RegistryActor.report_engine_lost`). Returns whether
        that incarnation keeps serving; concurrent reports about it share one probe, which
        waits `timeout_s` for an answer (default: the registry's probe timeout)."""
        if not self._table.is_serving(rank, identity):
            return False
        probe = self._probes.get(identity)
        if probe is None:
            probe = asyncio.get_running_loop().create_task(
                self._probe(rank, identity, timeout_s or self._probe_timeout_s)
            )
            self._probes[identity] = probe
            probe.add_done_callback(lambda _: self._probes.pop(identity, None))
        return await asyncio.shield(probe)

    async def _watch(self, rank: int, actor_name: str, identity: bytes) -> None:
        actor = find_engine(actor_name, self._namespace)
        if actor is None:
            logger.warning("rank %d: no actor %r to watch; liveness unknown", rank, actor_name)
            return
        if await watch_engine(actor, identity, lambda: self._table.is_current(rank, identity)):
            logger.warning("rank %d: engine actor died", rank)
            self._table.mark_dead(rank, identity)

    async def _probe(self, rank: int, identity: bytes, timeout_s: float) -> bool:
        actor = find_engine(self._table.rank(rank).actor_name, self._namespace)
        liveness = await probe_engine(actor, identity, timeout_s)
        if liveness == Liveness.ALIVE:
            logger.info("rank %d was reported lost by a client but answers; kept", rank)
            return True
        if liveness == Liveness.HUNG and actor is not None:  # HUNG: it was there to probe
            logger.warning(
                "rank %d was reported lost and did not answer a health probe in %.0f s; "
                "restarting it",
                rank,
                timeout_s,
            )
            restart_engine(actor)
        self._table.mark_dead(rank, identity)
        return False
