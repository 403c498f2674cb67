"""A cap on the connections one server socket holds, enforced at the handshake.

libzmq accepts every TCP connection a bound socket is offered and has no per-socket limit, so
the gate counts them itself, from the socket's monitor (`ACCEPTED` and `DISCONNECTED` both
carry the connection's descriptor), and the process's ZAP handler (`shoal.engine.core.curve`) asks
it at each handshake whether there is room. State of one connection as the gate sees it:

    ACCEPTED ──▶ LIVE (counted: handshaking, open, or waiting to be closed)
    LIVE ──DISCONNECTED (peer gone, handshake refused, or no handshake within HANDSHAKE_IVL)──▶ gone

At the handshake (ZAP), with `live` the connections counted:

    live ≤ max_connections (this one counted)  ──▶ admitted as the key ring decides
    live > max_connections, a cluster key      ──▶ admitted: a flood never shuts out the
                                                   cluster's own peers
    live > max_connections, any other peer     ──▶ refused at once: ZAP status 400, which the
                                                   peer's monitor reports as
                                                   HANDSHAKE_FAILED_AUTH (400) and libzmq does
                                                   not retry; the engine logs the limit

(Not ZAP's "temporary" 300: libzmq answers it with no ERROR, so the peer would hang until
the handshake interval and then retry, which is no refusal at all.)

A connection that never starts its handshake never reaches the gate: it holds its descriptor
until the socket's `HANDSHAKE_IVL` closes it (the engine sets it short, and raises its
open-file limit with `raise_open_file_limit`). The gate is owned by the thread that polls
`events` (the ZAP handler's); `live` may be read from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import uuid

import zmq

from shoal.engine.core.rate_limit import LogRateLimiter

logger = logging.getLogger(__name__)

# The most connections an engine's input socket holds before it admits only cluster keys.
MAX_CONNECTIONS = 1024

_LIMIT_STATUS = b"400"
_warnings = LogRateLimiter(logger)


def raise_open_file_limit() -> None:
    """Raises this process's soft limit on open files to the hard limit: each connection and
    attached client holds descriptors, and a limit of 1024 would cap an engine at a few
    hundred clients, well below its connection cap."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as e:  # not POSIX, or not allowed
        logger.debug("open file limit left as it is: %s", e)


class ConnectionGate:
    """Counts the live connections of one bound socket and says when it is full.

    Args:
        ctx: the socket's context (the monitor's reader lives there, on an inproc address).
        socket: the server socket, before it binds (so no connection goes uncounted).
        max_connections: past this many live connections, only cluster keys are admitted.
        owner: how log lines name the socket ("engine 2's input").
    """

    def __init__(
        self, ctx: zmq.Context, socket: zmq.Socket, max_connections: int, owner: str
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self._owner = owner
        self._socket = socket
        address = f"inproc://connection-gate-{uuid.uuid4().hex}"
        socket.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.events = ctx.socket(zmq.PAIR)
        self.events.setsockopt(zmq.LINGER, 0)
        self.events.connect(address)
        self._live: set[int] = set()  # descriptors of the connections counted
        self.num_refused = 0

    @property
    def live(self) -> int:
        return len(self._live)

    def on_events(self) -> None:
        """Takes the monitor events waiting (the owner's thread, when `events` is readable)."""
        while True:
            try:
                event_frame, _endpoint = self.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event, descriptor = struct.unpack("=HI", event_frame[:6])
            if event == zmq.EVENT_ACCEPTED:
                self._live.add(descriptor)
            else:  # DISCONNECTED: the only other event subscribed
                self._live.discard(descriptor)

    def refusal(self, is_cluster_peer: bool, peer_address: str) -> tuple[bytes, bytes] | None:
        """The ZAP status and text refusing a handshake for lack of room, or None to go on."""
        self.on_events()  # the count as of this handshake
        if is_cluster_peer or self.live <= self.max_connections:
            return None
        self.num_refused += 1
        _warnings.warning(
            f"connection-limit:{self._owner}",
            "%s holds %d connections, its maximum: refused %s, and admits only cluster keys "
            "until connections close",
            self._owner,
            self.live,
            peer_address,
        )
        text = f"at its connection limit ({self.max_connections}); only cluster keys are admitted"
        return _LIMIT_STATUS, text.encode()

    def close(self) -> None:
        """Stops the monitoring (the socket first, so its monitor never writes to a closed
        reader), then closes the reader. The owner's thread, once it polls no more."""
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self.events.close(linger=0)
