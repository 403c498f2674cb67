"""CURVE keys and the ZAP handler that close shoal's data plane to everyone but the cluster.

Every data-plane socket is set up through `curve_server` or `curve_client` here: an engine's
input ROUTER, a client's output PULL and the coordinator's stats PULL and XPUB are CURVE
servers; the sockets that connect to them are CURVE clients that must know the server's public
key. Each process that owns a server runs one `ZapHandler`, which admits a connection only if
its public key is in the `KeyRing` of that socket's domain, and names the connection by the
key's owner ("client:5", "engine:2"): that name (ZMQ's User-Id on every message) is who the
peer is, whatever its messages say. Keys are made where their secret lives (an engine, a
client, the launcher for the coordinator) and only public keys travel, through the control
plane (the registry, over Ray): never on the data plane.

State machine of one connection to a CURVE server socket:

    TCP accepted ──no CURVE, or the wrong server key──▶ CLOSED (at the handshake, unlogged)
    TCP accepted ──CURVE handshake (the peer proves its key)──▶ ZAP REQUEST
    ZAP REQUEST ──key admitted in the socket's domain──▶ OPEN, every message's User-Id = owner
    ZAP REQUEST ──key not admitted──▶ CLOSED (ZMTP ERROR 400; logged once per key)
    OPEN ──the owner's key revoked──▶ OPEN (ZAP runs per connection; the owner of the socket
                                      closes what it no longer serves, e.g. an engine detaches)

A socket with a `ConnectionGate` (an engine's input) also refuses, past its connection cap, a
handshake that proves no cluster key (ZAP status 400, logged as the limit at most once per
5 s instead of once per unknown key); admitted keys always get in. A socket
made open (`open_server`, an engine run without CURVE) admits peers without CURVE through the
same handler, so its cap holds too.

An engine's side of a client's attach, on top of it (`shoal.engine.core.core_io`):

    OPEN as "client:<i>" ──HELLO with client_index i──▶ engine connects a CURVE PUSH to the
        HELLO's output address, with client i's public key as the server key: only the holder
        of client i's secret can take those outputs
    OPEN as "client:<i>" ──HELLO with any other index──▶ refused (a HELLO cannot claim another
        client's index, nor detach it)

With `ZAP_ENFORCE_DOMAIN` a server whose process has no handler refuses every connection: a
missing handler closes the data plane, never opens it. This module knows nothing of engines,
clients or Ray.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from shoal.engine.core.connection_gate import ConnectionGate

logger = logging.getLogger(__name__)

# ZAP domains: which key ring a server socket's connections are checked against.
ENGINE_INPUT_DOMAIN = "shoal-engine-input"  # clients → an engine's ROUTER
CLIENT_OUTPUT_DOMAIN = "shoal-client-output"  # engines → a client's PULL
STATS_IN_DOMAIN = "shoal-stats-in"  # engines → the coordinator's PULL
STATS_OUT_DOMAIN = "shoal-stats-out"  # clients ← the coordinator's XPUB

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_POLL_MS = 100
# Distinct refused keys remembered (each is logged once); past it, counting starts afresh.
_MAX_REMEMBERED_REFUSALS = 4096


@dataclass(frozen=True)
class CurveKeyPair:
    """A CURVE key pair, both halves Z85-encoded (40 bytes). The secret never leaves the
    process that made it, except to a child process it starts."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


@dataclass(frozen=True)
class EngineKeys:
    """What an engine needs to close its data plane.

    Args:
        engine: the engine's own key pair (its input ROUTER's server key, and the key its
            PUSHes to clients and its stats PUSH authenticate with).
        clients: client index → public key of each client admitted from the start.
        coordinator: the coordinator's public key (the server key of its stats PULL); None
            when the engine reports no stats.
    """

    engine: CurveKeyPair
    clients: Mapping[int, bytes] = field(default_factory=dict)
    coordinator: bytes | None = None


def client_key_name(client_index: int) -> str:
    return f"client:{client_index}"


def engine_key_name(engine_index: int) -> str:
    return f"engine:{engine_index}"


def client_index_of(key_name: str | None) -> int | None:
    """The client index a connection's User-Id names, or None if it names no client."""
    if key_name is None or not key_name.startswith("client:"):
        return None
    digits = key_name.removeprefix("client:")
    return int(digits) if digits.isdigit() else None


class KeyRing:
    """The public keys admitted in one domain, each under its owner's name; thread-safe.

    Names are unique: admitting a name again replaces its key.
    """

    def __init__(self, keys: Mapping[str, bytes] | None = None) -> None:
        self._lock = threading.Lock()
        self._name_by_key: dict[bytes, str] = {}
        self._key_by_name: dict[str, bytes] = {}
        for name, key in (keys or {}).items():
            self.admit(name, key)

    def admit(self, name: str, public_key: bytes) -> None:
        """Admits `public_key` (Z85) as `name`, in place of the key `name` had.

        Raises:
            ValueError: the key is not a 40-character Z85 CURVE key.
        """
        if len(public_key) != 40:
            raise ValueError(f"a CURVE public key is 40 Z85 characters, got {len(public_key)}")
        z85.decode(public_key)  # refuses a malformed key here, not at every handshake
        with self._lock:
            self._revoke_locked(name)
            self._name_by_key[public_key] = name
            self._key_by_name[name] = public_key

    def revoke(self, name: str) -> None:
        """Takes `name`'s key out (unknown names are ignored)."""
        with self._lock:
            self._revoke_locked(name)

    def name_of(self, public_key: bytes) -> str | None:
        with self._lock:
            return self._name_by_key.get(public_key)

    def key_of(self, name: str) -> bytes | None:
        with self._lock:
            return self._key_by_name.get(name)

    def _revoke_locked(self, name: str) -> None:
        old = self._key_by_name.pop(name, None)
        if old is not None:
            del self._name_by_key[old]


def curve_server(socket: zmq.Socket, keys: CurveKeyPair, domain: str) -> None:
    """Makes `socket` (before it binds) a CURVE server whose peers the ZAP handler of its
    context checks against the key ring of `domain`."""
    socket.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def open_server(socket: zmq.Socket, domain: str) -> None:
    """Makes `socket` (before it binds) a server without CURVE whose handshakes still pass the
    ZAP handler (an open domain: its connection cap, if it has one, applies)."""
    socket.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def curve_client(socket: zmq.Socket, keys: CurveKeyPair, server_key: bytes) -> None:
    """Makes `socket` (before its next connect) a CURVE client of the server `server_key`.

    The server key applies to the connects that follow: a socket that connects to several
    servers (a client's input ROUTER) calls `set_server_key` before each.
    """
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    set_server_key(socket, server_key)


def set_server_key(socket: zmq.Socket, server_key: bytes) -> None:
    socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)


def peer_name(frame: zmq.Frame) -> str | None:
    """Who sent a message received with copy=False: its connection's key owner, or None on a
    socket without CURVE."""
    try:
        name = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return name if isinstance(name, str) and name else None


class ZapHandler(threading.Thread):
    """Answers ZAP requests of one ZMQ context: admits a CURVE peer only if its key is in the
    ring of the socket's domain. Bound when built, so servers made after it are covered.

    Args:
        ctx: the context whose server sockets it answers for (one handler per context).
        rings: domain → the keys admitted there; None: an open domain, where peers without
            CURVE (the NULL mechanism) are admitted, unnamed.
        owner: how log lines name the process ("engine 2", "client 5", "coordinator").
        gates: domain → the cap on that domain's socket's connections
            (`shoal.engine.core.connection_gate`); the handler polls their monitors.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        rings: Mapping[str, KeyRing | None],
        owner: str,
        gates: Mapping[str, ConnectionGate] | None = None,
    ) -> None:
        super().__init__(name=f"ZapHandler[{owner}]", daemon=True)
        self._rings = dict(rings)
        self._gates = dict(gates or {})
        self._owner = owner
        self._socket = ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(_ZAP_ENDPOINT)
        self._stop_event = threading.Event()
        self._refused: set[bytes] = set()
        self.num_refused = 0

    def stop(self) -> None:
        """Asks the thread to exit within ~0.1 s; it closes its socket. Thread-safe."""
        self._stop_event.set()

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stops the thread and waits for it; returns whether it has ended.

        Before its context is destroyed: `destroy` closes every socket from the calling
        thread, this one's among them while it polls them, which libzmq does not survive
        (it aborts in this thread). Only once this returns True may the context go.
        """
        self.stop()
        self.join(timeout_s)
        return not self.is_alive()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        gates = {gate.events: gate for gate in self._gates.values()}
        for events in gates:
            poller.register(events, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                for socket, _ in poller.poll(_ZAP_POLL_MS):
                    if socket is self._socket:
                        self._socket.send_multipart(self._answer(self._socket.recv_multipart()))
                    elif (gate := gates.get(socket)) is not None:
                        gate.on_events()
        except zmq.ZMQError:  # the context was terminated (or destroyed) under it
            pass
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:  # libzmq never sends this; answer so the REP stays in step
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain_bytes, address, _, mechanism = request[:6]
        if version != b"1.0":
            return [b"1.0", request_id, b"500", b"unsupported ZAP version", b"", b""]
        domain = domain_bytes.decode(errors="replace")
        if domain not in self._rings:
            return [version, request_id, b"400", b"unknown domain", b"", b""]
        ring = self._rings[domain]
        name: str | None = None
        public_key: bytes | None = None
        if ring is None:  # an open socket: any peer without CURVE, as room allows
            if mechanism != b"NULL":
                return [version, request_id, b"400", b"no CURVE on this socket", b"", b""]
        else:
            if mechanism != b"CURVE" or len(request) != 7:
                return [version, request_id, b"400", b"CURVE only", b"", b""]
            public_key = z85.encode(request[6])
            name = ring.name_of(public_key)
        # The cap first: past it, a flood of made-up keys costs one rate-limited line, not a
        # line per key.
        gate = self._gates.get(domain)
        if gate is not None:
            refusal = gate.refusal(name is not None, address.decode(errors="replace"))
            if refusal is not None:
                return [version, request_id, *refusal, b"", b""]
        if public_key is not None and name is None:
            self._log_refusal(public_key, address, domain_bytes)
            return [version, request_id, b"400", b"key not admitted", b"", b""]
        return [version, request_id, b"200", b"OK", (name or "").encode(), b""]

    def _log_refusal(self, public_key: bytes, address: bytes, domain: bytes) -> None:
        self.num_refused += 1
        if public_key in self._refused:
            return  # logged once per key: a peer that retries is not a line per attempt
        if len(self._refused) >= _MAX_REMEMBERED_REFUSALS:
            self._refused.clear()
        self._refused.add(public_key)
        logger.warning(
            "%s refused a connection from %s on %s: its key %s is not admitted",
            self._owner,
            address.decode(errors="replace"),
            domain.decode(errors="replace"),
            public_key.decode(),
        )


class ClientCurve:
    """A client's side of CURVE: its key pair, and the engines whose outputs its PULL takes.

    Args:
        ctx: the client's synchronous context (its ZAP handler runs there).
        keys: the client's key pair; its public key is what the engines admit.
        owner: how log lines name the client.
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeyPair, owner: str) -> None:
        self.keys = keys
        self._engines = KeyRing()
        self._zap = ZapHandler(ctx, {CLIENT_OUTPUT_DOMAIN: self._engines}, owner)
        self._zap.start()

    def secure_output_socket(self, socket: zmq.Socket) -> None:
        """The output PULL (before it binds): only admitted engines may push to it."""
        curve_server(socket, self.keys, CLIENT_OUTPUT_DOMAIN)

    def secure_input_socket(self, socket: zmq.Socket) -> None:
        """The input ROUTER: each connect names its engine's key (`admit_engine`)."""
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)

    def admit_engine(self, input_socket: zmq.Socket, engine_index: int, public_key: bytes) -> None:
        """Before the input ROUTER connects to an engine: trusts the engine's key as the server
        of that connection, and admits it to push outputs (replacing the index's old key)."""
        self._engines.admit(engine_key_name(engine_index), public_key)
        set_server_key(input_socket, public_key)

    def secure_stats_socket(self, socket: zmq.Socket, coordinator_key: bytes) -> None:
        """The stats SUB (before it connects): subscribes only to the real coordinator."""
        curve_client(socket, self.keys, coordinator_key)

    def close(self) -> bool:
        """Stops the ZAP handler (`ZapHandler.close`); returns whether it has ended."""
        return self._zap.close()


def attach_refusal(engine_index: int, engine_key: bytes, has_keys: bool) -> str | None:
    """Why a client with (or without) a key pair cannot attach to an engine, or None.

    Both ends use CURVE or neither does: a client without keys learns at once that it cannot
    attach, instead of waiting for a handshake that cannot succeed.
    """
    if engine_key and not has_keys:
        return (
            f"engine {engine_index} admits only the cluster's own clients (CURVE) and this "
            "client holds no key: attach through the cluster (AsyncLLM.connect), which hands "
            "out keys through the registry"
        )
    if has_keys and not engine_key:
        return f"engine {engine_index} runs without CURVE and this client requires it"
    return None
