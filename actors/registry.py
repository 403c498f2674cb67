"""`RegistryActor`: the cluster's source of truth for membership, endpoints, epochs and clients.

One named actor per namespace, composed of parts that each own their state:

- `MembershipTable` (`actors/membership_table.py`): ranks, clients, the coordinator's
  addresses, and the epoch every change bumps (clients long-poll `wait_for_change` on it);
- `Resizes` (`actors/registry_resizes.py`): the scale lock, each resize's phase and commit,
  what a starting rank is told, the expert-parallel rendezvous store;
- `RankLiveness` (`actors/engine_liveness.py`): a watch on each registered engine actor (its
  rank turns DEAD the moment it dies) and a probe of an engine a client reports lost (one that
  hangs is restarted);
- `DataPlane` (`actors/data_plane.py`): keys and addresses told to the engines and the
  coordinator.

The actor holds them and answers Ray: every remote method is one call into a part (or two).
Control plane only: nothing here is on the per-request path, and it knows nothing of placement
groups.

Restarts: every change is written to the GCS key-value store (`StateStore`), and a registry
that Ray restarts reads it back: ranks, endpoints, clients, the next client index and the
resizes' record survive, the epoch moves on so every long-poller sees a change, and each
registered engine is watched again and probed once (it may have died while no registry
watched: a lost node takes both).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Coroutine
from typing import Any, TypeAlias

import ray
from ray.actor import ActorProxy

from shoal.actors.data_plane import DataPlane
from shoal.actors.engine_liveness import ENGINE_PROBE_TIMEOUT_S, RankLiveness
from shoal.actors.membership import ClientInfo, Membership, RankInfo, RankState, RankWorker
from shoal.actors.membership_table import CLIENT_TIMEOUT_S, MembershipTable
from shoal.actors.registry_resizes import Resizes
from shoal.actors.registry_state import RegistryState, StateStore
from shoal.actors.scale_state import AutoscalerRecord, EngineStart, ScaleEvent
from shoal.actors.start_reports import StartReports
from shoal.engine.config import EngineConfig
from shoal.engine.parallel.elastic import ScalePlan
from shoal.engine.protocol import EngineEndpoint

logger = logging.getLogger(__name__)


class RegistryActor:
    """Async Ray actor: all methods run on one event loop, so its parts need no locks.

    Args:
        namespace: the Ray namespace the cluster lives in (engine actors are looked up there).
        config: the engine configuration every rank is built from.
        detached: whether the cluster outlives the driver that launched it.
        client_timeout_s: a client silent for this long is pruned.
        engine_probe_timeout_s: an engine reported lost that does not answer a health probe
            within this long is restarted.
    """

    def __init__(
        self,
        namespace: str,
        config: EngineConfig,
        detached: bool = False,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
        engine_probe_timeout_s: float = ENGINE_PROBE_TIMEOUT_S,
    ) -> None:
        self.namespace = namespace
        self.detached = detached
        store = StateStore(namespace)
        state = self._restore(store) or RegistryState.new(config)
        self._table = MembershipTable(
            state.membership, functools.partial(store.save, state), client_timeout_s
        )
        self._resizes = Resizes(state.resizes, self._table, namespace)
        self._liveness = RankLiveness(namespace, self._table, engine_probe_timeout_s)
        self._data_plane = DataPlane(namespace)
        self._background: set[asyncio.Task[None]] = set()
        self._start_reports = StartReports()
        for info in self._table.serving_ranks():
            assert info.endpoint is not None, "a serving rank has registered"
            self._liveness.watch(info.rank, info.actor_name, info.endpoint.identity)
            self._liveness.recheck(info.rank, info.endpoint.identity)
        self._table.save()

    # --- membership ------------------------------------------------------------------------

    @ray.method
    async def plan_rank(
        self,
        rank: int,
        actor_name: str,
        placement_group_name: str,
        registration_digest: bytes,
    ) -> int:
        """Records a rank the cluster is creating (state STARTING); only the actor holding
        the token of `registration_digest` (`membership.registration_token`) may register it.

        Returns:
            The new epoch.
        """
        names = (actor_name, placement_group_name)
        self._start_reports.forget(rank)
        self._table.set_rank(
            RankInfo(rank, RankState.STARTING, *names, registration_digest=registration_digest)
        )
        return self._table.bump()

    @ray.method
    async def register_engine(
        self,
        endpoint: EngineEndpoint,
        node_ip: str,
        registration_token: bytes,
        workers: list[RankWorker],
    ) -> int:
        """Called by an engine actor once its sockets are bound (again after every restart),
        with its worker processes (`shoal status` shows them).

        The rank becomes READY (a LEAVING rank stays LEAVING, and a rank that an
        expert-parallel resize started is JOINING until the resize commits) and its actor is
        watched from now on: when the actor dies, the rank turns DEAD.

        Returns:
            The rank's new incarnation number.

        Raises:
            KeyError: if the rank was never planned (or has been removed).
            PermissionError: the token is not the one the rank's own actor holds (an actor
                the cluster did not start): nothing changes, and the real actor can still
                register.
        """
        rank = endpoint.engine_index
        joining = self._resizes.joins_on_commit(rank)
        incarnation = self._table.register(
            endpoint, node_ip, registration_token, joining=joining, workers=tuple(workers)
        )
        self._liveness.watch(rank, self._table.rank(rank).actor_name, endpoint.identity)
        if endpoint.public_key:  # its stats reports are taken from now on
            await self._data_plane.admit_engine(rank, endpoint.public_key)
        return incarnation

    @ray.method
    async def report_start_progress(self, rank: int, detail: str) -> None:
        """What a rank's actor is doing while it starts (e.g. "loading weights 40% (108 of
        272 tensors, 3.1 s)"), for `shoal status` and the log of the launch waiting on it.
        Kept by `StartReports` until the rank is planned again."""
        if self._table.has_rank(rank):
            self._start_reports.add(rank, detail)

    @ray.method
    async def start_progress(self) -> tuple[bool, dict[int, list[tuple[int, str]]]]:
        """For a launch or resize waiting on its ranks: whether a stop was asked for (`shoal
        stop`), and each rank's start reports as (number, detail), numbered across ranks in
        the order they came."""
        return self._table.snapshot().stopping, self._start_reports.every_rank()

    @ray.method
    async def report_engine_lost(self, rank: int, identity: bytes) -> bool:
        """A client lost its connection to the incarnation `identity` of `rank`.

        One client's word does not take a rank away from every client: the fault may be that
        client's own connection. The registry asks the actor itself (`probe_engine`); an engine
        that answers as `identity` stays READY. One that does not answer in time is hung (a
        stopped process, a stuck kernel): it is marked DEAD and killed, and Ray starts it again
        under a new identity. One whose actor is gone is marked DEAD. Reports about an older
        incarnation, or a rank already DEAD, change nothing; concurrent reports about one
        incarnation share one probe.

        Returns:
            True if the registry keeps that incarnation serving (it answered): the client
            should say HELLO to it again. False: it is gone; the membership says what replaces
            it.
        """
        return await self._liveness.report_lost(rank, identity)

    @ray.method
    async def set_rank_leaving(self, rank: int) -> int:
        """Marks a rank as leaving (clients stop routing to it). Returns the new epoch.

        Raises:
            KeyError: if the rank is unknown.
        """
        return self._table.set_leaving(rank)

    @ray.method
    async def set_rank_drained(self, rank: int) -> int:
        """A rank finished draining (`shoal.cluster.drain`): it holds and takes nothing, and
        its next incarnation to register serves. Returns the new epoch.

        Raises:
            KeyError: if the rank is unknown.
        """
        return self._table.set_drained(rank)

    @ray.method
    async def set_rank_ready(self, rank: int) -> int:
        """A LEAVING rank serves again (its resize was rolled back). Returns the new epoch."""
        return self._table.serve_again(rank)

    @ray.method
    async def remove_rank(self, rank: int) -> int:
        """Forgets a rank (after its actor and placement group are gone). Returns the new epoch."""
        self._liveness.unwatch(rank)
        self._start_reports.forget(rank)
        return self._table.remove_rank(rank)

    @ray.method
    async def set_coordinator(
        self, report_address: str, publish_address: str, public_key: bytes | None
    ) -> int:
        """Records the coordinator's addresses. Returns the new epoch.

        A coordinator that restarted on new addresses is followed: every planned rank's engine
        is told where to push its reports (a rank still starting hears it once its constructor
        is done; one that starts later reads the membership), and clients see the new publish
        address in the membership.
        """
        previous = self._table.set_coordinator(report_address, publish_address, public_key)
        if previous is not None and previous != report_address:
            names = [info.actor_name for info in self._table.ranks()]
            self._in_background(self._data_plane.redirect_stats(names, report_address))
        return self._table.bump()

    @ray.method
    async def membership(self) -> Membership:
        """The current membership (a copy)."""
        return self._table.snapshot()

    @ray.method
    async def wait_for_change(
        self,
        known_epoch: int,
        timeout_s: float,
        client_index: int | None,
        client_name: str | None,
    ) -> Membership:
        """Long-poll: returns as soon as the epoch differs from `known_epoch`, or at the timeout.

        Args:
            known_epoch: the epoch the caller already has.
            timeout_s: the longest the call waits.
            client_index: the caller's index; the call then doubles as its heartbeat. A client
                pruned while it was silent (paused, say) is listed again, as `client_name`:
                its index was never given to anyone else.
            client_name: how to list the caller if it has to be listed again.

        Returns:
            The membership at return time (its epoch equals `known_epoch` on timeout).
        """
        if client_index is not None:
            self._table.heard_from(client_index, client_name)
        return await self._table.wait_for_change(known_epoch, timeout_s)

    # --- clients -----------------------------------------------------------------------------

    @ray.method
    async def attach_client(self, name: str, public_key: bytes | None) -> int:
        """Attaches a client under a new client index, one never used before in this cluster.

        Indices are not reused: an engine's stats report counts each client's requests by
        index, and a report made before a client left could otherwise be read by the next
        holder of its index as counting the newcomer's own requests — hiding the load it
        adds until the engine reports again.

        `public_key` is the client's CURVE key: it is handed to every serving engine and to the
        coordinator before this returns (an engine that starts later reads it from the
        membership), so the client can attach to them at once, as that index and no other.

        Returns:
            The client's index; it goes into every request the client sends.
        """
        index = self._table.attach_client(name, public_key)
        if public_key is not None:
            engines = self._table.serving_engine_names()
            await self._data_plane.admit_client(engines, index, public_key)
        return index

    @ray.method
    async def detach_client(self, client_index: int) -> None:
        """Frees a client index (unknown indices are ignored); its key is revoked everywhere."""
        if self._table.detach_client(client_index):
            engines = self._table.serving_engine_names()
            self._in_background(self._data_plane.revoke_client(engines, client_index))

    @ray.method
    async def clients(self) -> list[ClientInfo]:
        """The attached clients by index (gone clients are pruned first)."""
        return self._table.clients()

    # --- lifecycle ---------------------------------------------------------------------------

    @ray.method
    async def set_served_by(self, server: str | None) -> None:
        """Records the process that serves the cluster and tears it down on `request_stop`."""
        self._table.set_served_by(server)

    @ray.method
    async def request_stop(self) -> int:
        """Asks whoever serves the cluster (e.g. `shoal serve`) to tear it down.

        Returns:
            The new epoch (long-pollers wake with `Membership.stopping` set).
        """
        return self._table.request_stop()

    @ray.method
    async def status(self) -> dict[str, Any]:
        """A plain, JSON-ready summary for `shoal status`."""
        membership = self._table.snapshot()
        return {
            "namespace": self.namespace,
            "epoch": membership.epoch,
            "model": membership.config.model.model,
            "data_parallel_size": membership.config.parallel.data_parallel_size,
            "tensor_parallel_size": membership.config.parallel.tensor_parallel_size,
            "detached": self.detached,
            "served_by": self._table.served_by,
            "stopping": membership.stopping,
            "stats_publish_address": membership.stats_publish_address,
            "rank_failures": [{"at": at, "rank": r} for at, r in self._table.rank_failures()],
            **self._resizes.status(),
            "ranks": [
                {
                    "rank": r.rank,
                    "state": r.state.value,
                    # The engine its serving incarnation runs ("shoal", "vllm").
                    "engine": r.workers[0].engine if r.workers else None,
                    "incarnation": r.incarnation,
                    "node_ip": r.node_ip,
                    "address": r.endpoint.input_address if r.endpoint else None,
                    "actor_name": r.actor_name,
                    "placement_group": r.placement_group_name,
                    "progress": self._start_reports.last(r.rank),
                    "workers": [dataclasses.asdict(w) for w in r.workers],
                }
                for r in self._table.ranks()
            ],
            "clients": [
                {
                    "client_index": c.client_index,
                    "name": c.name,
                    "attached_at": c.attached_at,
                    "last_seen": c.last_seen,
                }
                for c in self._table.clients()
            ],
        }

    @ray.method
    async def ping(self) -> bool:
        return True

    # --- resizes (`shoal.cluster.elastic` drives them) ----------------------------------------

    @ray.method
    async def set_launch_options(self, options: dict[str, Any]) -> None:
        """Records how the launch started its ranks (`shoal.cluster.launch.LaunchOptions`)."""
        self._resizes.set_launch_options(options)

    @ray.method
    async def launch_options(self) -> dict[str, Any]:
        """What `set_launch_options` recorded (empty: nothing was)."""
        return self._resizes.launch_options()

    @ray.method
    async def begin_scale(self, owner: str, to_size: int) -> tuple[int, int]:
        """Takes the scale lock for a resize to `to_size` ranks.

        Returns:
            The resize's epoch and the current size.

        Raises:
            ScaleInProgressError: another scale holds the lock (and its lease runs).
        """
        return self._resizes.begin(owner, to_size)

    @ray.method
    async def set_scale_phase(
        self,
        epoch: int,
        phase: str,
        plan: ScalePlan | None,
        new_ranks: list[int] | None,
    ) -> None:
        """Records the phase of the scale holding the lock (which renews its lease).

        Raises:
            ScaleInProgressError: resize `epoch` does not hold the lock.
        """
        self._resizes.set_phase(epoch, phase, plan, new_ranks)

    @ray.method
    async def renew_scale(self, epoch: int) -> bool:
        """Renews the lease of the scale holding the lock; False if it no longer holds it."""
        return self._resizes.renew(epoch)

    @ray.method
    async def commit_scale(self, epoch: int) -> int:
        """The resize is done: the cluster's size and groups are the new set's, its new ranks
        serve. Returns the new epoch."""
        return self._resizes.commit(epoch)

    @ray.method
    async def end_scale(self, epoch: int, outcome: str, detail: str) -> int:
        """Releases the scale lock and records how the scale ended. Returns the new epoch."""
        return self._resizes.end(epoch, outcome, detail)

    @ray.method
    async def abort_scale_groups(self, epoch: int) -> None:
        """Ends every join still waiting for resize `epoch`'s new set (it is rolled back)."""
        self._resizes.abort_groups(epoch)

    @ray.method
    async def engine_start(self, rank: int) -> EngineStart:
        """The configuration and groups a starting rank serves with (see `EngineStart`).

        Raises:
            KeyError: if the rank was never planned (or has been removed).
        """
        return self._resizes.engine_start(rank)

    @ray.method
    async def scale_history(self) -> list[ScaleEvent]:
        """The past resizes, oldest first."""
        return self._resizes.history()

    @ray.method
    async def is_scaling(self) -> bool:
        """Whether a resize holds the scale lock."""
        return self._resizes.is_scaling()

    @ray.method
    async def set_autoscaler(self, record: AutoscalerRecord) -> None:
        """Keeps what the autoscaler shows (`shoal status`, the metrics); saved with the rest."""
        self._resizes.set_autoscaler(record)

    @ray.method
    async def autoscaler(self) -> AutoscalerRecord | None:
        """What `set_autoscaler` kept (None: the cluster has no autoscaler)."""
        return self._resizes.autoscaler()

    @ray.method
    async def ep_rendezvous(self, host: str, rank: int, placement: list[int]) -> tuple[str, int]:
        """Where expert-parallel ranks form their groups: a TCPStore this actor serves.

        Asked by every rank as it starts (again after a restart); the ranks keep their group
        generations in the store (`shoal.engine.parallel.distributed`).

        Args:
            host: the asking rank's bind address: a loopback one keeps the store on loopback,
                any other puts it on this node's address.
            rank: the asking rank.
            placement: its expert -> rank table, recorded for `status` (a joining rank's is
                recorded when its resize commits).

        Returns:
            The store's (host, port).
        """
        return self._resizes.rendezvous(host, rank, placement)

    # --- internals ---------------------------------------------------------------------------

    @staticmethod
    def _restore(store: StateStore) -> RegistryState | None:
        """The state a previous incarnation saved, when Ray restarted this actor."""
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            return None
        state = store.load()
        if state is None:
            logger.warning("registry restarted without saved state; starting empty")
            return None
        logger.warning(
            "registry restarted at epoch %d: %d ranks, %d clients",
            state.membership.epoch,
            len(state.membership.ranks),
            len(state.membership.clients),
        )
        return state

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Runs `work` (a coroutine) without waiting for it; it logs its own failures."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


# What callers hold: Ray's typed proxy, so mypy checks every `.remote` call's method,
# arguments and result against RegistryActor.
RegistryHandle: TypeAlias = ActorProxy[RegistryActor]
