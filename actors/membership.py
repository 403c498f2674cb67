"""The cluster's membership as the registry hands it out: ranks, their state, clients.

Plain frozen dataclasses, so drivers, engines and the CLI can read a `Membership` without
knowing anything of the actor that keeps it (`actors/registry.py`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass, field

from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.protocol import EngineEndpoint


class RankState(enum.StrEnum):
    """Life of one rank. STARTING → [JOINING →] READY → (DEAD → READY)* → LEAVING → removed;
    a drain (`shoal.cluster.drain`): READY → LEAVING → DRAINED → (its next incarnation) READY."""

    STARTING = "starting"  # actor created, engine not yet bound
    JOINING = "joining"  # started by an expert-parallel resize; serves once it commits
    READY = "ready"  # endpoint registered, serving
    DEAD = "dead"  # actor died; Ray may restart it, then it registers again
    LEAVING = "leaving"  # elastic scale-down or a drain: clients stop routing to it
    DRAINED = "drained"  # drained: holds and takes nothing until its next incarnation serves


@dataclass(frozen=True)
class RankWorker:
    """One worker process of a rank's incarnation, as its engine actor registered it: one per
    device (a tensor-parallel rank has several, all on the actor's node).

    Attributes:
        tp_rank: its rank in the rank's TP group (0: the driver, in the actor's own process).
        pid: its process on `node_ip`.
        device: its device, as the worker saw it ("cpu", "cuda:1 (GPU 5)").
        node_ip: its node's address.
        node_id: its node's Ray id.
        engine: the engine it runs: "shoal" or "vllm" (`shoal.engine.core.rank_engine`).
    """

    tp_rank: int
    pid: int
    device: str
    node_ip: str
    node_id: str
    engine: str = "shoal"


@dataclass(frozen=True)
class RankInfo:
    """One rank as the registry sees it.

    `incarnation` counts registrations: it bumps every time the rank's actor (re)starts and
    registers, so a client can tell a restarted rank from the one it knew.
    """

    rank: int
    state: RankState
    actor_name: str
    placement_group_name: str
    incarnation: int = 0
    endpoint: EngineEndpoint | None = None
    node_ip: str = ""
    changed_at: float = 0.0
    # The digest of the token its engine actor registers with (`registration_token`): a
    # registration without that token is refused. Empty: the rank was planned without one.
    registration_digest: bytes = b""
    # The registered incarnation's workers, TP rank order (none while it is not serving).
    workers: tuple[RankWorker, ...] = ()

    @property
    def is_routable(self) -> bool:
        return self.state == RankState.READY and self.endpoint is not None

    def admits_registration(self, token: bytes) -> bool:
        """Whether `token` is the one this rank's own actor registers with."""
        if not self.registration_digest:
            return True
        return hmac.compare_digest(registration_digest(token), self.registration_digest)


def registration_token(rank_keys: CurveKeyPair) -> bytes:
    """The token a rank's engine actor registers with: derived from its CURVE secret, which
    only the launcher and that actor (through its constructor's arguments) hold, so an actor
    the cluster did not start cannot register as the rank, and a restarted one still can."""
    return hashlib.blake2b(rank_keys.secret, person=b"shoal-register").digest()


def registration_digest(token: bytes) -> bytes:
    """What the registry keeps of a registration token (the membership is read by every
    client, so it never holds the token itself)."""
    return hashlib.sha256(token).digest()


@dataclass(frozen=True)
class ClientInfo:
    """An attached client (driver script, HTTP server) and when it was last heard from."""

    client_index: int
    name: str
    attached_at: float
    last_seen: float


@dataclass(frozen=True)
class Membership:
    """A consistent view of the cluster at one epoch (every change bumps the epoch)."""

    epoch: int
    ranks: dict[int, RankInfo]
    config: EngineConfig
    stats_publish_address: str | None = None  # coordinator XPUB that clients subscribe to
    stats_report_address: str | None = None  # coordinator PULL that engines push to
    stopping: bool = False
    # CURVE public keys (Z85), handed out here and never on the data plane: the coordinator's
    # (server of its PULL and XPUB), and every attached client's, by client index.
    coordinator_public_key: bytes | None = None
    client_keys: dict[int, bytes] = field(default_factory=dict)

    def routable_endpoints(self) -> list[EngineEndpoint]:
        """Endpoints of the READY ranks, by rank."""
        ranks = sorted(self.ranks.values(), key=lambda r: r.rank)
        return [r.endpoint for r in ranks if r.is_routable and r.endpoint is not None]
