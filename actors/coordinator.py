"""`CoordinatorActor`: gathers every rank's load and publishes the vector to clients.

Protocol (ZMQ, msgspec):
    engine  --PUSH EngineStatsReport-->  PULL  [coordinator]  XPUB  --DPStatsSnapshot-->  SUB  client

The coordinator keeps the latest report per rank. It publishes a snapshot of all of them
(1) at most every 100 ms while any rank's stats change, (2) as a heartbeat once per second
when nothing changes, and (3) at once when a new subscriber joins, so a client that attaches
never waits a second for its first view. A rank's report carries the engine's identity and,
per client, how many of that client's requests the engine had taken in: a client uses the
first to ignore reports of a dead incarnation, the second to tell which of its own sends a
snapshot already includes.

Both sockets are CURVE servers under the coordinator's key pair, made at launch: the PULL takes
reports only from the ranks' keys (admitted before each rank starts, `admit_engine`), the XPUB
serves only attached clients' keys (`admit_client`, from the registry); a forged report or a
stranger's subscription is closed at its handshake (`shoal.engine.core.curve`).

Restarts: Ray restarts a coordinator that dies. The new one binds the addresses its
predecessor published in the registry, so engines' PUSH and clients' SUB sockets reconnect
on their own (ZMQ re-sends a SUB's subscription) and nobody has to be told; engines refill the
latest reports within a heartbeat. If an address cannot be bound again (another node, a taken
port), it binds new ones and records them in the registry, which tells every engine where to
push; clients follow the publish address in the membership.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec
import ray
import zmq
from ray.actor import ActorProxy

from shoal.actors.membership import Membership
from shoal.actors.names import REGISTRY_NAME
from shoal.engine.core.curve import (
    STATS_IN_DOMAIN,
    STATS_OUT_DOMAIN,
    CurveKeyPair,
    KeyRing,
    ZapHandler,
    client_key_name,
    curve_server,
    engine_key_name,
)
from shoal.engine.protocol import DPStatsSnapshot, EngineStatsReport

if TYPE_CHECKING:
    from shoal.actors.registry import RegistryHandle

logger = logging.getLogger(__name__)

MIN_PUBLISH_INTERVAL_S = 0.1
HEARTBEAT_INTERVAL_S = 1.0


class CoordinatorActor:
    """Ray actor running the stats loop on a background thread.

    Args:
        host: address to bind; empty: this node's IP.
        namespace: the cluster's namespace, where a restarted coordinator finds the registry.
        keys: the coordinator's CURVE key pair, made at launch (a restart gets it again):
            both sockets are CURVE servers; the PULL takes reports only from engines whose
            keys the registry admitted (`admit_engine`), the XPUB serves only attached
            clients (`admit_client`). None: open sockets.
    """

    def __init__(
        self, host: str = "", namespace: str | None = None, keys: CurveKeyPair | None = None
    ) -> None:
        host = host or ray.util.get_node_ip_address()
        registry: RegistryHandle | None = None
        previous: tuple[str | None, str | None] = (None, None)
        if namespace is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            found: RegistryHandle = ray.get_actor(REGISTRY_NAME, namespace=namespace)
            membership = _membership_once_up(found)
            registry = found
            previous = (membership.stats_report_address, membership.stats_publish_address)
        self._context = zmq.Context()
        self._engine_keys = KeyRing()
        self._client_keys = KeyRing()
        self._zap: ZapHandler | None = None
        if keys is not None:
            rings = {STATS_IN_DOMAIN: self._engine_keys, STATS_OUT_DOMAIN: self._client_keys}
            self._zap = ZapHandler(self._context, rings, "coordinator")
            self._zap.start()
        if registry is not None:  # the keys the previous incarnation was given
            self._admit_members(membership)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            curve_server(self._pull, keys, STATS_IN_DOMAIN)
        self.report_address = bind_previous_or_new(self._pull, host, previous[0])
        self._xpub = self._context.socket(zmq.XPUB)
        self._xpub.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            curve_server(self._xpub, keys, STATS_OUT_DOMAIN)
        self._xpub.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every subscribe, not only the first
        self.publish_address = bind_previous_or_new(self._xpub, host, previous[1])
        if registry is not None:
            addresses = (self.report_address, self.publish_address)
            logger.warning("coordinator restarted at %s", addresses)
            if addresses != previous:
                ray.get(registry.set_coordinator.remote(*addresses, None))
        self._latest: dict[int, EngineStatsReport] = {}
        self._lock = threading.Lock()
        self._num_published = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal-coordinator", daemon=True)
        self._thread.start()

    @ray.method
    def addresses(self) -> tuple[str, str]:
        """(address engines push reports to, address clients subscribe to)."""
        return self.report_address, self.publish_address

    @ray.method
    def latest_stats(self) -> dict[int, dict[str, Any]]:
        """The latest stats of every rank, as plain dicts (for `shoal status`).

        Returns:
            rank -> the `SchedulerStats` fields plus `timestamp`, the engine's report time,
            and its DP wave (`current_wave`, `is_wave_running`, `num_dummy_steps`).
        """
        with self._lock:
            return {
                rank: {
                    **msgspec.structs.asdict(report.stats),
                    "timestamp": report.timestamp,
                    "current_wave": report.current_wave,
                    "is_wave_running": report.is_wave_running,
                    "num_dummy_steps": report.num_dummy_steps,
                }
                for rank, report in self._latest.items()
            }

    @ray.method
    def admit_engine(self, rank: int, public_key: bytes) -> None:
        """Takes stats reports from the engine holding `public_key` (as `rank`, in place of
        the key the rank had)."""
        self._engine_keys.admit(engine_key_name(rank), public_key)

    @ray.method
    def admit_client(self, client_index: int, public_key: bytes) -> None:
        """Lets the client holding `public_key` subscribe to the snapshots."""
        self._client_keys.admit(client_key_name(client_index), public_key)

    @ray.method
    def revoke_client(self, client_index: int) -> None:
        self._client_keys.revoke(client_key_name(client_index))

    def _admit_members(self, membership: Membership) -> None:
        for info in membership.ranks.values():
            if info.endpoint is not None and info.endpoint.public_key:
                self._engine_keys.admit(engine_key_name(info.rank), info.endpoint.public_key)
        for client_index, public_key in membership.client_keys.items():
            self._client_keys.admit(client_key_name(client_index), public_key)

    @ray.method
    def forget_rank(self, rank: int) -> None:
        """Drops a removed rank's stats so snapshots stop carrying them."""
        with self._lock:
            self._latest.pop(rank, None)

    @ray.method
    def shutdown(self) -> None:
        """Stops the loop and closes the sockets; the actor can then be killed."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            # The actor stays up for `latest_stats` and `shutdown`; clients see the heartbeat
            # stop, which is the signal they act on.
            logger.exception("coordinator loop failed")
        finally:
            self._pull.close()
            self._xpub.close()
            if self._zap is not None:
                self._zap.stop()
                self._zap.join(timeout=2)
            self._context.term()

    def _loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineStatsReport)
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        last_publish, is_changed, has_new_subscriber = 0.0, False, False
        while not self._stop.is_set():
            interval = MIN_PUBLISH_INTERVAL_S if is_changed else HEARTBEAT_INTERVAL_S
            wait_s = max(0.0, last_publish + interval - time.monotonic())
            # Wake at least every 0.5 s so that `shutdown` is noticed.
            events = dict(poller.poll(timeout=int(min(wait_s, 0.5) * 1000)))
            if self._pull in events:
                is_changed |= self._drain_reports(decoder)
            if self._xpub in events:
                has_new_subscriber |= self._drain_subscriptions()
            now = time.monotonic()
            interval = MIN_PUBLISH_INTERVAL_S if is_changed else HEARTBEAT_INTERVAL_S
            if has_new_subscriber or now - last_publish >= interval:
                self._publish(encoder)
                last_publish, is_changed, has_new_subscriber = now, False, False

    def _publish(self, encoder: msgspec.msgpack.Encoder) -> None:
        with self._lock:
            reports = [self._latest[rank] for rank in sorted(self._latest)]
        self._num_published += 1
        # DP waves (expert-parallel clusters): the wave is the highest any rank reports; the
        # ranks run while any of them steps in it.
        snapshot = DPStatsSnapshot(
            seq=self._num_published,
            reports=reports,
            current_wave=max((r.current_wave for r in reports), default=0),
            engines_running=any(r.is_wave_running for r in reports),
        )
        self._xpub.send(encoder.encode(snapshot))

    def _drain_reports(self, decoder: msgspec.msgpack.Decoder[EngineStatsReport]) -> bool:
        is_changed = False
        for frames in _queued_messages(self._pull):
            try:
                if len(frames) != 1:
                    raise msgspec.DecodeError(f"expected 1 frame, got {len(frames)}")
                report = decoder.decode(frames[0])
                if report.engine_index < 0:
                    raise msgspec.DecodeError(f"negative engine_index {report.engine_index}")
            except msgspec.DecodeError as e:
                logger.warning("dropping a malformed stats report: %s", e)
                continue
            with self._lock:
                previous = self._latest.get(report.engine_index)
                is_changed |= previous is None or _load_of(previous) != _load_of(report)
                self._latest[report.engine_index] = report
        return is_changed

    def _drain_subscriptions(self) -> bool:
        has_joined = False
        for frames in _queued_messages(self._xpub):
            # XPUB delivers b"\x01<topic>" on subscribe and b"\x00<topic>" on unsubscribe.
            has_joined |= frames[0][:1] == b"\x01"
        return has_joined


# What callers hold: Ray's typed proxy, so mypy checks every `.remote` call's method,
# arguments and result against CoordinatorActor.
CoordinatorHandle: TypeAlias = ActorProxy[CoordinatorActor]


def bind_previous_or_new(socket: zmq.Socket, host: str, previous: str | None) -> str:
    """Binds `previous` if given and possible, else a new port on `host`; returns the address."""
    if previous is not None:
        try:
            socket.bind(previous)
            return previous
        except zmq.ZMQError as e:
            logger.warning("cannot bind %s again (%s); binding a new port", previous, e)
    return f"tcp://{host}:{socket.bind_to_random_port(f'tcp://{host}')}"


def _queued_messages(socket: zmq.Socket) -> Iterator[list[bytes]]:
    """Every message already queued on `socket`, without waiting for more."""
    while True:
        try:
            yield socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


def _load_of(report: EngineStatsReport) -> tuple[object, ...]:
    """What a change of is published quickly: the load, and the DP wave."""
    return report.stats, report.current_wave, report.is_wave_running


# How long a restarted coordinator waits for the registry (a lost node restarts both at once).
REGISTRY_WAIT_S = 120.0


def _membership_once_up(registry: RegistryHandle) -> Membership:
    """The registry's membership, asked again while the registry itself is restarting.

    Raises:
        RayActorError: the registry did not answer within REGISTRY_WAIT_S.
    """
    deadline = time.monotonic() + REGISTRY_WAIT_S
    while True:
        try:
            return ray.get(registry.membership.remote())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
