"""`MembershipTable`: the registry's record of ranks, clients and the coordinator, by epoch.

Owns `TableState` (what is saved) and the epoch's change event (what long-pollers wait on).
Every change that a client must see bumps the epoch; every change at all goes through the
`save` hook it is given (the registry writes its whole state to the GCS there). Knows nothing
of Ray, of resizes or of how a rank's liveness is learned: the registry's other parts tell it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shoal.actors.membership import ClientInfo, Membership, RankInfo, RankState, RankWorker
from shoal.engine.config import EngineConfig
from shoal.engine.protocol import EngineEndpoint

logger = logging.getLogger(__name__)

# Rank states whose engine is registered and alive (clients may hold it; the actor is watched).
SERVING_STATES = (RankState.READY, RankState.JOINING, RankState.LEAVING)
# A client that has not long-polled for this long is pruned.
CLIENT_TIMEOUT_S = 30.0
# The rank failures kept for `shoal status` (the latest).
MAX_RANK_FAILURES_KEPT = 64


@dataclass
class TableState:
    """What the table keeps (saved on every change; heartbeats are saved with the next one)."""

    config: EngineConfig
    epoch: int = 0
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    clients: dict[int, ClientInfo] = field(default_factory=dict)
    next_client_index: int = 0
    stats_publish_address: str | None = None
    stats_report_address: str | None = None
    stopping: bool = False
    served_by: str | None = None
    # CURVE public keys: the coordinator's, and each attached client's by index (kept when a
    # silent client is pruned, since its index is never given to anyone else).
    coordinator_public_key: bytes | None = None
    client_keys: dict[int, bytes] = field(default_factory=dict)
    # (unix time, rank) of each rank incarnation found dead, oldest first; the latest kept.
    rank_failures: list[tuple[float, int]] = field(default_factory=list)

    def resume(self, now: float) -> None:
        """After a restart: every client counts as just seen, and the epoch moves on so that
        every long-poller sees a change."""
        self.clients = {i: replace(c, last_seen=now) for i, c in self.clients.items()}
        self.epoch += 1


class MembershipTable:
    """Ranks, clients and the coordinator's addresses, with the epoch that orders their changes.

    Args:
        state: what the table keeps (fresh, or read back after a restart).
        save: writes the registry's state; called after every change.
        client_timeout_s: a client silent for this long is pruned.
    """

    def __init__(
        self,
        state: TableState,
        save: Callable[[], None],
        client_timeout_s: float = CLIENT_TIMEOUT_S,
    ) -> None:
        self._state = state
        self.save = save
        self.client_timeout_s = client_timeout_s
        self._changed = asyncio.Event()

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def config(self) -> EngineConfig:
        return self._state.config

    def bump(self) -> int:
        """Saves, moves the epoch on and wakes every long-poller. Returns the new epoch."""
        self._state.epoch += 1
        self.save()
        # Wake every waiter of this change, then arm a fresh event for the next one.
        self._changed.set()
        self._changed = asyncio.Event()
        return self._state.epoch

    def snapshot(self) -> Membership:
        """The membership as clients get it (a copy)."""
        s = self._state
        return Membership(
            epoch=s.epoch,
            ranks=dict(s.ranks),
            config=s.config,
            stats_publish_address=s.stats_publish_address,
            stats_report_address=s.stats_report_address,
            stopping=s.stopping,
            coordinator_public_key=s.coordinator_public_key,
            client_keys=dict(s.client_keys),
        )

    async def wait_for_change(self, known_epoch: int, timeout_s: float) -> Membership:
        """The membership once the epoch differs from `known_epoch`, or at the timeout."""
        deadline = time.monotonic() + timeout_s
        while self._state.epoch == known_epoch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                break
        return self.snapshot()

    # --- ranks -------------------------------------------------------------------------------

    def rank(self, rank: int) -> RankInfo:
        """Raises KeyError if the rank is unknown."""
        return self._state.ranks[rank]

    def has_rank(self, rank: int) -> bool:
        return rank in self._state.ranks

    def ranks(self) -> list[RankInfo]:
        """Every rank, by rank."""
        return sorted(self._state.ranks.values(), key=lambda r: r.rank)

    def set_rank(self, info: RankInfo) -> None:
        """Records a rank's new facts (the caller bumps)."""
        self._state.ranks[info.rank] = replace(info, changed_at=time.time())

    def remove_rank(self, rank: int) -> int:
        """Forgets a rank. Returns the new epoch."""
        self._state.ranks.pop(rank, None)
        return self.bump()

    def register(
        self,
        endpoint: EngineEndpoint,
        node_ip: str,
        registration_token: bytes,
        *,
        joining: bool,
        workers: tuple[RankWorker, ...] = (),
    ) -> int:
        """An engine bound its sockets: its rank serves (see `RegistryActor.register_engine`).

        Args:
            endpoint: where it serves, as which incarnation.
            node_ip: its node.
            registration_token: the token its actor registers with.
            joining: the rank was started by a resize that has not committed: it turns
                JOINING, not READY.
            workers: its worker processes.

        Returns:
            The rank's new incarnation number.

        Raises:
            KeyError: the rank was never planned (or has been removed).
            PermissionError: the token is not the one the rank's own actor holds.
        """
        rank = endpoint.engine_index
        info = self._state.ranks.get(rank)
        if info is None:
            raise KeyError(f"rank {rank} is not planned")
        if not info.admits_registration(registration_token):
            raise PermissionError(f"rank {rank}: a registration its engine actor did not make")
        state = RankState.READY
        if info.state == RankState.LEAVING:
            state = RankState.LEAVING
        elif joining:
            state = RankState.JOINING
        if info.endpoint is not None and info.state in SERVING_STATES:
            # A new incarnation of a rank still counted serving: the one before it died, and
            # Ray restarted it before its death was seen.
            self._record_failure(rank)
        incarnation = info.incarnation + 1
        self.set_rank(
            replace(
                info,
                state=state,
                incarnation=incarnation,
                endpoint=endpoint,
                node_ip=node_ip,
                workers=workers,
            )
        )
        self.bump()
        return incarnation

    def set_leaving(self, rank: int) -> int:
        """Clients stop routing to `rank`. Returns the new epoch (KeyError: unknown rank)."""
        self.set_rank(replace(self._state.ranks[rank], state=RankState.LEAVING))
        return self.bump()

    def set_drained(self, rank: int) -> int:
        """A drained rank holds and takes nothing; its next incarnation to register serves
        (READY). Returns the new epoch (KeyError: unknown rank)."""
        self.set_rank(replace(self._state.ranks[rank], state=RankState.DRAINED))
        return self.bump()

    def serve_again(self, rank: int) -> int:
        """A LEAVING rank serves again (its resize was rolled back). Returns the new epoch."""
        info = self._state.ranks[rank]
        if info.state == RankState.LEAVING:
            self.set_rank(replace(info, state=RankState.READY))
        return self.bump()

    def mark_dead(self, rank: int, identity: bytes) -> None:
        """Marks a rank DEAD if `identity` is still its serving incarnation."""
        if self.is_serving(rank, identity):
            self.set_rank(replace(self._state.ranks[rank], state=RankState.DEAD, workers=()))
            self._record_failure(rank)
            self.bump()

    def _record_failure(self, rank: int) -> None:
        failures = self._state.rank_failures
        failures.append((time.time(), rank))
        del failures[:-MAX_RANK_FAILURES_KEPT]

    def rank_failures(self) -> list[tuple[float, int]]:
        """(unix time, rank) of the latest rank failures (`mark_dead`), oldest first."""
        return list(self._state.rank_failures)

    def is_serving(self, rank: int, identity: bytes) -> bool:
        """Whether `identity` is the rank's registered incarnation and the rank is not DEAD."""
        return self.is_current(rank, identity) and self._state.ranks[rank].state in SERVING_STATES

    def is_current(self, rank: int, identity: bytes) -> bool:
        """Whether `identity` is the rank's registered incarnation."""
        info = self._state.ranks.get(rank)
        return info is not None and info.endpoint is not None and info.endpoint.identity == identity

    def serving_ranks(self) -> list[RankInfo]:
        """The ranks whose engine is registered and alive."""
        return [r for r in self.ranks() if r.endpoint is not None and r.state in SERVING_STATES]

    def serving_engine_names(self) -> list[str]:
        """The actors of ranks that serve now (a starting or restarting rank reads the keys
        from the membership once it has registered)."""
        return [r.actor_name for r in self._state.ranks.values() if r.state in SERVING_STATES]

    def set_size(self, num_ranks: int) -> None:
        """The cluster's data-parallel size is `num_ranks` from now on (the caller bumps)."""
        config = self._state.config
        self._state.config = replace(
            config, parallel=replace(config.parallel, data_parallel_size=num_ranks)
        )

    # --- the coordinator, the server, stopping -----------------------------------------------

    def set_coordinator(
        self, report_address: str, publish_address: str, public_key: bytes | None
    ) -> str | None:
        """Records the coordinator's addresses (the caller bumps). Returns the report address
        it replaces (None the first time)."""
        s = self._state
        previous = s.stats_report_address
        s.stats_report_address, s.stats_publish_address = report_address, publish_address
        if public_key is not None:
            s.coordinator_public_key = public_key
        return previous

    @property
    def served_by(self) -> str | None:
        return self._state.served_by

    def set_served_by(self, server: str | None) -> None:
        self._state.served_by = server
        self.save()

    def request_stop(self) -> int:
        """Long-pollers wake with `Membership.stopping` set. Returns the new epoch."""
        self._state.stopping = True
        return self.bump()

    # --- clients -----------------------------------------------------------------------------

    def attach_client(self, name: str, public_key: bytes | None) -> int:
        """Lists a client under an index never used before here. Returns the index."""
        self.prune_clients()
        s = self._state
        index = s.next_client_index
        s.next_client_index += 1
        now = time.time()
        s.clients[index] = ClientInfo(index, name, now, now)
        if public_key is not None:
            s.client_keys[index] = public_key
        self.save()
        return index

    def detach_client(self, client_index: int) -> bool:
        """Forgets a client (unknown indices are ignored). Returns whether it had a key."""
        had_key = self._state.client_keys.pop(client_index, None) is not None
        if self._state.clients.pop(client_index, None) is not None or had_key:
            self.save()
        return had_key

    def heard_from(self, client_index: int, name: str | None) -> None:
        """A client polled: it is seen now. One pruned while it was silent (paused, say) is
        listed again as `name`: its index was never given to anyone else."""
        info = self._state.clients.get(client_index)
        if info is not None:
            self._state.clients[client_index] = replace(info, last_seen=time.time())
            return
        if not 0 <= client_index < self._state.next_client_index:
            return  # never handed out here
        name = name or f"client {client_index}"
        logger.info("client %d (%s) was pruned but polls again; listed again", client_index, name)
        now = time.time()
        self._state.clients[client_index] = ClientInfo(client_index, name, now, now)
        self.save()

    def clients(self) -> list[ClientInfo]:
        """The attached clients by index (silent ones are pruned first)."""
        if self.prune_clients():
            self.save()
        return sorted(self._state.clients.values(), key=lambda c: c.client_index)

    def prune_clients(self) -> bool:
        """Drops clients silent past the timeout; True if any went (the caller saves)."""
        cutoff = time.time() - self.client_timeout_s
        silent = [i for i, c in self._state.clients.items() if c.last_seen < cutoff]
        for index in silent:
            logger.info(
                "client %d (%s) went silent; pruned", index, self._state.clients[index].name
            )
            del self._state.clients[index]
        return bool(silent)
