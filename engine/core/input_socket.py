"""The engine's input socket: a bound ROUTER every handshake of which passes the ZAP handler.

With keys, the ROUTER is a CURVE server that admits only the keys on its ring
(`shoal.engine.core.curve`); without, it is open. Either way the handler holds the cap on
connections (`shoal.engine.core.connection_gate`). The ROUTER goes to the input thread
(`shoal.engine.core.core_io`), which closes it; this object keeps the rest: the handler's thread,
the gate, and the socket file's folder with ipc.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Literal

import zmq

from shoal.engine.core.connection_gate import ConnectionGate, raise_open_file_limit
from shoal.engine.core.curve import (
    ENGINE_INPUT_DOMAIN,
    EngineKeys,
    KeyRing,
    ZapHandler,
    client_key_name,
    curve_server,
    open_server,
)

Transport = Literal["tcp", "ipc"]

# How long a connection to the input socket may take to complete its handshake.
HANDSHAKE_IVL_MS = 5000
# The largest message a peer may send (a prompt of a million tokens is ~5 MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class InputSocket:
    """Binds engine `engine_index`'s input ROUTER and starts its ZAP handler.

    Args:
        ctx: the engine's ZMQ context.
        host: interface to bind for tcp.
        transport: "tcp" (port chosen by the OS) or "ipc" (a socket file in a temp dir).
        keys: the engine's and its admitted clients' keys; None: an open socket.
        max_connections: past this many connections a handshake is refused unless it proves
            a cluster key.

    Raises:
        ValueError: an unknown transport.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        engine_index: int,
        host: str,
        transport: Transport,
        keys: EngineKeys | None,
        max_connections: int,
    ) -> None:
        if transport not in ("tcp", "ipc"):
            raise ValueError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
        raise_open_file_limit()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # A peer that connects and never completes a handshake holds a descriptor this long.
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.router = router
        self.client_keys: KeyRing | None = None
        self.gate = ConnectionGate(ctx, router, max_connections, f"engine {engine_index}'s input")
        if keys is not None:
            self.client_keys = KeyRing({client_key_name(i): key for i, key in keys.clients.items()})
            curve_server(router, keys.engine, ENGINE_INPUT_DOMAIN)
        else:
            open_server(router, ENGINE_INPUT_DOMAIN)
        self._zap = ZapHandler(
            ctx,
            {ENGINE_INPUT_DOMAIN: self.client_keys},
            f"engine {engine_index}",
            gates={ENGINE_INPUT_DOMAIN: self.gate},
        )
        self._zap.start()
        self._ipc_dir: str | None = None
        if transport == "tcp":
            port = router.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix="shoal-")
            self.address = f"ipc://{self._ipc_dir}/engine-{engine_index}.sock"
            router.bind(self.address)

    def stop_handler(self) -> bool:
        """Stops the ZAP handler, then closes the gate; once the IO threads have stopped.

        Returns:
            Whether the handler has ended (only then may the context be destroyed).
        """
        if not self._zap.close():
            return False
        self.gate.close()
        return True

    def remove_files(self) -> None:
        """Removes the ipc socket's folder (nothing with tcp)."""
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
